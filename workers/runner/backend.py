"""How the target's forward and the draft head's draft loop run on a device: the interface the
model runner and the speculative worker call, and the eager backend.

The runner owns the model, the KV cache and the step's bookkeeping (placeholders, sampling);
a backend only decides how a forward over prepared inputs is executed, and what it keeps
between forwards to do that faster. Three satisfy the interface:

* `EagerBackend` (here): every forward runs the model eagerly (CUDA without graphs).
* `CpuBackend` (cpu_backend.py): the CPU's paths: packed bf16 linears, plain decode over
  kept K/V (decode_stage.py), and with `--cpu-compile` compiled decode and verify steps
  (cpu_decode.py), mixed steps split into a compiled decode and an eager rest, and the
  compiled draft loop (cpu_draft.py).
* `GraphBackend` (graph_backend.py): captured forwards (CUDA graphs, or their synchronous
  CPU stand-in) for plain decode and verify, and captured draft loops.

The runner picks one (`ModelRunner._make_backend`); nothing outside the backends tests
which one it has.

Tensor parallelism: every rank holds a backend of the same kind over its own shard and
cache. Rank 0's announces each model execution to the other ranks (`peers.call`,
workers/parallel/peers.py: a forward, one part of a split CPU step, the kept K/V dropped),
and theirs run it (`follow`), so a compiled or captured step runs on every rank with its
collectives inside, each rank having captured the same shapes.

A capture or compilation that fails is one of the documented fallbacks: the part runs
eagerly from then on, the failure is logged once (an ERROR record with the traceback) and
`Backend.fallbacks` names it with its reason, for `specctl status` and `specctl doctor`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specd.workers.engine.batch import ScheduledBatch
from specd.workers.engine.sequence import Sequence as Seq
from specd.workers.models.registry import CausalLM
from specd.workers.parallel.peers import NO_PEERS, Peers
from specd.workers.runner.attention import AttentionMetadata
from specd.workers.runner.step_inputs import StepInputs, prepare_inputs
from specd.workers.spec.draft_graphs import DraftInputs, DraftOutputs

Outputs = tuple[torch.Tensor, torch.Tensor | None]  # hidden [N, H], aux [N, A] or None
# The runner's input ids of prepared inputs, placeholders of in-flight samples resolved.
InputIds = Callable[[StepInputs], torch.Tensor]
DraftLoop = Callable[[DraftInputs], DraftOutputs]


@dataclass(frozen=True)
class StepForward:
    """A plain step's forward: hidden [N, H] and aux [N, A] (or None) in the batch's row
    layout, the rows that sample int64 [M], their sequences and their sample ids."""

    hidden: torch.Tensor
    aux: torch.Tensor | None
    sample_rows: torch.Tensor
    sample_seqs: list[Seq]
    sample_ids: list[int]


@dataclass(frozen=True)
class Fallback:
    """A documented degraded mode in force: `name` is the option whose work now runs eagerly
    and the part ("cuda_graphs", "cpu_compile_draft_loop", ...), `reason` the failure."""

    name: str
    reason: str


@dataclass(frozen=True)
class DraftLoopShape:
    """What a backend needs to prepare the draft loop: the head's hidden size and dtype,
    the most sequences a step drafts for and the longest sequence."""

    hidden_size: int
    dtype: torch.dtype
    max_num_seqs: int
    longest_sequence: int


class DraftLoopRunner(ABC):
    """Runs the draft head's loop (`Drafter.draft_loop`: inputs -> tree and NaN flags)."""

    @property
    def memory_bytes(self) -> int:
        """Memory of captured draft loops, for status (0 unless captured)."""
        return 0

    def prefix_width(self, batch: int, width: int) -> int:
        """The prefix width to pad the inputs of `batch` sequences to, whose longest prefix
        is `width` (a captured loop replays a fixed width)."""
        del batch
        return width

    @abstractmethod
    def run(self, inputs: DraftInputs) -> DraftOutputs:
        """The loop's outputs for `inputs` (valid until the next call)."""

    def status(self) -> str:
        """One part of `specctl status`; empty when the loop runs eagerly by design."""
        return ""

    def fallback(self) -> Fallback | None:
        """Set when a capture or compilation of the loop failed and it runs eagerly."""
        return None


class EagerDraftLoop(DraftLoopRunner):
    """The draft loop as Python calls it."""

    def __init__(self, loop: DraftLoop) -> None:
        self.loop = loop

    def run(self, inputs: DraftInputs) -> DraftOutputs:
        return self.loop(inputs)


class Backend(ABC):
    """Runs `model` over the paged cache `kv_caches` (its layers' tensors of
    `ModelConfig.kv_layer_shape`: per-head K/V, or MLA's latent rows), leaving the hidden
    states of `capture_layers` in the aux output (see `ModelRunner`). Built whole by the
    runner (`ModelRunner._make_backend`).

    Contract: `forward` and `forward_step` store the step's K/V in the cache. Whatever a
    backend keeps derived from the cache between forwards is its own business, provided
    the runner calls `kv_changed` whenever the cache is written some other way.

    peers: the other ranks, told of every model execution first (module docstring;
    NO_PEERS in one process and on ranks 1..N-1, which `follow`).
    """

    # Whether steps compile on their first call (warm-up then runs every step kind).
    compiles = False

    def __init__(self, model: CausalLM, capture_layers: Sequence[int],
                 kv_caches: list[torch.Tensor], block_size: int,
                 peers: Peers = NO_PEERS) -> None:
        self.model = model
        self.capture_layers = tuple(capture_layers)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = kv_caches[0].device
        self.peers = peers
        self.draft_loops: list[DraftLoopRunner] = []  # made by draft_loop_runner

    def forward_step(self, batch: ScheduledBatch, input_ids: InputIds) -> StepForward:
        """A plain step (no drafts) over `batch`: one forward over `prepare_inputs`."""
        inputs = prepare_inputs(batch, self.block_size, self.device)
        hidden, aux = self.forward(input_ids(inputs), inputs)
        return StepForward(hidden, aux, inputs.sample_rows, inputs.sample_seqs,
                           inputs.sample_ids)

    def forward(self, input_ids: torch.Tensor, inputs: StepInputs) -> Outputs:
        """The model over prepared inputs (any step: verify, mixed, prefill) -> (hidden, aux);
        `input_ids` are the inputs' ids with placeholders resolved. Announced to the other
        ranks (op "forward")."""
        with self.peers.call("forward", input_ids, inputs.positions, inputs.meta):
            return self.run(input_ids, inputs)

    @abstractmethod
    def run(self, input_ids: torch.Tensor, inputs: StepInputs) -> Outputs:
        """`forward` on this rank alone."""

    def kv_changed(self) -> None:  # noqa: B027 - most backends keep nothing to forget
        """The cache was written outside this backend's forwards (K/V moved, a step that
        failed half way): forget whatever was derived from it (on every rank)."""

    def follow(self, op: str, args: tuple[object, ...]) -> None:
        """Run on this rank (1..N-1) what rank 0's backend of the same kind announced:
        (op, args) as its `peers.call` sent them. Outputs are dropped: rank 0 has its own."""
        if op == "forward":
            input_ids, positions, meta = args
            inputs = follower_inputs(input_ids, positions, self.adopt(meta))
            self.run(inputs.input_ids, inputs)
        elif op == "kv_changed":
            self.kv_changed()
        else:
            raise ValueError(f"{type(self).__name__} has no call {op!r}")

    def adopt(self, meta: object) -> AttentionMetadata:
        """Rank 0's attention metadata as this rank's (what it refers to of the sender's,
        this rank's own instead); as it came, for a backend that keeps nothing."""
        if not isinstance(meta, AttentionMetadata):
            raise TypeError(f"a forward call carries AttentionMetadata, got {type(meta)}")
        return meta

    def draft_loop_runner(self, loop: DraftLoop, shape: DraftLoopShape) -> DraftLoopRunner:
        """How the draft head's loop runs on this backend (called once, by the worker); kept,
        so that `fallbacks` covers it."""
        runner = self.make_draft_loop(loop, shape)
        self.draft_loops.append(runner)
        return runner

    @abstractmethod
    def make_draft_loop(self, loop: DraftLoop, shape: DraftLoopShape) -> DraftLoopRunner:
        """This backend's runner of the draft loop (see `draft_loop_runner`)."""

    def prepare_draft_head(self, head: torch.nn.Module) -> None:
        """Lay the draft head's weights out as this backend runs the target's (the CPU
        backend packs its linears); by default nothing. Called once, before the head's first
        forward."""
        del head

    def status(self) -> str:
        """The target's part of `specctl status` ("off" when nothing is captured or
        compiled)."""
        return "off"

    def linears_status(self) -> str:
        """How the target's dense linears run, for `specctl status`: as the model built them
        here; the CPU backend says whether oneDNN packs them, and why not."""
        return "nn.Linear"

    def fallbacks(self) -> list[Fallback]:
        """Every fallback in force, the target's and the draft loop's (module docstring);
        empty when everything runs as configured."""
        loops = [runner.fallback() for runner in self.draft_loops]
        return self.target_fallbacks() + [f for f in loops if f is not None]

    def target_fallbacks(self) -> list[Fallback]:
        """The target forward's fallbacks (none for the eager backend: eager by design)."""
        return []

    @property
    def memory_bytes(self) -> int:
        """Memory the backend holds besides the model and the cache (captured graphs)."""
        return 0

    def eager(self, input_ids: torch.Tensor, inputs: StepInputs) -> Outputs:
        """The model run eagerly over the paged cache."""
        return self.model(input_ids, inputs.positions, self.kv_caches, inputs.meta,
                          self.capture_layers)


def follower_inputs(input_ids: object, positions: object, meta: AttentionMetadata
                    ) -> StepInputs:
    """The step inputs of a forward rank 0 announced: its ids, positions and metadata (a
    rank other than 0 samples nothing)."""
    if not isinstance(input_ids, torch.Tensor) or not isinstance(positions, torch.Tensor):
        raise TypeError("a forward call carries input ids and positions as tensors")
    return StepInputs(input_ids=input_ids, positions=positions, meta=meta,
                      sample_rows=torch.empty(0, dtype=torch.int64), sample_seqs=[])


class EagerBackend(Backend):
    """Every forward and the draft loop run eagerly; nothing is kept between forwards."""

    def run(self, input_ids: torch.Tensor, inputs: StepInputs) -> Outputs:
        return self.eager(input_ids, inputs)

    def make_draft_loop(self, loop: DraftLoop, shape: DraftLoopShape) -> DraftLoopRunner:
        del shape
        return EagerDraftLoop(loop)
