"""The vocab-parallel token embedding: each rank holds a contiguous range of the vocabulary.

A rank looks up the ids in its range, writes zeros for the others, and the all-reduce sums
the ranks' rows into every token's embedding (vLLM's VocabParallelEmbedding). The logits
side is the lm_head as a column-parallel linear over the same ranges, gathered by
`ParallelContext.gather_last`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.parallel.context import ParallelContext


class VocabParallelEmbedding(nn.Module):
    """ids int64 [N] -> [N, hidden]; `weight` [vocab / world_size, hidden] holds ids
    [rank * vocab / world_size, + vocab / world_size) (the checkpoint's rows of this rank)."""

    def __init__(self, vocab_size: int, hidden_size: int, par: ParallelContext) -> None:
        super().__init__()
        self.par = par
        self.start, self.num_local = par.split(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [N, hidden]
        return self.par.all_reduce(out.masked_fill(outside[:, None], 0))


def make_embedding(vocab_size: int, hidden_size: int, par: ParallelContext) -> nn.Module:
    """`nn.Embedding` in one process (today's path exactly), the vocab-parallel one above."""
    if not par.is_parallel:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, par)
