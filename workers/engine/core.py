"""The engine: `EngineCore`, step-level, driven by the scheduler process and by the
in-process API (`engine_api.Engine`).

One step reads `schedule -> execute -> update`. The engine holds one step worker
(workers/engine/plain_worker.py): the speculative worker with a draft model, the plain worker
without, both behind the same interface, so the loop has no branch on whether speculation
exists. A step that raises is isolated (workers/engine/isolation.py): the request that caused it
fails, the others go on. A structured-output request (workers/structured/) has its grammar
compiled when it is added and advanced on the tokens each step keeps; one whose grammar
fails ends with an error, the others going on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specd.ipc.sampling import SamplingParams
from specd.logs import one_line
from specd.workers.config import EngineConfig, EngineResolved
from specd.workers.engine.batch import PromptLogprobs, ScheduledBatch, TokenLogprobs
from specd.workers.engine.isolation import Isolation, describe
from specd.workers.engine.plain_worker import Pending, StepWorker
from specd.workers.engine.records import EngineStats, RequestDelta
from specd.workers.engine.scheduler import Scheduler
from specd.workers.engine.sequence import FinishReason
from specd.workers.engine.sequence import Sequence as Seq
from specd.workers.engine.setup import build_worker, engine_resolved, log_switch, max_model_len
from specd.workers.engine.warmup import warm_up
from specd.workers.models.config import ModelConfig
from specd.workers.parallel.driver import RankFailed
from specd.workers.spec.acceptance_watch import AcceptanceWatch
from specd.workers.spec.worker import SpeculativeWorker
from specd.workers.structured.outputs import StructuredOutput

log = logging.getLogger("specd.engine")


@dataclass(frozen=True)
class _Launched:
    """A launched step whose results the host has not read yet (the worker's pending
    step), and when it was scheduled."""

    batch: ScheduledBatch
    pending: Pending
    t0: float


class EngineCore:
    """Scheduler + step worker. Built whole or not at all (construction raises)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_path)
        # Constrained requests' grammars and masks, over the model's own vocabulary (read
        # from its tokenizer files here: the front's tokenizer stays in the front).
        self.structured = StructuredOutput(
            config.model_path, self.model_config.vocab_size, self.model_config.eos_token_ids,
            torch.device(config.device))
        # With a draft model the speculative worker (whose runner captures the head's
        # hidden states every step), else the plain worker.
        self.worker: StepWorker[Any] = build_worker(config, self.model_config, self.structured)
        self.runner = self.worker.runner  # the target's
        self.max_model_len = max_model_len(config, self.model_config, self.runner.num_kv_blocks)
        self.scheduler = Scheduler(
            config, self.runner.num_kv_blocks, self.max_model_len, self.model_config.eos_token_ids
        )
        self.overlap = config.overlap_enabled
        self._in_flight: _Launched | None = None  # overlap: the launched, unprocessed step
        self._last_finish = 0.0
        # Whether work was left when the last step finished: then the time until the next
        # step (the scheduler process's messaging, new requests) is part of serving it.
        self._busy_after_last = False
        # request id -> number of output tokens already reported in a delta
        self._num_emitted: dict[str, int] = {}
        # request id -> log-probabilities of its prompt tokens 1, 2, ... computed so far,
        # until its first delta carries them (requests that asked only)
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self._num_steps = 0
        self._num_generated = 0
        self.isolation = Isolation()
        # Whether speculation pays (a head of another model drafts nothing useful); the
        # plain worker's figures stay zero, and its depth is 0: never judged.
        self.acceptance = AcceptanceWatch(len(self.worker.figures.accepted_at_depth))
        self._outbox: list[RequestDelta] = []  # the deltas of the step call in progress
        # The batches that call scheduled or resolved: the failed step(s) if it raises.
        self._attempted: list[ScheduledBatch] = []

    @property
    def spec(self) -> SpeculativeWorker | None:
        """The speculative worker, for tests and tools that read its parts; None without a
        draft model. The engine itself only talks to `worker`."""
        return self.worker if isinstance(self.worker, SpeculativeWorker) else None

    @property
    def resolved(self) -> EngineResolved:
        """What the engine found at start-up (and what its graphs or compiled decode came
        to, which warm-up may change: a compilation that failed)."""
        return engine_resolved(self.config, self.worker, self.model_config, self.max_model_len,
                               self.structured)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        """Queue a request. ValueError for a duplicate id, an empty or too-long prompt,
        token ids (of the prompt or of logit_bias) outside the vocabulary, or a structured
        constraint that does not compile (or structured output off)."""
        if request_id in self._num_emitted:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; this model allows at most "
                f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        bad = [t for t in sampling.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {bad[:5]}")
        seq = Seq(request_id, prompt_token_ids, sampling)
        if sampling.structured is not None:
            self.structured.add(request_id, sampling.structured)
        try:
            self.scheduler.add(seq)
        except ValueError:
            self.structured.release(request_id)
            raise
        self._num_emitted[request_id] = 0
        if sampling.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = []

    def abort_request(self, request_id: str) -> bool:
        """Abort a queued or running request; False if it is unknown or already done."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._forget(request_id)
        return True

    def close(self) -> None:
        """Release what outlives the object: the worker ranks of a tensor-parallel model
        (nothing in one process) and the mask thread. The engine is unusable after."""
        self.runner.close()
        self.structured.close()

    def on_rank_failure(self, callback: Callable[[Exception], None]) -> None:
        """`callback(error)` from a watch thread when a tensor-parallel rank or node is
        found failed while this process may be waiting for it (a node gone silent): the
        scheduler process ends itself there (a step would otherwise wait in a collective).
        Without it the next step raises the error."""
        self.runner.on_rank_failure(callback)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or self._in_flight is not None
                or self.isolation.is_active)

    @property
    def num_steps(self) -> int:
        """Steps whose results were applied so far (a step that scheduled nothing is none)."""
        return self._num_steps

    def request_ids(self) -> list[str]:
        """Every request the engine holds unfinished (waiting, running, in a step in flight,
        or set aside by isolation), in arrival order: what the front reconciles its open
        requests against (`messages.Holding`)."""
        return list(self.scheduler.sequences)

    def step(self, isolate: bool = True) -> list[RequestDelta]:
        """One engine step: schedule -> execute -> update. Returns a delta per request that
        got tokens or finished.

        With overlap scheduling the step is split: schedule and launch step N, then
        process step N - 1's results (which the host reads only now), so the deltas lag
        one call behind. Speculative steps overlap too (spec/worker.py: accepted counts
        and drafts stay on the device); when the worker cannot overlap (speculation turned
        off with drafts waiting) the step in flight is drained and one whole step runs.

        A step that raises is isolated (workers/engine/isolation.py): the request it is blamed
        on gets a last delta with finish reason "error" and `error` set; StepFailed when
        no request can be blamed. `isolate=False` (warm-up, where a failing path is a bug
        in the code, not a request's fault): the exception leaves as raised.
        """
        self._attempted = []
        num_steps = self._num_steps
        alone = self.isolation.next_alone(self.scheduler.sequences)
        try:
            self._execute(alone)
        except RankFailed:
            raise  # a tensor-parallel rank is gone: no request is to blame
        except Exception as exc:  # noqa: BLE001 - blamed on a request, or StepFailed
            if not isolate:
                raise
            self._recover(exc, alone)
        else:
            self.isolation.after_step(self.scheduler.sequences, self._num_steps > num_steps)
        for request_id, error in self.isolation.take_culprits().items():
            self._end_with_error(request_id, describe(error))
        deltas, self._outbox = self._outbox, []
        return deltas

    def _end_with_error(self, request_id: str, error: str) -> None:
        """End a request with finish reason "error" and `error` (its last delta)."""
        seq = self.scheduler.abort(request_id, FinishReason.ERROR)
        if seq is not None:  # not aborted meanwhile
            self._outbox.append(dataclasses.replace(self._delta(seq, []), error=error))

    def _execute(self, alone: str | None) -> None:
        """Overlapped (launch this step, then process the one in flight) or whole (launch
        and process at once): of every request, or of `alone` only (isolation)."""
        if alone is None and self._can_overlap():
            self._step_overlapped()
            return
        self._drain()
        # The next step runs from what the host knows: drafts made on the device by the
        # step just drained are not verified (the sequences decode one plain step).
        self.scheduler.drop_lagged_drafts()
        self._step_whole(alone)

    def _can_overlap(self) -> bool:
        """Whether the next step can be launched before the one in flight is read: with
        overlap scheduling, unless the worker needs a whole step (speculation turned off
        with drafts waiting: `SpeculativeWorker.can_overlap`)."""
        in_flight = None if self._in_flight is None else self._in_flight.pending
        return self.overlap and self.worker.can_overlap(in_flight, self.scheduler.running)

    def _step_overlapped(self) -> None:
        launched = self._launch()
        self._drain()
        # Drafts for the sequences of the step just launched (made by it, or by the
        # worker turning speculation on in `_drain`) stay on the device: the next step
        # verifies them lagged.
        self.scheduler.update_draft_token_ids(self.worker.take_draft_token_ids(on_device=True))
        self._in_flight = launched

    def _step_whole(self, alone: str | None) -> None:
        launched = self._launch(alone)
        if launched is None:
            return
        self._finish(launched, overlapped=False)
        # Its drafts, read on the host: after update, which consumed the previous ones.
        self.scheduler.update_draft_token_ids(self.worker.take_draft_token_ids(on_device=False))

    def _launch(self, alone: str | None = None) -> _Launched | None:
        """schedule -> launch (nothing read on the host); None if nothing was scheduled."""
        t0 = time.perf_counter()
        batch = (self.scheduler.schedule() if alone is None
                 else self.scheduler.schedule_alone(alone))
        if batch.is_empty:
            return None
        self._attempted.append(batch)
        return _Launched(batch, self.worker.launch(batch), t0)

    def _drain(self) -> None:
        """Process the step in flight, if any (its results reach the host here)."""
        if self._in_flight is None:
            return
        launched, self._in_flight = self._in_flight, None
        self._attempted.append(launched.batch)
        self._finish(launched, overlapped=True)

    def _finish(self, launched: _Launched, overlapped: bool) -> None:
        """resolve -> update -> deltas (to the outbox at once: a later part of the step
        that raises does not lose them) -> the worker's decision for the coming steps, and
        the step's figures for its controller. `overlapped`: resolved a call after launch."""
        batch, pending = launched.batch, launched.pending
        output = pending.resolve()
        for request_id, computed in output.prompt_logprobs.items():
            self._add_prompt_logprobs(request_id, computed)
        updated = self.scheduler.update(batch, output)
        failed = self.structured.advance(updated)  # grammars take the tokens kept
        self._outbox += [self._delta(seq, output.logprobs.get(seq.request_id, []))
                         for seq in updated if seq.request_id not in failed]
        for request_id, error in failed.items():
            log.error("request %s failed: %s", request_id, error,
                      extra={"event": "request_failed", "request_id": request_id})
            self._end_with_error(request_id, f"structured output: {error}")
        speculated = self.worker.ran_speculating(pending, overlapped)  # before the decision
        log_switch(self.worker.update_controller(self.scheduler.num_running))
        figures = self.worker.figures
        self.acceptance.observe(figures.num_verify_passes, figures.num_accepted)
        step_s = self._step_time(launched.t0)
        # Every step is a sample of the state it ran in, prefill and all (drafting for the
        # next step included): what a mode yields is its regime's throughput, request
        # turnover included. The controller leaves out the steps around each switch.
        if step_s > 0:
            self.worker.controller.record(len(batch.scheduled), speculated, step_s,
                                          sum(len(t) for t in output.sampled.values()))
        self._num_steps += 1

    def _recover(self, error: Exception, alone: str | None) -> None:
        """After a step raised: blame it (StepFailed if no request can be), drop what was
        in flight, reset the scheduler and the worker, and report what the failed step(s)
        applied before raising (tokens, finished sequences: without log-probs)."""
        if self._in_flight is not None:
            self._attempted.append(self._in_flight.batch)
        seqs: dict[str, Seq] = {}
        for batch in self._attempted:
            for item in batch.scheduled:
                seqs.setdefault(item.seq.request_id, item.seq)
        arrival = self.scheduler.arrival_index
        suspects = sorted((r for r in seqs if r in arrival), key=arrival.__getitem__)
        self.isolation.on_failure(error, alone, suspects)
        self._in_flight = None
        self.scheduler.reset_after_failure()
        self.worker.reset_after_failure(self.scheduler.sequences)
        for seq in seqs.values():
            emitted = self._num_emitted.get(seq.request_id)
            if emitted is not None and (seq.is_finished or seq.num_output_tokens > emitted):
                self._outbox.append(self._delta(seq, []))

    def _step_time(self, t0: float) -> float:
        """The finished step's share of wall time: since the previous step finished if that
        one left work behind (the gap between steps, spent by the caller on messaging and
        new requests, is part of the cost of serving: without it a mode that emits more
        tokens per step, and so more messages, would look cheaper than it is), else since
        this step started (the engine was idle)."""
        now = time.perf_counter()
        step_s = now - (self._last_finish if self._busy_after_last else t0)
        self._last_finish = now
        self._busy_after_last = self.scheduler.has_unfinished()
        return step_s

    def _add_prompt_logprobs(self, request_id: str, computed: PromptLogprobs) -> None:
        """Keep a step's prompt log-probabilities for the request's first delta. Rows
        computed again (a preempted request recomputes its prompt) are not kept twice."""
        kept = self._prompt_logprobs.get(request_id)
        if kept is None or request_id not in self._num_emitted:
            return  # reported already, or the request ended
        skip = len(kept) + 1 - computed.start
        if skip < 0:
            raise ValueError(f"request {request_id}: prompt log-probabilities from token "
                             f"{computed.start}, but only {len(kept)} are known before it")
        kept += computed.logprobs[skip:]

    def _delta(self, seq: Seq, logprobs: list[TokenLogprobs]) -> RequestDelta:
        start = self._num_emitted.get(seq.request_id, 0)
        new = seq.output_token_ids[start:]
        prompt: list[TokenLogprobs] = []
        if new and seq.request_id in self._prompt_logprobs:
            prompt = self._prompt_logprobs.pop(seq.request_id)
        self._num_emitted[seq.request_id] = seq.num_output_tokens
        self._num_generated += len(new)
        reason = seq.finish_reason.value if seq.finish_reason is not None else None
        drafted, accepted = self.worker.request_figures(seq.request_id)
        if seq.is_finished:
            self._forget(seq.request_id)
        return RequestDelta(
            request_id=seq.request_id,
            new_token_ids=new,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs[: len(new)],
            num_drafted=drafted,
            num_accepted=accepted,
            prompt_logprobs=prompt,
        )

    def _forget(self, request_id: str) -> None:
        self._num_emitted.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        self.worker.release(request_id)
        self.structured.release(request_id)

    def set_spec_mode(self, mode: str, threshold: int | None = None) -> None:
        """Change speculation at run time: mode on|off|auto, and the auto threshold (the
        resume mark follows it). ValueError for a bad mode/threshold, or for on/auto
        without a draft model."""
        log_switch(self.worker.controller.set_mode(mode, threshold))

    def warmup(self) -> None:
        """Run every decode path the configuration enables (workers/engine/warmup.py): a broken
        path fails start-up with its own exception, not the first request that takes it.
        Its steps are not the workload: the figures status reports start from zero."""
        warm_up(self)
        self.forget_figures()

    def forget_figures(self) -> None:
        """Zero the figures status reports (steps, tokens, drafts, speculation's
        measurements): after warm-up, the engine's and the front's (whose requests are not
        the workload either). Mode and marks stay."""
        self._num_steps = 0
        self._num_generated = 0
        self.worker.figures.reset()
        self.worker.controller.forget_measurements()
        self.acceptance.reset()

    def stats(self) -> EngineStats:
        blocks = self.scheduler.block_manager
        fig, controller = self.worker.figures, self.worker.controller
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=self.runner.num_kv_blocks,
            num_free_kv_blocks=blocks.num_free_blocks,
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated,
            num_preemptions=self.scheduler.stats().num_preemptions,
            spec_mode=controller.mode,
            spec_active=controller.enabled,
            num_drafted=fig.num_drafted,
            num_accepted=fig.num_accepted,
            num_verify_passes=fig.num_verify_passes,
            acceptance_length=fig.acceptance_length,
            accepted_at_depth=tuple(fig.accepted_at_depth),
            spec_transitions=controller.num_transitions,
            draft_s=fig.draft_s,
            verify_s=fig.verify_s,
            catch_up_s=fig.catch_up_s,
            spec_measured_tok_s=controller.measured_table(),
            num_step_failures=self.isolation.num_step_failures,
            num_requests_failed=self.isolation.num_requests_failed,
            # One line each, cut at a word if long (the record of each has it whole).
            fallbacks={f.name: one_line(f.reason) for f in self.runner.backend.fallbacks()},
            vocab_size=self.model_config.vocab_size,
            problems=self.acceptance.problems(),
            spec_threshold=None if self.spec is None else self.spec.controller.threshold,
            spec_resume_at=None if self.spec is None else self.spec.controller.resume_at,
        )
