"""What one GPU holds of the weights, counted on the model itself: rank 0's model built on
the meta device from its sharded config (`shard_model_config`, the registry's class, the
checkpoint's linear factory) and cast as the loaders cast it, then every parameter and
buffer summed by kind; the EAGLE-3 head the same way (`empty_draft_head`). No tensor is
described here a second time (workers/parallel/sharding.py states what each rank holds), so
the plan holds what the engine builds, for any architecture the registry serves.

The kinds of the plan's table come from the tensors' names, which follow the checkpoint's
(`model.layers.{i}.self_attn.*`, `*.mlp.experts.*`, ...); a tensor no kind names is counted
as `other`. A kind's precision names its parameters' dtypes, `INT4` for a quantized module
(one holding compressed-tensors' `*_packed` tensors); a kind of buffers only (MLA's absorbed
W_UK/W_UV) names theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from specd.workers.models.config import ModelConfig
from specd.workers.models.linear_factory import linear_factory
from specd.workers.models.registry import MODEL_CLASSES, STACKED_PARAMS, CausalLM
from specd.workers.parallel.context import ParallelContext
from specd.workers.parallel.sharding import (
    COLUMN_MODULES,
    ROW_MODULES,
    local_experts,
    replicates_kv_heads,
    shard_model_config,
)
from specd.workers.runner.dtypes import TORCH_DTYPES
from specd.workers.spec.draft_config import DraftConfig
from specd.workers.spec.draft_model import empty_draft_head

DEFAULT_RESERVE_BYTES = 8 * 2**30
# Where a meta-built model's rotary tables go: they are no parameter or buffer (not counted).
ROTARY_DEVICE = torch.device("cpu")
# The table's order of kinds (a kind this list lacks comes after lm_head).
KIND_ORDER = ("norms", "attention", "attention, replicated", "attention, split",
              "absorbed W_UK/W_UV", "MLP", "dense MLP", "router", "routed experts",
              "shared experts", "embedding", "lm_head")
ABSORBED_LEAVES = ("w_uk", "w_uv")
SPLIT_MODULES = COLUMN_MODULES | ROW_MODULES


@dataclass(frozen=True)
class PlanOptions:
    """How the model is to be served. gpu_memory_bytes: one GPU's memory; memory_fraction: the
    fraction of it specd may use; reserve_bytes: what the plan keeps for activations, graphs
    and buffers; block_size: KV tokens per block (the engine's --block-size); nnodes: the
    hosts the tensor_parallel_size ranks are spread over, the same number on each (one GPU
    of any of them holds what one of a single host would: the plan is per GPU)."""

    gpu_memory_bytes: int
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    dtype: str = "bfloat16"
    memory_fraction: float = 0.90
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    block_size: int = 16
    max_model_len: int | None = None
    nnodes: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} must be a "
                             f"multiple of nnodes {self.nnodes} (the same ranks on each node)")
        if self.gpu_memory_bytes <= 0:
            raise ValueError(f"gpu_memory_bytes must be > 0, got {self.gpu_memory_bytes}")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {tuple(TORCH_DTYPES)}, got {self.dtype!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {self.reserve_bytes}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("expert_parallel needs tensor_parallel_size > 1 (the ranks that "
                             "hold the experts)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def rank_zero(self) -> ParallelContext:
        """Rank 0's place in the layout (it holds at least what any other rank holds)."""
        return ParallelContext(0, self.tensor_parallel_size, self.expert_parallel)


@dataclass(frozen=True)
class WeightPart:
    """One kind of weight on one GPU: its bytes and how it is placed across the ranks."""

    kind: str
    bytes: int
    placement: str


@dataclass(frozen=True)
class _Tensor:
    """One parameter or buffer of a built model: its name, bytes and precision (INT4 or its
    dtype's name), and whether it is a parameter."""

    name: str
    nbytes: int
    precision: str
    is_param: bool


def rank_zero_model(cfg: ModelConfig, options: PlanOptions) -> CausalLM:
    """Rank 0's model on the meta device in the serving dtype, built as the loaders build it;
    ValueError naming the field when the layout cannot split the model (`shard_model_config`,
    the INT4 layers' group checks)."""
    par = options.rank_zero
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](shard_model_config(cfg, par),
                                                linear_factory(cfg), ROTARY_DEVICE, par)
    model.to(options.torch_dtype)  # floating-point tensors take it; packed integers keep theirs
    return model


def target_parts(cfg: ModelConfig, model: CausalLM, options: PlanOptions
                 ) -> tuple[tuple[WeightPart, ...], tuple[str, ...]]:
    """(the weights of rank 0's `model` of `cfg` by kind, assumptions: the kinds the engine
    keeps in a floating dtype other than the serving one, the MoE router's float32)."""
    tensors = list(_tensors(model))
    kinds = {t.name: _kind(t.name, cfg) for t in tensors}
    stacked = STACKED_PARAMS[type(model)]
    attention = [name for name, kind in kinds.items() if kind == "attention"]
    if any(_is_replicated(name, stacked) for name in attention):
        kinds.update({name: "attention, replicated" if _is_replicated(name, stacked)
                      else "attention, split" for name in attention})
    par = options.rank_zero
    parts = _parts(tensors, kinds, lambda k: _placement(k, cfg, par))
    kept = sorted({(kinds[t.name], t.precision) for t in tensors
                   if t.precision not in ("INT4", options.dtype) and t.is_param
                   and t.precision.startswith("float")})
    return parts, tuple(f"the {k} stays {p} whatever the serving dtype (the engine keeps it so)"
                        for k, p in kept)


def draft_head_part(draft: DraftConfig, has_embedding: bool, options: PlanOptions
                    ) -> tuple[WeightPart, str]:
    """(the EAGLE-3 head's bytes on rank 0's GPU, the assumption about its embedding). The
    head is built on the meta device as the head loader builds it; its embedding counts
    unless it is the target's own storage (one rank, no embedding of its own)."""
    head = empty_draft_head(draft, options.torch_dtype, torch.device("meta"))
    copies_embedding = not has_embedding and options.tensor_parallel_size > 1
    shares_embedding = not has_embedding and not copies_embedding
    nbytes = sum(t.nbytes for t in _tensors(head)
                 if not (shares_embedding and t.name == "embed_tokens.weight"))
    if has_embedding:
        note = "the draft head carries its own embedding"
    elif copies_embedding:
        note = ("the draft head on rank 0 holds a copy of the whole token embedding (the "
                "target's there is a vocabulary range)")
    else:
        note = "the draft head shares the target's embedding"
    part = WeightPart(f"draft head ({options.dtype})", nbytes,
                      "whole, on rank 0 only" if options.tensor_parallel_size > 1 else "whole")
    return part, note


def _tensors(model: nn.Module) -> Iterator[_Tensor]:
    """Every parameter and buffer of `model`, each once (a shared one counts once)."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        is_int4 = any(leaf.endswith("_packed") for leaf in params)
        own = [(leaf, t, True) for leaf, t in params.items()]
        own += [(leaf, t, False) for leaf, t in module.named_buffers(recurse=False)]
        for leaf, tensor, is_param in own:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            precision = "INT4" if is_int4 else str(tensor.dtype).removeprefix("torch.")
            yield _Tensor(f"{module_name}.{leaf}".removeprefix("."),
                          tensor.numel() * tensor.element_size(), precision, is_param)


def _parts(tensors: list[_Tensor], kinds: dict[str, str], placement: Callable[[str], str]
           ) -> tuple[WeightPart, ...]:
    """Bytes per kind in KIND_ORDER, each labelled with its precision (module docstring)."""
    totals: dict[str, int] = {}
    param_precisions: dict[str, set[str]] = {}
    buffer_precisions: dict[str, set[str]] = {}
    for t in tensors:
        kind = kinds[t.name]
        totals[kind] = totals.get(kind, 0) + t.nbytes
        precisions = param_precisions if t.is_param else buffer_precisions
        precisions.setdefault(kind, set()).add(t.precision)
    order = sorted(totals, key=lambda k: KIND_ORDER.index(k) if k in KIND_ORDER
                   else len(KIND_ORDER))
    return tuple(WeightPart(
        f"{kind} ({' + '.join(sorted(param_precisions.get(kind) or buffer_precisions[kind]))})",
        totals[kind], placement(kind)) for kind in order)


def _is_replicated(name: str, stacked: tuple[tuple[str, str, int], ...]) -> bool:
    """Whether the linear holding tensor `name` is whole on every rank: no checkpoint module
    fused into it is one that tensor parallelism splits (sharding's column and row modules)."""
    leaf = name.rpartition(".")[0].rpartition(".")[2]
    parts = {part for fused, part, _ in stacked if fused == leaf} or {leaf}
    return not parts & SPLIT_MODULES


def _kind(name: str, cfg: ModelConfig) -> str:
    """The plan's kind of tensor `name` (module docstring); `attention` is told apart into
    replicated and split by the caller."""
    module, _, leaf = name.rpartition(".")
    within = f"{module}."
    if module.rpartition(".")[2].endswith("norm"):
        return "norms"
    if module in ("model.embed_tokens", "lm_head"):
        return "embedding" if module == "model.embed_tokens" else "lm_head"
    if ".mlp.experts." in within:
        return "routed experts"
    if ".mlp.shared_experts." in within:
        return "shared experts"
    if module.endswith(".mlp.gate"):
        return "router"
    if ".self_attn." in within:
        return "absorbed W_UK/W_UV" if leaf in ABSORBED_LEAVES else "attention"
    if ".mlp." in within:
        return "MLP" if cfg.moe is None else "dense MLP"
    return "other"


def _placement(kind: str, cfg: ModelConfig, par: ParallelContext) -> str:
    """How a kind of weight of the model of `cfg` lies on the ranks of `par`, in words."""
    n = par.world_size
    heads = f"heads split {n} ways" if n > 1 else "whole"
    if kind == "absorbed W_UK/W_UV":
        return f"the rank's heads ({heads})"
    if n == 1:
        return "whole"
    if kind == "attention" and replicates_kv_heads(cfg, par):
        return f"q heads split {n} ways, each KV head on {n // cfg.num_kv_heads} ranks"
    if kind == "attention":
        return f"q and KV heads split {n} ways"
    if kind == "attention, split":
        return heads
    if kind in ("MLP", "dense MLP", "shared experts"):
        return f"width split {n} ways"
    if kind == "routed experts" and par.expert_parallel:
        experts = 0 if cfg.moe is None else cfg.moe.num_routed_experts
        return f"{len(local_experts(experts, par))} whole experts per rank"
    if kind == "routed experts":
        return f"each expert's width split {n} ways"
    if kind in ("embedding", "lm_head"):
        return f"vocabulary split {n} ways ({cfg.vocab_size // n} rows each)"
    return "whole on every rank"
