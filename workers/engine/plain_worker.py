"""The step worker, what `EngineCore` runs each scheduled batch with, and `PlainWorker`, the
worker without speculation.

The engine holds one worker and calls it the same way whether it can speculate or not
(`StepWorker`): launch a batch, resolve the pending step (at once, or a call later with
overlap scheduling), then let the worker decide the next step and hand its drafts to the
scheduler. The `SpeculativeWorker` (spec/worker.py) drafts and verifies; `PlainWorker`
runs the runner's own steps and is speculation that is off for good: its controller
(`NoSpeculation`) never turns on, it makes no drafts and its figures stay zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

from specd.workers.engine.batch import DraftTokenIds, ModelOutput, ScheduledBatch
from specd.workers.engine.sequence import Sequence as Seq
from specd.workers.engine.sequence import any_counts_its_tokens
from specd.workers.runner.model_runner import ModelRunner, PendingOutput
from specd.workers.spec.controller import SpecEvent
from specd.workers.spec.step import SpecFigures
from specd.workers.structured.outputs import StructuredOutput


class Pending(Protocol):
    """A launched step: `resolve()` is the host's only read of it."""

    def resolve(self) -> ModelOutput: ...


P = TypeVar("P", bound=Pending)


class Controller(Protocol):
    """What the engine reads and sets of a worker's speculation control (`SpecController`,
    `NoSpeculation`)."""

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes `set_mode` accepts."""
        ...

    @property
    def mode(self) -> str: ...

    @property
    def enabled(self) -> bool:
        """Whether the coming steps draft."""
        ...

    @property
    def num_transitions(self) -> int: ...

    def set_mode(self, mode: str, threshold: int | None = None,
                 resume_at: int | None = None) -> SpecEvent | None:
        """Change mode (ValueError for one it does not accept); the event if the state
        changed."""
        ...

    def record(self, batch_size: int, speculated: bool, step_s: float,
               num_tokens: int) -> None:
        """One finished step's figures (`speculated`: the state it ran in)."""
        ...

    def forget_measurements(self) -> None: ...

    def measured_table(self) -> dict[str, list[float]]:
        """Measured output tokens/s per load bucket: "~N" -> [on, off]."""
        ...


class StepWorker(Protocol[P]):
    """The contract between `EngineCore` and a worker (P: its pending step).

    Per step: `launch(batch)`; the engine resolves the pending step and applies it to the
    scheduler; `ran_speculating` (read first) and `update_controller` (the decision for the
    coming steps); `take_draft_token_ids` (the scheduler's one door for drafts) once the
    decision is made. Overlapped, the next step is launched before the one in flight is
    resolved, and only while `can_overlap` says so.
    """

    @property
    def runner(self) -> ModelRunner:
        """The target's runner (KV blocks, backend)."""
        ...

    @property
    def controller(self) -> Controller: ...

    @property
    def figures(self) -> SpecFigures:
        """Cumulative speculation figures."""
        ...

    @property
    def speculative(self) -> bool:
        """Whether the worker can speculate at all (status)."""
        ...

    @property
    def graph_memory_bytes(self) -> int:
        """Memory of captured graphs, taken from the KV-cache budget."""
        ...

    def launch(self, batch: ScheduledBatch) -> P:
        """Launch one step; nothing is read on the host."""
        ...

    def can_overlap(self, in_flight: P | None, running: Sequence[Seq]) -> bool:
        """Whether the next step can be launched before `in_flight` (the step in flight,
        if any) is resolved, given the running sequences."""
        ...

    def ran_speculating(self, pending: P, overlapped: bool) -> bool:
        """The state a resolved step ran in, read before `update_controller`. overlapped:
        it was resolved a call after its launch (decisions were made meanwhile)."""
        ...

    def update_controller(self, batch_size: int) -> SpecEvent | None:
        """Decide whether the coming steps speculate; the event if the state changed."""
        ...

    def take_draft_token_ids(self, on_device: bool) -> DraftTokenIds:
        """The drafts the last launched step made, once (see `SpeculativeWorker`)."""
        ...

    def reset_after_failure(self, request_ids: Iterable[str]) -> None:
        """A step failed and the scheduler was reset: forget what was derived from the
        step(s) that failed and from the KV cache of `request_ids`."""
        ...

    def request_figures(self, request_id: str) -> tuple[int, int]:
        """(drafted, accepted) so far for a request."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request."""
        ...

    def graphs_status(self) -> str:
        """What replays captured or compiled steps, for status."""
        ...


class NoSpeculation:
    """The controller of an engine without a draft model: always off; `set_mode` accepts
    "off" only."""

    modes: tuple[str, ...] = ("off",)
    mode = "off"
    enabled = False
    num_transitions = 0

    def set_mode(self, mode: str, threshold: int | None = None,
                 resume_at: int | None = None) -> None:
        if mode != "off":
            raise ValueError(f"spec mode {mode!r} needs a draft model; this engine has "
                             "none (speculative_algorithm or draft_model unset)")

    def record(self, batch_size: int, speculated: bool, step_s: float,
               num_tokens: int) -> None:
        """Nothing to decide, so nothing measured."""

    def forget_measurements(self) -> None:
        """Nothing measured."""

    def measured_table(self) -> dict[str, list[float]]:
        return {}


class PlainWorker:
    """Plain decoding behind the step worker's interface: every step is `runner`'s own, its
    constrained rows masked by `structured`."""

    speculative = False

    def __init__(self, runner: ModelRunner, structured: StructuredOutput) -> None:
        self.runner = runner
        self.structured = structured
        self.controller = NoSpeculation()
        self.figures = SpecFigures()  # zero: nothing is drafted

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one whole step: `launch(batch).resolve()`."""
        return self.launch(batch).resolve()

    def launch(self, batch: ScheduledBatch) -> PendingOutput:
        return self.runner.launch(batch, self.structured.start_masks(batch, {}))

    def can_overlap(self, in_flight: PendingOutput | None, running: Sequence[Seq]) -> bool:
        """Unless a running request has penalties or a structured constraint (they count
        every earlier token, which must be on the host: `any_counts_its_tokens`)."""
        return not any_counts_its_tokens(running)

    def ran_speculating(self, pending: PendingOutput, overlapped: bool) -> bool:
        return False

    def update_controller(self, batch_size: int) -> None:
        """Nothing to decide: off for good."""

    def take_draft_token_ids(self, on_device: bool) -> DraftTokenIds:
        return DraftTokenIds()

    def reset_after_failure(self, request_ids: Iterable[str]) -> None:
        """The runner's kept decode K/V may hold what the failed step wrote."""
        self.runner.invalidate_decode_stage()

    def request_figures(self, request_id: str) -> tuple[int, int]:
        return (0, 0)

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)

    def graphs_status(self) -> str:
        return self.runner.backend.status()

    @property
    def graph_memory_bytes(self) -> int:
        return self.runner.backend.memory_bytes
