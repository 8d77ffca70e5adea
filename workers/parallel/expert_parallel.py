"""Expert parallelism (`--expert-parallel`): whole routed experts on each rank.

Rank r holds the contiguous experts `local_experts(E, par)` at full width (the loader reads
no other expert's tensors). After the attention all-reduce every rank has every token, so
the router (replicated) chooses the same experts on every rank. Dispatch maps each (token,
slot) pair's expert through the rank's expert map (global id -> local id, -1 where another
rank holds it: `local_expert_ids`) and hands every pair to the routed experts, which skip the
pairs of -1 (workers/models/moe.py's `experts_forward`): fixed shapes, nothing read on the
host, so the forward captures as a CUDA graph. The shared experts are split across ranks like
a dense MLP. The decoder layer's one all-reduce then sums routed and shared parts of every
rank: the single-node form vLLM runs with an `expert_map`, no all-to-all.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from specd.workers.models.deepseek_config import MoeConfig
from specd.workers.models.layers import LinearFactory
from specd.workers.models.moe import GatedMLP, TopkRouter, build_routed_experts, experts_forward
from specd.workers.parallel.context import ParallelContext
from specd.workers.parallel.sharding import local_experts


class ExpertParallelMoE(nn.Module):
    """Router (all experts), this rank's routed experts and its part of the shared experts:
    x [M, H] -> this rank's partial sum [M, H] (the caller all-reduces)."""

    def __init__(self, cfg: MoeConfig, hidden_size: int, prefix: str,
                 make_linear: LinearFactory, par: ParallelContext) -> None:
        super().__init__()
        self.experts_range = local_experts(cfg.num_routed_experts, par)
        self.gate = TopkRouter(cfg, hidden_size)
        # Dense or INT4 as the checkpoint stores them, numbered from the rank's first.
        self.experts = build_routed_experts(
            replace(cfg, num_routed_experts=len(self.experts_range)), hidden_size,
            f"{prefix}.experts", make_linear)
        shared = cfg.moe_intermediate_size * cfg.num_shared_experts
        self.shared_experts = (
            GatedMLP(hidden_size, par.split(shared, "the shared experts' width")[1],
                     f"{prefix}.shared_experts", make_linear) if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)  # [M, k] each, over all experts
        y = self.dispatch_combine(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def dispatch_combine(self, x: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor) -> torch.Tensor:
        """The weighted outputs of the local experts' (token, slot) pairs, summed per token:
        [M, H] in x's dtype (zeros for a token none of whose experts is local)."""
        local_ids = local_expert_ids(topk_ids, self.experts_range)
        return experts_forward(x, local_ids, topk_weights, self.experts.weights())


def local_expert_ids(topk_ids: torch.Tensor, experts: range) -> torch.Tensor:
    """The expert map of a rank holding the contiguous `experts`, applied: topk_ids [M, k]
    (global ids) -> [M, k] local ids (id - experts.start), -1 where another rank holds the
    expert. Elementwise, on the device."""
    local = topk_ids - experts.start
    return torch.where((local >= 0) & (local < len(experts)), local, -1)
