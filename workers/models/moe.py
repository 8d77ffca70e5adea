"""DeepSeek-V3 mixture of experts: the router, the routed experts, the shared experts.

    y = sum_i w_i * Expert_{ids_i}(x) + SharedExperts(x)

The router (`route`, a pure function) works in float32 exactly as the checkpoint specifies
(`MoeConfig`): scores = sigmoid (or softmax) of x·W_gᵀ; noaux_tc chooses with scores +
e_score_correction_bias (the bias only chooses, the weights are the unbiased scores) among
the topk_group best of n_group groups, a group scoring the sum of its top two and dropped
groups masked with -inf; greedy takes the plain top-k. The weights are normalized when
norm_topk_prob (sum + 1e-20) and multiplied by routed_scaling_factor; the shared experts
are never scaled.

Dropped groups: transformers' `DeepseekV3TopkRouter` (the oracle of the tests) masks them
with -inf, as vLLM does; DeepSeek's reference code and SGLang mask with 0, which picks a
dropped expert when every kept choice score is negative (a negative bias). specd follows
transformers (-inf: a dropped group's expert is never chosen).

The routed experts are built dense (`RoutedExperts`) or INT4 (`Int4RoutedExperts`,
workers/models/moe_int4.py: Kimi's per-expert compressed-tensors tensors) as the checkpoint's
quantization_config says (`build_routed_experts`). All routed-expert computation goes
through `experts_forward(x, topk_ids, topk_weights, weights)`, whose ids may be -1 for a slot
whose expert this rank does not hold (expert parallelism: workers/parallel/expert_parallel.py).
On CUDA it is the fused MoE kernel (kernels/moe_w4a16.py) over either kind of weights: fixed
shapes, nothing read on the host, so the forward captures as a CUDA graph. On the CPU it is
the torch code that loops over the experts that received pairs (their bounds read on the host,
which is free there): for `ExpertWeights` (stacked dense weights) a sort of the (token, slot)
pairs by expert and one SwiGLU per expert, for `Int4ExpertWeights` (stacked compressed-tensors
INT4 experts) the kernel's reference, which dequantizes each expert that received pairs.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specd.kernels.moe_w4a16 import ExpertWeights, Int4ExpertWeights, fused_moe, fused_moe_ref
from specd.workers.models.deepseek_config import MoeConfig
from specd.workers.models.layers import LinearFactory
from specd.workers.models.moe_int4 import Int4RoutedExperts
from specd.workers.models.quantization import Int4LinearFactory

# A routed expert's checkpoint tensor: (module prefix, expert, projection, kind), the kind
# `weight` (dense) or one of compressed-tensors' pack-quantized tensors.
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\."
                           r"(?P<proj>gate|up|down)_proj\."
                           r"weight(?P<kind>|_packed|_scale|_zero_point|_shape)$")


def route(logits: torch.Tensor, correction_bias: torch.Tensor | None, cfg: MoeConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits float32 [M, E] -> (topk_ids int64 [M, k], topk_weights float32 [M, k]),
    per the module docstring. correction_bias float32 [E]: required for noaux_tc."""
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    k = cfg.num_experts_per_tok
    if cfg.topk_method == "greedy":
        weights, ids = torch.topk(scores, k, dim=-1, sorted=False)
    else:
        if correction_bias is None:
            raise ValueError("noaux_tc routing needs e_score_correction_bias")
        choice = scores + correction_bias  # [M, E], only to choose
        if cfg.n_group > 1:
            choice = _limit_groups(choice, cfg.n_group, cfg.topk_group)
        ids = torch.topk(choice, k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def _limit_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice [M, E] with every expert outside the topk_group best groups set to -inf."""
    m, e = choice.shape
    grouped = choice.view(m, n_group, e // n_group)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [M, n_group]
    best = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(m, e)


def experts_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    weights: ExpertWeights | Int4ExpertWeights) -> torch.Tensor:
    """x [M, H], topk_ids int64 [M, k] in [-1, E), topk_weights float32 [M, k] -> [M, H] in
    x's dtype: sum over slots j with an expert (topk_ids[m, j] >= 0) of topk_weights[m, j] *
    SwiGLU_{topk_ids[m, j]}(x[m]).

    CUDA: `fused_moe` over either kind of weights (no host read). CPU, INT4 weights: the
    kernel's reference. CPU, dense weights: the M * k (token, slot) pairs are sorted by
    expert (stable; ids -1 last), each expert that received pairs runs one gate/up and one
    down matmul over its contiguous rows, and the weighted rows are summed back into their
    tokens in float32. The loop runs over experts, never over tokens; the per-expert bounds
    are read on the host (free on the CPU).
    """
    if x.is_cuda:
        return fused_moe(x, topk_ids, topk_weights, weights)
    if isinstance(weights, Int4ExpertWeights):
        return fused_moe_ref(x, topk_ids, topk_weights, weights)
    num_tokens, top_k = topk_ids.shape
    num_experts = weights.num_experts
    flat_ids = topk_ids.reshape(-1)
    flat_ids = torch.where(flat_ids < 0, num_experts, flat_ids)  # not held: after the rest
    order = torch.argsort(flat_ids, stable=True)  # [M * k] pairs grouped by expert
    token_of = order // top_k  # [M * k] the token of each sorted pair
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts]  # [E]
    ends = counts.cumsum(0)
    x_sorted = x.index_select(0, token_of)  # [M * k, H]
    out = x.new_zeros(x_sorted.shape)  # pairs of no held expert stay zero
    for e in counts.nonzero().flatten().tolist():
        end = int(ends[e])
        rows = slice(end - int(counts[e]), end)
        gate, up = F.linear(x_sorted[rows], weights.w13[e]).chunk(2, dim=-1)
        out[rows] = F.linear(F.silu(gate) * up, weights.w2[e])
    weighted = out.float() * topk_weights.reshape(-1)[order].float()[:, None]
    summed = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return summed.index_add_(0, token_of, weighted).to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU MLP, gate and up fused into one linear (the loader stacks the checkpoint's
    gate_proj and up_proj into `gate_up_proj` by `shard_sizes`): down(silu(gate) * up)."""

    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str,
                 make_linear: LinearFactory) -> None:
        super().__init__()
        self.shard_sizes = (intermediate_size, intermediate_size)
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, False,
                                        (f"{prefix}.gate_proj", f"{prefix}.up_proj"))
        self.down_proj = make_linear(intermediate_size, hidden_size, False,
                                     (f"{prefix}.down_proj",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class TopkRouter(nn.Module):
    """The router's parameters, kept in float32 whatever dtype the model is cast to (as
    transformers keeps `gate.weight` and `e_score_correction_bias`): a bf16 bias would move
    the choice between close experts.

    weight [E, H]; e_score_correction_bias [E] (noaux_tc only).
    """

    e_score_correction_bias: nn.Parameter | None

    def __init__(self, cfg: MoeConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        num_experts = cfg.num_routed_experts
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32))
            if cfg.topk_method == "noaux_tc" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] -> (topk_ids int64 [M, k], topk_weights float32 [M, k])."""
        logits = F.linear(x.float(), self.weight)  # [M, E] float32
        return route(logits, self.e_score_correction_bias, self.cfg)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor],
               recurse: bool = True) -> TopkRouter:
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            # A cast (model.to(bfloat16)) moves the tensor but keeps float32.
            return out if out.dtype == t.dtype else t.to(out.device)

        super()._apply(keep_dtype, recurse)
        return self


class RoutedExperts(nn.Module):
    """The E routed experts' stacked weights (`ExpertWeights` layout), filled from the
    per-expert checkpoint tensors `{prefix}.{e}.{gate,up,down}_proj.weight`: gate_proj is
    shard 2e and up_proj shard 2e + 1 of `w13`, down_proj shard e of `w2`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.w13, self.w2)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        return experts_forward(x, topk_ids, topk_weights, self.weights())

    # The loader's interface for parameters filled shard by shard.
    def num_shards(self, leaf: str) -> int:
        return self.w13.shape[0] * (2 if leaf == "w13" else 1)

    def shard_view(self, leaf: str, shard: int) -> torch.Tensor:
        """The slice of parameter `leaf` that checkpoint tensor `shard_name(leaf, shard)`
        fills."""
        if leaf == "w13":
            expert, part = divmod(shard, 2)
            size = self.intermediate_size
            return self.w13.data[expert].narrow(0, part * size, size)
        return self.w2.data[shard]

    def shard_name(self, leaf: str, shard: int) -> str:
        if leaf == "w13":
            expert, part = divmod(shard, 2)
            return f"{self.prefix}.{expert}.{('gate', 'up')[part]}_proj.weight"
        return f"{self.prefix}.{shard}.down_proj.weight"


def expert_target(name: str) -> tuple[str, int] | None:
    """(parameter name, shard) of a routed expert's checkpoint tensor, else None: `.weight`
    goes to RoutedExperts' w13/w2, `.weight_packed` (and the other INT4 kinds) to
    Int4RoutedExperts' w13_packed/w2_packed (...)."""
    match = EXPERT_TENSOR.match(name)
    if match is None:
        return None
    expert, proj, kind = int(match["expert"]), match["proj"], match["kind"]
    if proj == "down":
        return f"{match['prefix']}.w2{kind}", expert
    return f"{match['prefix']}.w13{kind}", 2 * expert + (proj == "up")


def build_routed_experts(cfg: MoeConfig, hidden_size: int, prefix: str,
                         make_linear: LinearFactory) -> RoutedExperts | Int4RoutedExperts:
    """The routed experts `{prefix}.{e}`: INT4 when the checkpoint's quantization_config (the
    factory's, for a quantized checkpoint) quantizes their projections, dense when it leaves
    them all out; ValueError naming one of each when it quantizes some and not others."""
    size = (cfg.num_routed_experts, hidden_size, cfg.moe_intermediate_size, prefix)
    if not isinstance(make_linear, Int4LinearFactory):
        return RoutedExperts(*size)
    names = [f"{prefix}.{e}.{p}_proj" for e in range(cfg.num_routed_experts)
             for p in ("gate", "up", "down")]
    flags = {name: make_linear.is_quantized(name) for name in names}
    if not any(flags.values()):
        return RoutedExperts(*size)
    if not all(flags.values()):
        dense = next(n for n, q in flags.items() if not q)
        quantized = next(n for n, q in flags.items() if q)
        raise ValueError(f"the quantization_config quantizes {quantized} but not {dense}; "
                         f"the routed experts of a layer must be all INT4 or all dense")
    qcfg = make_linear.quant_config
    return Int4RoutedExperts(*size, qcfg.group_size, qcfg.symmetric)


class MoE(nn.Module):
    """Router, routed experts and the shared experts (one SwiGLU of width
    moe_intermediate_size * n_shared_experts, or none): x [M, H] -> [M, H]."""

    def __init__(self, cfg: MoeConfig, hidden_size: int, prefix: str,
                 make_linear: LinearFactory) -> None:
        super().__init__()
        self.gate = TopkRouter(cfg, hidden_size)
        self.experts = build_routed_experts(cfg, hidden_size, f"{prefix}.experts",
                                            make_linear)
        shared = cfg.moe_intermediate_size * cfg.num_shared_experts
        self.shared_experts = (GatedMLP(hidden_size, shared, f"{prefix}.shared_experts",
                                        make_linear) if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        y = experts_forward(x, topk_ids, topk_weights, self.experts.weights())
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
