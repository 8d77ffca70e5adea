"""What each rank holds: its `ModelConfig` and its slice of every checkpoint tensor.

The layout is vLLM's and SGLang's:

* column-parallel (output rows split, whole heads per rank): q/k/v, gate/up, MLA's q_b_proj
  (or q_proj) and kv_b_proj, the embedding and lm_head (vocabulary ranges); with fewer K/V
  heads than ranks (N a multiple of them) each rank holds the one K/V head its query heads
  share, replicated on N / num_kv_heads ranks, as vLLM does;
* row-parallel (input columns split; the block's output is all-reduced): o_proj, down_proj;
  a row-parallel bias is added once, by rank 0 (the others hold zeros);
* replicated: norms, MLA's q_a_proj and kv_a_proj_with_mqa, the router;
* routed experts: each expert's intermediate dimension split (gate/up column, down row), or
  with expert parallelism whole experts, a contiguous range per rank, the others not read.

INT4 tensors (compressed-tensors `weight_packed` int32 [out, in/8], `weight_scale`
[out, in/group]) are sliced the same way along the same dimension; requiring every sliced
dimension to divide evenly gives each rank whole int32 words and whole quantization groups.
`weight_shape` becomes the rank's own [out, in].

One process is a world of size 1 (`SINGLE_RANK`): every tensor is whole and every expert is
local, so the one loader (workers/models/loader.py) asks `tensor_slice` whatever the size.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from specd.workers.models.checkpoint import WHOLE, TensorSlice
from specd.workers.models.config import ModelConfig
from specd.workers.parallel.context import ParallelContext

COLUMN_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj",
                            "kv_b_proj", "embed_tokens", "lm_head"})
ROW_MODULES = frozenset({"o_proj", "down_proj"})
# A routed expert's checkpoint tensor (dense or INT4): its expert index.
EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def shard_model_config(cfg: ModelConfig, par: ParallelContext) -> ModelConfig:
    """The model as one rank builds it: its attention heads (dense K/V heads too; MLA's
    latent cache is whole on every rank), its part of the MLP width and, without expert
    parallelism, of each expert's width. ValueError naming the field that does not divide.
    The vocabulary keeps its full size (the vocab-parallel layers split it themselves)."""
    if not par.is_parallel:
        return cfg
    heads = par.split(cfg.num_heads, "num_attention_heads")[1]
    if cfg.mla is not None:
        kv_heads = cfg.num_kv_heads  # nominal: MLA's latent cache has no K/V heads
    elif replicates_kv_heads(cfg, par):
        kv_heads = 1
    else:
        kv_heads = par.split(cfg.num_kv_heads, "num_key_value_heads")[1]
    par.split(cfg.vocab_size, "vocab_size")
    moe = cfg.moe
    if moe is not None and par.expert_parallel:
        par.split(moe.num_routed_experts, "n_routed_experts")
        par.split(moe.moe_intermediate_size * moe.num_shared_experts, "the shared experts' width")
    elif moe is not None:
        moe = replace(moe, moe_intermediate_size=par.split(moe.moe_intermediate_size,
                                                           "moe_intermediate_size")[1])
    return replace(cfg, num_heads=heads, num_kv_heads=kv_heads,
                   intermediate_size=par.split(cfg.intermediate_size, "intermediate_size")[1],
                   moe=moe)


def replicates_kv_heads(cfg: ModelConfig, par: ParallelContext) -> bool:
    """Whether a dense model has fewer K/V heads than ranks, each rank then holding one
    (ValueError naming the field unless the ranks are a multiple of the K/V heads)."""
    if cfg.mla is not None or cfg.num_kv_heads >= par.world_size:
        return False
    if par.world_size % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {par.world_size} is neither a divisor nor a "
                         f"multiple of num_key_value_heads ({cfg.num_kv_heads})")
    return True


def local_experts(num_experts: int, par: ParallelContext) -> range:
    """The routed experts rank `par.rank` holds under expert parallelism (all without)."""
    if not par.expert_parallel:
        return range(num_experts)
    start, length = par.split(num_experts, "n_routed_experts")
    return range(start, start + length)


def expert_shard_offset(param_name: str, cfg: ModelConfig, par: ParallelContext) -> int:
    """Checkpoint shard - local shard of the stacked routed-expert parameter `param_name`:
    under expert parallelism a rank's experts are numbered from its first one (`w13`, dense
    or INT4, stacks gate and up: two shards an expert; `w2` one); 0 without it."""
    first = local_experts(cfg.moe.num_routed_experts if cfg.moe else 0, par).start
    return 2 * first if ".w13" in param_name else first


def tensor_slice(name: str, shape: list[int], cfg: ModelConfig,
                 par: ParallelContext) -> TensorSlice:
    """How rank `par.rank` reads checkpoint tensor `name` (weight prefix removed) of `shape`
    (`WHOLE` at size 1)."""
    if not par.is_parallel:
        return WHOLE
    expert = EXPERT_INDEX.search(name)
    if expert is not None and par.expert_parallel:
        moe = cfg.moe
        num_experts = 0 if moe is None else moe.num_routed_experts
        return WHOLE if int(expert[1]) in local_experts(num_experts, par) else TensorSlice(
            skip=True)
    module, _, leaf = name.rpartition(".")
    kind = module.rpartition(".")[2]
    if kind in ("k_proj", "v_proj") and replicates_kv_heads(cfg, par):
        # The K/V head of this rank's query heads (each rank's query heads share one).
        head = par.rank * cfg.num_kv_heads // par.world_size
        if leaf == "weight_shape":
            return WHOLE  # rewritten by `local_weight_shape`
        return TensorSlice(dim=0, start=head * cfg.head_dim, length=cfg.head_dim)
    if kind in COLUMN_MODULES:
        dim = 0
    elif kind in ROW_MODULES:
        if len(shape) == 1:  # the bias of a row-parallel linear
            return WHOLE if par.rank == 0 else TensorSlice(zeros=True)
        dim = 1
    else:
        return WHOLE
    if leaf == "weight_shape":
        return WHOLE  # rewritten by `local_weight_shape`
    start, length = par.split(shape[dim], f"{name} dimension {dim}")
    return TensorSlice(dim=dim, start=start, length=length)


def local_weight_shape(name: str, full: torch.Tensor, cfg: ModelConfig,
                       par: ParallelContext) -> torch.Tensor:
    """An INT4 layer's `weight_shape` [out, in] -> this rank's [out, in] (the column or row
    dimension divided)."""
    shape = full.tolist()
    base = name.removesuffix("weight_shape") + "weight_packed"
    part = tensor_slice(base, [shape[0], shape[1]], cfg, par)
    if part.dim is not None:
        shape[part.dim] = part.length
    return torch.tensor(shape, dtype=full.dtype)
