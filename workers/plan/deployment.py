"""Deployment arithmetic from a model's config alone (`specctl plan`): what one GPU holds
under N-way tensor (or expert) parallelism and how many KV tokens fit beside it.

Reads `config.json` (its quantization_config too) and the draft head's `config.json`,
never a weight. The bytes are those of the tensors the engine builds (workers/models/,
workers/models/moe.py, workers/models/quantization.py, workers/spec/draft_model.py), per rank:

* unquantized weights, norms and biases in the serving dtype; the MoE router (weight and
  correction bias) in float32 whatever the dtype (moe.TopkRouter keeps it so);
* an INT4 linear (quantization.Int4Linear) or routed-expert projection (moe_int4.
  Int4RoutedExperts): `weight_packed` int32 [out, in/8], `weight_scale` [out, groups] in the
  serving dtype (in/group_size groups, one channel-wise), `weight_zero_point` int32
  [out/8, groups] when asymmetric, `weight_shape` int64 [2];
* MLA's absorbed W_UK / W_UV: a second copy of kv_b_proj's local heads (buffers);
* tensor parallel, as workers/parallel/sharding.py splits the model: q and dense KV heads,
  MLP widths and each expert's width split N ways (every split dimension divisible by N,
  INT4 splits along whole groups; with fewer KV heads than ranks, N a multiple of them, each
  rank holds the one KV head its q heads share); q_a_proj, kv_a_proj_with_mqa, norms,
  row-parallel biases (zeros off rank 0) and the router whole on every rank; embedding and
  lm_head split by vocabulary rows; with expert parallelism, E / N whole routed experts per
  rank instead;
* the EAGLE-3 head whole on rank 0, the only rank that runs it; it shares the target's
  embedding when its checkpoint has none, which under N > 1 is a copy of the whole
  embedding (rank 0's target holds only its vocabulary range: ModelRunner.draft_embedding_weight).

KV cache per token: MLA's latent row [kv_lora_rank + rope] per layer, whole on every rank;
dense K and V of the rank's KV heads per layer; plus the head's K/V (one layer, its KV heads).
The memory left for the cache is gpu_memory * memory_fraction - weights - reserve (activations,
MoE workspace, captured graphs, communication buffers), in blocks of block_size tokens; the
plan's `specd` command line passes the block count (--num-kv-blocks), so every rank holds
the cache the plan counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.workers.models.checkpoint import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    open_safetensors,
    read_weight_map,
)
from specd.workers.models.config import ModelConfig, read_json_object
from specd.workers.plan.weights import PlanOptions, WeightPart, draft_head_parts, target_parts
from specd.workers.spec.draft_config import DraftConfig
from specd.workers.spec.head_files import BIN_INDEX, find_weights, read_draft_config

__all__ = ["Plan", "PlanOptions", "WeightPart", "make_plan", "read_config", "read_draft"]


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
            "tensor_parallel_size": o.tensor_parallel_size, "expert_parallel": o.expert_parallel,
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


def read_config(model_dir: Path) -> tuple[ModelConfig, Mapping[str, Any] | None]:
    """(the architecture, the raw quantization_config or None) of `model_dir/config.json`.

    ModelConfig is parsed without the quantization config: the plan needs the shapes from it
    and reads which linears are INT4 from the quantization config itself."""
    raw = read_json_object(model_dir / "config.json")
    text = raw.get("text_config")
    quant = raw.get("quantization_config") or (
        text.get("quantization_config") if isinstance(text, dict) else None)
    stripped = {k: v for k, v in raw.items() if k != "quantization_config"}
    if isinstance(text, dict):
        stripped["text_config"] = {k: v for k, v in text.items() if k != "quantization_config"}
    generation_path = model_dir / "generation_config.json"
    generation = read_json_object(generation_path) if generation_path.is_file() else None
    return ModelConfig.from_dict(stripped, model_dir, generation), quant


def read_draft(draft_dir: Path) -> tuple[DraftConfig, bool]:
    """(the head's config in any published format, whether its checkpoint carries its own
    token embedding). The second comes from the tensor names alone (`_head_tensor_names`);
    without a weights file the head is taken to share the target's, as published heads do."""
    config = read_draft_config(draft_dir)
    names = {name.removeprefix("model.") for name in _head_tensor_names(draft_dir)}
    return config, "embed_tokens.weight" in names


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


def make_plan(model_dir: Path, draft_dir: Path | None, options: PlanOptions) -> Plan:
    """The plan for serving `model_dir` (with the head in `draft_dir`, if any); ValueError
    naming the value when the model cannot be split N ways or a config is unreadable."""
    cfg, quant = read_config(model_dir)
    parts, kv_per_token, kv_layout, assumptions = target_parts(cfg, quant, options)
    draft_kv = 0
    if draft_dir is not None:
        draft, has_embedding = read_draft(draft_dir)
        part, draft_kv, note = draft_head_parts(draft, has_embedding, options)
        parts, assumptions = (*parts, part), (*assumptions, note)
    return Plan(model_dir=model_dir, draft_dir=draft_dir, options=options, parts=parts,
                kv_bytes_per_token=kv_per_token, draft_kv_bytes_per_token=draft_kv,
                kv_layout=kv_layout,
                max_model_len=options.max_model_len or cfg.max_model_len,
                assumptions=assumptions)
