"""Captured draft loops: the whole multi-step EAGLE-3 drafting of a batch as one graph.

The draft loop (`SpeculativeWorker.draft_loop`) runs `spec_num_steps` small forwards of the
one-layer head plus the top-k and tree bookkeeping: a few hundred kernel launches for a
few microseconds of work each. Its shapes are fixed by the batch size and the width of the
draft K/V prefix it attends to, so it is captured per (batch size, prefix width): batch
sizes from `graphs.capture_sizes`, widths powers of two from 64 up to the longest
sequence, at most `MAX_GRAPH_PREFIX` (a wider prefix would make every replay gather that
much K/V; longer sequences draft eagerly).

Static inputs (`DraftInputs` at the largest shape): the last catch-up output [P, H], the
prefix slots and their validity [P, W], the root positions and root tokens [P]. Padding
rows attend to no prefix (validity False), only to their own drafts; their outputs are
dropped. Outputs (the tree and per-row NaN flags) are valid until the next replay: the
worker reads them on the host at once. Capture failures are reported as in graphs.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specd.workers.runner.graphs import CudaGraph, EagerGraph, capture_all, padded_size
from specd.workers.spec.tree import DraftTree

MAX_GRAPH_PREFIX = 4096
MIN_GRAPH_PREFIX = 64


@dataclass(frozen=True)
class DraftInputs:
    """One draft loop's inputs for B sequences, prefix padded to W positions.

    last_out [B, H]: the head's output of each sequence's last pair (from the catch-up).
    prefix_slots int64 [B, W]: draft-cache slots of positions [0, W); prefix_ok bool [B, W]:
    which are real. roots int64 [B]: each root's position; root_ids int64 [B]: its token.
    """

    last_out: torch.Tensor
    prefix_slots: torch.Tensor
    prefix_ok: torch.Tensor
    roots: torch.Tensor
    root_ids: torch.Tensor

    def rows(self, num_rows: int, width: int) -> DraftInputs:
        """Views of the first rows and prefix columns (of a static buffer)."""
        return DraftInputs(self.last_out[:num_rows], self.prefix_slots[:num_rows, :width],
                           self.prefix_ok[:num_rows, :width], self.roots[:num_rows],
                           self.root_ids[:num_rows])


DraftOutputs = tuple[DraftTree, torch.Tensor]  # the tree [B, T] each, NaN flags [B]
DraftShape = tuple[int, int]  # (batch size, prefix width)


def prefix_widths(max_seq_len: int) -> tuple[int, ...]:
    """Powers of two from MIN_GRAPH_PREFIX covering max_seq_len, capped at MAX_GRAPH_PREFIX."""
    widths = [MIN_GRAPH_PREFIX]
    while widths[-1] < min(max_seq_len, MAX_GRAPH_PREFIX):
        widths.append(widths[-1] * 2)
    return tuple(widths)


class DraftGraphs:
    """Graphs of `loop` at every (batch size, width) of `batch_sizes` x `widths`."""

    def __init__(self, loop: Callable[[DraftInputs], DraftOutputs], batch_sizes: Sequence[int],
                 widths: Sequence[int], hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.device = device
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.widths = tuple(sorted(widths))
        self._loop = loop
        p, w = self.batch_sizes[-1], self.widths[-1]
        self.static = DraftInputs(
            last_out=torch.zeros(p, hidden_size, dtype=dtype, device=device),
            prefix_slots=torch.zeros(p, w, dtype=torch.int64, device=device),
            prefix_ok=torch.zeros(p, w, dtype=torch.bool, device=device),
            roots=torch.zeros(p, dtype=torch.int64, device=device),
            root_ids=torch.zeros(p, dtype=torch.int64, device=device))
        self.graphs: dict[DraftShape, EagerGraph[DraftOutputs] | CudaGraph[DraftOutputs]] = {}
        self.error: str | None = None
        self.memory_bytes = 0
        self.replays: Counter[DraftShape] = Counter()
        self.num_eager = 0

    def capture(self, trial: bool = False) -> None:
        """Capture every shape, largest first (see graphs.capture_all for failures and for
        `trial`, a capture made only to measure `memory_bytes`)."""
        shapes = sorted(((b, w) for b in self.batch_sizes for w in self.widths), reverse=True)
        self.graphs, self.error, pool_bytes = capture_all(
            shapes, self._bound_loop, self.device, "draft loop", trial)
        static = (self.static.last_out, self.static.prefix_slots, self.static.prefix_ok,
                  self.static.roots, self.static.root_ids)
        self.memory_bytes = pool_bytes + sum(t.numel() * t.element_size() for t in static)

    def shape_for(self, batch: int, width: int) -> DraftShape | None:
        """The captured shape for `batch` sequences whose longest prefix is `width`."""
        if not self.graphs:
            return None
        size = padded_size(self.batch_sizes, batch)
        fitting = padded_size(self.widths, width)
        return None if size is None or fitting is None else (size, fitting)

    def run(self, shape: DraftShape, inputs: DraftInputs) -> DraftOutputs:
        """Copy the inputs (prefix already `shape[1]` wide) into the static buffers, pad the
        rest, replay; the outputs' first rows are views valid until the next replay."""
        s, b = self.static, inputs.last_out.shape[0]
        size, width = shape
        s.last_out[:b].copy_(inputs.last_out)
        s.last_out[b:size].zero_()
        s.prefix_slots[:b, :width].copy_(inputs.prefix_slots)
        s.prefix_slots[b:size].zero_()
        s.prefix_ok[:b, :width].copy_(inputs.prefix_ok)
        s.prefix_ok[b:size].zero_()
        s.roots[:b].copy_(inputs.roots)
        s.roots[b:size].zero_()
        s.root_ids[:b].copy_(inputs.root_ids)
        s.root_ids[b:size].zero_()
        tree, nan_rows = self.graphs[shape].replay()
        self.replays[shape] += 1
        return DraftTree(tree.token_ids[:b], tree.parents[:b], tree.depths[:b],
                         tree.tree_mask[:b]), nan_rows[:b]

    def status(self) -> str:
        if self.error is not None:
            return f"draft loop eager ({self.error})"
        return (f"draft loop at {','.join(map(str, self.batch_sizes))} x prefix "
                f"{self.widths[0]}-{self.widths[-1]}; {self.memory_bytes / 2**20:.2f} MiB")

    def _bound_loop(self, shape: DraftShape) -> Callable[[], DraftOutputs]:
        inputs = self.static.rows(*shape)
        return lambda: self._loop(inputs)
