"""The token masks of one step, and where they are applied.

`StructuredOutput.start_masks` lays out one host row per constrained position of the step (a
plain sample: one row; a verify: one per tree node, root first) and starts filling them on
the mask thread; the step's forward runs meanwhile. The sampler and the verifier then apply
them (`apply` for plain sampled rows, `apply_tree` for verified trees), which is where the
host first waits for the thread; the rows go to the device once per step. A step without
constrained rows is `NO_MASKS`: nothing is computed, waited for or copied.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from specd.workers.engine.sequence import Sequence as Seq
from specd.workers.runner.host_copy import upload
from specd.workers.runner.sampler import apply_token_masks


@dataclass
class MaskFigures:
    """Cumulative figures (mutable counters): rows filled, the mask thread's seconds filling
    them, and the seconds the host waited for them (what the forward did not hide)."""

    num_rows: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0


class StepMasks:
    """One step's masks: `layout` maps a request id to (first row, rows) in `host` (int32
    [R, W], filled when `filled` is done); the wait for them is added to `figures`."""

    def __init__(self, layout: dict[str, tuple[int, int]], host: torch.Tensor | None,
                 filled: Future[None] | None, figures: MaskFigures | None = None) -> None:
        self.layout = layout
        self.host = host
        self.filled = filled
        self.figures = MaskFigures() if figures is None else figures
        self._device: torch.Tensor | None = None  # the rows on the device, once copied

    def apply(self, logits: torch.Tensor, seqs: Sequence[Seq]) -> torch.Tensor:
        """logits [M, V] with each constrained sequence's row (row i for seqs[i]) masked:
        disallowed tokens at -inf (float32); `logits` itself when no row is constrained."""
        picks = [(i, self.layout[s.request_id][0]) for i, s in enumerate(seqs)
                 if s.request_id in self.layout]
        if not picks:
            return logits
        return self._apply(logits, [i for i, _ in picks], [r for _, r in picks])

    def apply_tree(self, logits: torch.Tensor, seqs: Sequence[Seq]) -> torch.Tensor:
        """logits [B, T, V] of verified trees (tree b for seqs[b], row j its node j) with
        each constrained tree's nodes masked (as `apply`)."""
        batch, width, vocab = logits.shape
        rows: list[int] = []
        sources: list[int] = []
        for b, s in enumerate(seqs):
            if s.request_id in self.layout:
                first, num_rows = self.layout[s.request_id]
                if num_rows > width:
                    raise ValueError(f"request {s.request_id}: {num_rows} mask rows for a "
                                     f"verify of {width}")
                rows += [b * width + j for j in range(num_rows)]
                sources += range(first, first + num_rows)
        if not rows:
            return logits
        return self._apply(logits.reshape(batch * width, vocab), rows, sources).view(
            batch, width, vocab)

    def _apply(self, logits: torch.Tensor, rows: list[int], sources: list[int]) -> torch.Tensor:
        device = logits.device
        masks = self._on(device)
        index = upload(torch.tensor(sources, dtype=torch.int64), device)
        return apply_token_masks(logits, upload(torch.tensor(rows, dtype=torch.int64), device),
                                 masks[index])

    def _on(self, device: torch.device) -> torch.Tensor:
        """The filled rows on `device` (waits for the mask thread, copies once)."""
        if self._device is None:
            if self.host is None or self.filled is None:
                raise ValueError("a step without masks has no rows to apply")
            started = time.perf_counter()
            self.filled.result()  # raises what the fill raised
            self.figures.wait_s += time.perf_counter() - started
            self._device = upload(self.host, device)
        return self._device


NO_MASKS = StepMasks({}, None, None)
