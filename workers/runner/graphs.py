"""Captured forwards (CUDA graphs) for the steps whose shape repeats: plain decode and verify.

A decode step of a small batch launches hundreds of small kernels; on a GPU launching them
can cost as much as running them. A CUDA graph records the launches of one forward once
and replays them with one call. A graph reads fixed addresses, so it is captured over
*static* input buffers, for a fixed shape, and every step copies its inputs into them.

Shapes (`GraphShape`): `num_seqs` sequences of `query_len` rows each, with or without a
tree mask. Plain decode is query_len 1; verification is query_len = the drafts + 1 (chain:
causal, tree: masked). Each is captured at a ladder of batch sizes (`capture_sizes`); a
step of B sequences replays the smallest captured size >= B, its extra *padding rows*
writing only into one spare KV block (`pad_block`, one past the blocks the scheduler
owns) and attending only to it; their outputs are dropped. A step of another shape, or
larger than the largest size, runs eagerly.

Static buffers: input ids, positions and slot mapping [max_tokens]; seq_lens [max_seqs];
block_tables [max_seqs, table_width] (int32, as the attention kernel reads them); the tree
mask [max_tokens]; one query_start_loc per query length (never changes). Outputs (hidden
[N, H] and the captured aux rows) live in the graph's memory pool and are overwritten by
the next replay, so `run` returns copies.

On the CPU the same pipeline runs with a synchronous stand-in (`EagerGraph`: "replay" calls
the forward over the static buffers), so padding, the static copies and the routing are
exercised in CI; only the recording of launches is CUDA's.

A capture that fails is not swallowed: `GraphRunner` logs one ERROR record with the
reason and traceback, drops every graph, runs eagerly, and says so in `status`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import torch

from specd.workers.runner.attention import AttentionMetadata, build_attention_metadata

log = logging.getLogger("specd.graphs")

BATCH_SIZE_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

Outputs = tuple[torch.Tensor, torch.Tensor | None]  # hidden [N, H], aux [N, A] or None
T = TypeVar("T")  # what a captured forward returns
K = TypeVar("K")  # what identifies a graph (its shape)
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], Outputs]


@dataclass(frozen=True, order=True)
class GraphShape:
    """One captured forward: num_seqs sequences of query_len rows (tree-masked or causal)."""

    num_seqs: int
    query_len: int
    tree_mask: bool

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.query_len


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture: the ladder up to max_num_seqs, and max_num_seqs itself."""
    sizes = [s for s in BATCH_SIZE_LADDER if s < max_num_seqs]
    return (*sizes, max_num_seqs)


def padded_size(sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest captured size that holds num_seqs, or None (run eagerly)."""
    fitting = [s for s in sizes if s >= num_seqs]
    return min(fitting) if fitting else None


class EagerGraph(Generic[T]):
    """The CPU stand-in for a captured graph: `replay` runs the forward again."""

    def __init__(self, forward: Callable[[], T]) -> None:
        self._forward = forward
        self._forward()  # "capture": one run, so a failing forward fails here as on CUDA

    def replay(self) -> T:
        return self._forward()


class CudaGraph(Generic[T]):
    """A recorded forward: `replay` relaunches it; outputs are the same tensors each time."""

    # pool: torch.cuda.graph_pool_handle(), shared by every graph of a GraphRunner.
    def __init__(self, forward: Callable[[], T], pool: torch.cuda._POOL_HANDLE) -> None:
        # Warm up on a side stream first (Triton compiles its kernels, the allocator sees
        # the sizes), as torch.cuda.make_graphed_callables does, and capture on that same
        # stream: what the warm-up cached is that stream's, released when the capture
        # begins (torch.cuda.graph empties the cache), so the memory capture_all measures
        # is the graphs' pool alone.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=pool, stream=side):
            self._outputs = forward()
        torch.cuda.current_stream().wait_stream(side)

    def replay(self) -> T:
        self._graph.replay()
        return self._outputs


def capture_all(keys: Sequence[K], make_forward: Callable[[K], Callable[[], T]],
                device: torch.device, what: str, trial: bool = False
                ) -> tuple[dict[K, EagerGraph[T] | CudaGraph[T]], str | None, int]:
    """One graph per key, in the given order (largest first: they share one memory pool):
    (graphs, None, pool bytes), or on any failure ({}, the reason, pool bytes) after one
    ERROR record with the key, the reason and the traceback (the caller runs eagerly; a
    `trial` capture, made only to measure, logs its failure at INFO: the capture proper
    fails too and reports it). Pool bytes: the device's reserved memory after the captures
    less before, with the allocator's cache emptied at both ends, so that nothing but the
    graphs' pool (and what their outputs hold) is counted."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
    graphs: dict[K, EagerGraph[T] | CudaGraph[T]] = {}
    error = None
    key = None
    try:
        for key in keys:
            forward = make_forward(key)
            graphs[key] = CudaGraph(forward, pool) if cuda else EagerGraph(forward)
    except Exception as exc:  # noqa: BLE001 - reported here, then eager by design
        graphs = {}
        error = f"capture of {key} failed: {type(exc).__name__}: {exc}"
        if trial:
            log.info("trial capture of the %s failed", what, exc_info=True, extra={
                "event": "graph_trial_capture_failed", "what": what, "shape": str(key),
                "reason": error})
        else:
            log.error("graph capture failed; the %s runs eagerly", what, exc_info=True,
                      extra={"event": "graph_capture_failed", "what": what,
                             "shape": str(key), "reason": error})  # traceback: exc_info
    pool_bytes = 0
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        pool_bytes = max(0, torch.cuda.memory_reserved(device) - before)
    return graphs, error, pool_bytes


@dataclass
class _Static:
    """The buffers every graph reads (see module docstring); padding rows by default."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    tree_mask: torch.Tensor
    query_start_loc: dict[int, torch.Tensor]
    pad_slots: torch.Tensor  # slot of padding row i: pad_block * block_size + i % block_size

    def nbytes(self) -> int:
        tensors = [self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                   self.block_tables, self.tree_mask, self.pad_slots,
                   *self.query_start_loc.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


class GraphRunner:
    """Graphs of `forward` (the model over the paged cache) for `shapes`, or none at all.

    forward(input_ids [N], positions [N], meta) -> (hidden, aux): must read nothing but its
    arguments and the KV cache (whose storage must not move after capture).
    pad_block: a KV block no sequence owns. table_width: block-table columns (covers the
    longest sequence plus its drafts). max_seq_len: the KV length the attention kernel's
    launch is sized for.
    """

    def __init__(self, forward: Forward, shapes: Sequence[GraphShape], device: torch.device,
                 block_size: int, pad_block: int, table_width: int, max_seq_len: int) -> None:
        self.device = device
        self.block_size = block_size
        self.pad_block = pad_block
        self.max_seq_len = max_seq_len
        self.shapes = tuple(sorted(set(shapes), reverse=True))  # largest first: pool reuse
        self._forward = forward
        self.static = _allocate_static(self.shapes, device, block_size, pad_block, table_width)
        self.graphs: dict[GraphShape, EagerGraph[Outputs] | CudaGraph[Outputs]] = {}
        self.error: str | None = None  # why capture failed (everything runs eagerly then)
        self.memory_bytes = 0  # static buffers + the graphs' memory pool
        self.replays: Counter[GraphShape] = Counter()  # per shape, for tests and status
        self.num_eager = 0  # forwards of this runner's model that ran without a graph

    def capture(self) -> None:
        """Capture every shape; on any failure log it (ERROR, with traceback), drop them
        all and run eagerly. Sets `memory_bytes`."""
        self.graphs, self.error, pool_bytes = capture_all(
            self.shapes, self._bound_forward, self.device, "target forward")
        self.memory_bytes = self.static.nbytes() + pool_bytes

    def shape_for(self, meta: AttentionMetadata) -> GraphShape | None:
        """The captured shape a step with this metadata replays, or None (eager)."""
        t = meta.uniform_query_len
        if not self.graphs or t is None or meta.block_tables.shape[1] > \
                self.static.block_tables.shape[1]:
            return None
        has_mask = meta.tree_mask is not None
        sizes = [s.num_seqs for s in self.graphs if s.query_len == t and s.tree_mask == has_mask]
        size = padded_size(sizes, meta.num_seqs)
        return None if size is None else GraphShape(size, t, has_mask)

    def run(self, shape: GraphShape, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> Outputs:
        """Copy the step into the static buffers (padding the rest), replay, and return
        copies of the real rows' outputs."""
        s, n, b = self.static, input_ids.shape[0], meta.num_seqs
        total = shape.num_tokens
        s.input_ids[:n].copy_(input_ids)
        s.input_ids[n:total].zero_()
        s.positions[:n].copy_(positions)
        s.positions[n:total].zero_()
        s.slot_mapping[:n].copy_(meta.slot_mapping)
        s.slot_mapping[n:total].copy_(s.pad_slots[: total - n])
        s.seq_lens[:b].copy_(meta.seq_lens)
        s.seq_lens[b: shape.num_seqs].fill_(shape.query_len)
        s.block_tables[:b, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        s.block_tables[b: shape.num_seqs].fill_(self.pad_block)
        if meta.tree_mask is not None:
            s.tree_mask[:n].copy_(meta.tree_mask)
            s.tree_mask[n:total].fill_(-1)
        hidden, aux = self.graphs[shape].replay()
        self.replays[shape] += 1
        # The pool's outputs are overwritten by the next replay: hand out copies.
        return hidden[:n].clone(), None if aux is None else aux[:n].clone()

    @property
    def num_replays(self) -> int:
        return sum(self.replays.values())

    def status(self) -> str:
        """One line for `specctl status`: what replays, or why nothing does."""
        if self.error is not None:
            return f"eager ({self.error})"
        kind = "cuda" if self.device.type == "cuda" else "cpu stand-in"
        parts = []
        for t, masked in sorted({(s.query_len, s.tree_mask) for s in self.graphs}):
            sizes = sorted(s.num_seqs for s in self.graphs
                           if s.query_len == t and s.tree_mask == masked)
            name = "decode" if t == 1 else f"verify T={t}{' tree' if masked else ''}"
            parts.append(f"{name} at {','.join(map(str, sizes))}")
        return f"{kind}: {'; '.join(parts)}; {self.memory_bytes / 2**20:.2f} MiB"

    def _bound_forward(self, shape: GraphShape) -> Callable[[], Outputs]:
        """The forward over the static buffers' first rows for `shape`."""
        n = shape.num_tokens

        def run() -> Outputs:
            return self._forward(self.static.input_ids[:n], self.static.positions[:n],
                                 self._meta(shape))

        return run

    def _meta(self, shape: GraphShape) -> AttentionMetadata:
        s, n, b = self.static, shape.num_tokens, shape.num_seqs
        tree_mask = s.tree_mask[:n] if shape.tree_mask else None
        if self.device.type == "cuda":
            # Views of the static buffers: the kernel reads them on the device at replay.
            return AttentionMetadata(
                query_start_loc=s.query_start_loc[shape.query_len][: b + 1],
                seq_lens=s.seq_lens[:b], block_tables=s.block_tables[:b],
                slot_mapping=s.slot_mapping[:n], tree_mask=tree_mask,
                max_query_len=shape.query_len, max_seq_len=self.max_seq_len,
                block_size=self.block_size, groups=(), num_seqs=b,
                uniform_query_len=shape.query_len)
        # CPU stand-in: the grouped CPU attention plans on the host from the buffers' values.
        lens = s.seq_lens[:b].tolist()
        bs = self.block_size
        tables = [row[: -(-length // bs)] for row, length in
                  zip(s.block_tables[:b].tolist(), lens, strict=True)]
        meta = build_attention_metadata([shape.query_len] * b, lens, tables, bs, self.device,
                                        tree_mask=tree_mask)
        return replace(meta, slot_mapping=s.slot_mapping[:n])


def _allocate_static(shapes: Sequence[GraphShape], device: torch.device, block_size: int,
                     pad_block: int, table_width: int) -> _Static:
    max_tokens = max((s.num_tokens for s in shapes), default=1)
    max_seqs = max((s.num_seqs for s in shapes), default=1)
    pad_slots = (pad_block * block_size
                 + torch.arange(max_tokens, device=device) % block_size)
    qsl = {t: torch.arange(0, (max_seqs + 1) * t, t, dtype=torch.int32, device=device)
           for t in {s.query_len for s in shapes}}
    max_t = max((s.query_len for s in shapes), default=1)
    return _Static(
        input_ids=torch.zeros(max_tokens, dtype=torch.int64, device=device),
        positions=torch.zeros(max_tokens, dtype=torch.int64, device=device),
        slot_mapping=pad_slots.clone(),
        seq_lens=torch.full((max_seqs,), max_t, dtype=torch.int32, device=device),
        block_tables=torch.full((max_seqs, table_width), pad_block, dtype=torch.int32,
                                device=device),
        tree_mask=torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=qsl,
        pad_slots=pad_slots,
    )
