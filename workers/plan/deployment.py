"""Deployment planning (`specctl plan`): what one GPU holds under N-way tensor (or expert)
parallelism, how many KV tokens fit beside it, and whether the engine would start at all.

The weights are counted on the model itself (workers/plan/weights.py): rank 0's model, built
on the meta device from its sharded config with the checkpoint's linear factory, and the
EAGLE-3 head built the same way, every parameter and buffer summed. Rank 0 holds at least
what any other rank holds: the EAGLE-3 head runs whole there, and shares the target's
embedding when its checkpoint has none, which under N > 1 is a copy of the whole embedding
(rank 0's target holds only its vocabulary range: ModelRunner.draft_embedding_weight).

Before it counts, the plan runs the engine's own start-up checks (`check_startup`), so it
refuses what the engine refuses, with the engine's message: config.json's fields
(ModelConfig.from_dir), a tokenizer larger than the embedding (model_fit), the longest
sequence (ModelConfig.served_len), what N ranks must divide (shard_model_config and the INT4
layers' group checks, in the meta build), and from the safetensors headers a module the
quantization_config makes INT4 that the checkpoint stores dense (checkpoint_check) and a
stored tensor whose rank slice would not be whole (sharding.tensor_slice, as the rank loader
asks). A directory without a tokenizer skips the vocabulary check, one without a checkpoint
the header checks; the plan lists what it skipped among its assumptions. No tensor data is
read.

KV cache per token: the sharded config's (`kv_bytes_per_token`: MLA's latent row per layer,
whole on every rank; dense K and V of the rank's K/V heads per layer); plus the head's K/V
(one layer, its K/V heads). The memory left for the cache is gpu_memory * memory_fraction -
weights - reserve (activations, MoE workspace, captured graphs, communication buffers), in
blocks of block_size tokens; the plan's `specd` command line passes the block count
(--num-kv-blocks), so every rank holds the cache the plan counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.model_fit import check_tokenizer_fits
from specd.workers.models.checkpoint import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    open_safetensors,
    read_weight_map,
)
from specd.workers.models.checkpoint_check import (
    StoredTensor,
    check_int4_storage,
    has_checkpoint,
    stored_tensors,
)
from specd.workers.models.config import ModelConfig
from specd.workers.parallel.context import ParallelContext
from specd.workers.parallel.sharding import replicates_kv_heads, tensor_slice
from specd.workers.plan.weights import (
    PlanOptions,
    WeightPart,
    draft_head_part,
    rank_zero_model,
    target_parts,
)
from specd.workers.runner.kv_cache import kv_bytes_per_token
from specd.workers.spec.head_files import BIN_INDEX, find_weights, read_draft_config

__all__ = ["Plan", "PlanOptions", "WeightPart", "check_startup", "make_plan"]


@dataclass(frozen=True)
class Plan:
    """Per GPU (rank 0, which holds at least what any other rank holds)."""

    model_dir: Path
    draft_dir: Path | None
    options: PlanOptions
    parts: tuple[WeightPart, ...]
    kv_bytes_per_token: int  # the target's cache
    draft_kv_bytes_per_token: int  # the EAGLE-3 head's K/V, same blocks
    kv_layout: str
    max_model_len: int
    assumptions: tuple[str, ...] = field(default=())

    @property
    def weight_bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    @property
    def usable_bytes(self) -> int:
        return int(self.options.gpu_memory_bytes * self.options.memory_fraction)

    @property
    def kv_budget_bytes(self) -> int:
        """What is left for the KV cache (negative when weights and reserve do not fit)."""
        return self.usable_bytes - self.weight_bytes - self.options.reserve_bytes

    @property
    def num_kv_blocks(self) -> int:
        block = self.options.block_size * (self.kv_bytes_per_token + self.draft_kv_bytes_per_token)
        return max(0, self.kv_budget_bytes // block)

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.options.block_size

    @property
    def fits(self) -> bool:
        """The weights and reserve fit, and the cache holds one longest sequence."""
        return self.kv_tokens >= self.max_model_len

    @property
    def verdict(self) -> str:
        if self.kv_budget_bytes <= 0:
            return (f"does not fit: weights and reserve exceed the usable memory by "
                    f"{-self.kv_budget_bytes} bytes; add GPUs or lower the reserve")
        if not self.fits:
            return (f"does not fit: the KV cache holds {self.kv_tokens} tokens, fewer than one "
                    f"sequence of max_model_len {self.max_model_len}; lower --max-model-len "
                    f"or add GPUs")
        return (f"fits: {self.kv_tokens} KV tokens, {self.kv_tokens // self.max_model_len} "
                f"sequences of max_model_len {self.max_model_len}")

    def to_dict(self) -> dict[str, Any]:
        o = self.options
        return {
            "model": str(self.model_dir), "draft_model": self.draft_dir and str(self.draft_dir),
            "tensor_parallel_size": o.tensor_parallel_size, "nnodes": o.nnodes,
            "expert_parallel": o.expert_parallel,
            "dtype": o.dtype, "gpu_memory_bytes": o.gpu_memory_bytes,
            "memory_fraction": o.memory_fraction, "usable_bytes": self.usable_bytes,
            "weights": {p.kind: {"bytes": p.bytes, "placement": p.placement}
                        for p in self.parts},
            "weight_bytes": self.weight_bytes, "reserve_bytes": o.reserve_bytes,
            "kv_budget_bytes": self.kv_budget_bytes, "kv_layout": self.kv_layout,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "draft_kv_bytes_per_token": self.draft_kv_bytes_per_token,
            "block_size": o.block_size, "num_kv_blocks": self.num_kv_blocks,
            "kv_tokens": self.kv_tokens, "max_model_len": self.max_model_len,
            "fits": self.fits, "verdict": self.verdict, "assumptions": list(self.assumptions),
        }


def check_startup(cfg: ModelConfig, options: PlanOptions,
                  stored: Mapping[str, StoredTensor] | None) -> tuple[str, ...]:
    """The engine's start-up checks of `cfg` before it builds a rank's model, the same
    functions in the engine's order (module docstring), given the checkpoint's tensors
    `stored` (None: no checkpoint); ValueError naming the field or the tensor. Returns the
    assumptions for the checks a directory without a tokenizer or a checkpoint skips."""
    notes = []
    if not check_tokenizer_fits(cfg.model_dir, cfg.vocab_size):
        notes.append(f"no tokenizer in {cfg.model_dir}: its vocabulary is not checked "
                     "against the embedding")
    cfg.served_len(options.max_model_len)
    if stored is None:
        notes.append(f"no checkpoint in {cfg.model_dir}: which tensors it stores INT4 is "
                     "taken from the quantization_config")
    else:
        check_int4_storage(cfg, stored)
    return tuple(notes)


def check_rank_slices(cfg: ModelConfig, par: ParallelContext,
                      stored: Mapping[str, StoredTensor]) -> None:
    """ValueError naming the tensor and dimension when a rank's slice of a stored tensor
    would not be whole (`tensor_slice`, which the rank loader asks for every served tensor
    it reads: an asymmetric INT4 layer's zero-point words, for example)."""
    for full_name, tensor in stored.items():
        if cfg.weight_prefix and not full_name.startswith(cfg.weight_prefix):
            continue  # a part of the checkpoint specd does not serve
        tensor_slice(full_name.removeprefix(cfg.weight_prefix), list(tensor.shape), cfg, par)


def make_plan(model_dir: Path, draft_dir: Path | None, options: PlanOptions) -> Plan:
    """The plan for serving `model_dir` (with the head in `draft_dir`, if any); ValueError
    (OSError for an unreadable file) naming what the engine would refuse at start-up."""
    cfg = ModelConfig.from_dir(model_dir)
    stored = stored_tensors(model_dir) if has_checkpoint(model_dir) else None
    skipped = check_startup(cfg, options, stored)
    model = rank_zero_model(cfg, options)  # raises what N ranks cannot split
    if stored is not None:
        check_rank_slices(cfg, options.rank_zero, stored)
    parts, assumptions = target_parts(cfg, model, options)
    draft_kv = 0
    if draft_dir is not None:
        draft = read_draft_config(draft_dir)
        part, note = draft_head_part(draft, head_has_embedding(draft_dir), options)
        # The head's K/V (or MLA latent) per token: the engine's extra_kv_elements_per_token.
        draft_kv = draft.kv_elements_per_token * options.torch_dtype.itemsize
        parts, assumptions = (*parts, part), (*assumptions, note)
    return Plan(model_dir=model_dir, draft_dir=draft_dir, options=options, parts=parts,
                kv_bytes_per_token=kv_bytes_per_token(model.config, options.torch_dtype),
                draft_kv_bytes_per_token=draft_kv,
                kv_layout=kv_layout(cfg, model.config, options.rank_zero),
                max_model_len=cfg.served_len(options.max_model_len),
                assumptions=(*assumptions, *skipped))


def kv_layout(cfg: ModelConfig, local: ModelConfig, par: ParallelContext) -> str:
    """How rank 0's KV cache (of its config `local`; the model's `cfg`) lies on the ranks of
    `par`, in words."""
    n = par.world_size
    if cfg.mla is not None:
        return (f"MLA latent [{cfg.mla.kv_lora_rank} + {cfg.mla.qk_rope_head_dim}] per layer, "
                + ("whole on every rank" if n > 1 else "whole"))
    text = (f"K and V of {local.num_kv_heads} of {cfg.num_kv_heads} KV heads per layer on "
            "each rank")
    if replicates_kv_heads(cfg, par):
        text += f", each on {n // cfg.num_kv_heads} ranks"
    return text


def head_has_embedding(draft_dir: Path) -> bool:
    """Whether the head's checkpoint carries its own token embedding, from the tensor names
    alone; without a weights file the head is taken to share the target's, as published
    heads do."""
    names = {name.removeprefix("model.") for name in _head_tensor_names(draft_dir)}
    return "embed_tokens.weight" in names


def _head_tensor_names(draft_dir: Path) -> set[str]:
    """The head's tensor names as stored, read without their data (workers/spec/head_files.py
    lists the layouts): a safetensors header, an index's weight_map, or a pickled state dict
    memory-mapped; empty when there are no weights."""
    try:
        path = find_weights(draft_dir)
    except FileNotFoundError:
        return set()
    if path.name in (SAFETENSORS_INDEX, BIN_INDEX):
        return {name for names in read_weight_map(path).values() for name in names}
    if path.name == SAFETENSORS_FILE:
        with open_safetensors(path) as f:
            return set(f.names())
    import torch  # a pickled head only: mapped, not read

    return set(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
