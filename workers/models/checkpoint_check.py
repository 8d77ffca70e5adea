"""Refuse, before any weight is read, a checkpoint that stores dense a module its
quantization_config makes INT4.

The model built with the checkpoint's linear factory holds an INT4 layer there, which loads
compressed-tensors' `weight_packed`, `weight_scale`, ... tensors; a checkpoint that stores
the module's dense `weight` instead (an attention projection while `targets` / `ignore`
make it INT4) would fail only in the loader, late and vaguely ("matches no parameter").
lm_head is not such a module: stored dense, the factory builds it dense whatever the config
says (workers/models/quant_stored.py), and this check logs that once (`lm_head_dense`).
`check_int4_storage` names the tensor and the config rule instead. It asks the model which
modules are INT4 (built on the meta device with the factory, whose `targets` / `ignore`
matching is quant_config.is_quantized, not repeated here) and reads the safetensors headers
only: tensor names, dtypes and shapes, no tensor data. The engine runs it at start-up
(workers/engine/setup.py), `specctl plan` before it plans.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from specd.workers.models.checkpoint import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    checkpoint_files,
    open_safetensors,
)
from specd.workers.models.config import ModelConfig
from specd.workers.models.linear_factory import linear_factory
from specd.workers.models.quant_config import int4_rule
from specd.workers.models.quant_stored import OUTPUT_PROJECTION, dense_output_note
from specd.workers.models.quantization import Int4LinearFactory
from specd.workers.models.registry import STACKED_PARAMS, CausalLM, build_meta_model

# The suffix of the tensor an INT4 module loads first (compressed-tensors' pack-quantized).
PACKED = "_packed"

log = logging.getLogger("specd.quantization")


@dataclass(frozen=True)
class StoredTensor:
    """One checkpoint tensor as its safetensors header describes it."""

    path: Path
    dtype: str
    shape: tuple[int, ...]


def has_checkpoint(model_dir: Path) -> bool:
    """Whether `model_dir` holds a safetensors checkpoint (single file or index)."""
    return (model_dir / SAFETENSORS_INDEX).is_file() or (model_dir / SAFETENSORS_FILE).is_file()


def stored_tensors(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint in `model_dir` by name, from the headers alone;
    ValueError naming a file that is missing or not safetensors."""
    stored: dict[str, StoredTensor] = {}
    for path, _ in checkpoint_files(model_dir):
        if not path.is_file():
            raise ValueError(f"{path}: checkpoint file not found")
        with open_safetensors(path) as f:
            for name in f.names():
                stored[name] = StoredTensor(path, f.dtype(name), tuple(f.shape(name)))
    return stored


def int4_modules(model: CausalLM) -> Iterator[str]:
    """The checkpoint's module names (without the weight prefix) that `model` holds as INT4:
    each checkpoint module fused into an INT4 linear (STACKED_PARAMS), and each projection
    of INT4 routed experts (their loader interface `num_shards` / `shard_name`)."""
    stacked = STACKED_PARAMS[type(model)]
    for name, module in model.named_modules():
        packed = [leaf for leaf, _ in module.named_parameters(recurse=False)
                  if leaf.endswith(PACKED)]
        if not packed:
            continue
        shard_name, num_shards = (getattr(module, "shard_name", None),
                                  getattr(module, "num_shards", None))
        if shard_name is not None and num_shards is not None:  # stacked experts
            for leaf in packed:
                for shard in range(num_shards(leaf)):
                    yield shard_name(leaf, shard).rpartition(".")[0]  # without .weight_packed
            continue
        parent, _, leaf = name.rpartition(".")
        parts = [f"{parent}.{part}" for fused, part, _ in stacked if fused == leaf]
        yield from parts or [name]


def check_int4_storage(cfg: ModelConfig,
                       stored: Mapping[str, StoredTensor] | None = None) -> None:
    """ValueError naming the tensor and the quantization_config rule when the checkpoint
    stores dense (`{module}.weight`) a module the config makes INT4 (module docstring).
    stored: the checkpoint's tensors, `stored_tensors(cfg.model_dir)` (None: read here).
    Nothing is checked, or read, without a quantization_config."""
    make_linear = linear_factory(cfg)
    if not isinstance(make_linear, Int4LinearFactory):
        return
    model = build_meta_model(cfg, torch.device("cpu"), make_linear)
    _note_dense_lm_head(cfg, model, make_linear)
    if stored is None:
        stored = stored_tensors(cfg.model_dir)
    for module in int4_modules(model):
        name = cfg.weight_prefix + module
        dense = stored.get(f"{name}.weight")
        if dense is not None:
            raise ValueError(
                f"{dense.path}: tensor {name}.weight is stored dense ({dense.dtype} "
                f"{list(dense.shape)}), but the quantization_config makes {name} INT4 "
                f"({int4_rule(name, make_linear.quant_config)}), so the engine would load "
                f"{name}.weight_packed and its scales: the quantization_config does not "
                "describe this checkpoint")


def _note_dense_lm_head(cfg: ModelConfig, model: CausalLM, make_linear: Int4LinearFactory
                        ) -> None:
    """Log once, when `model`'s lm_head is dense although the config alone would make it
    INT4 (it is not stored packed), which rule would have."""
    if model.lm_head is None or make_linear.is_quantized(OUTPUT_PROJECTION):
        return
    name = cfg.weight_prefix + OUTPUT_PROJECTION
    note = dense_output_note(name, make_linear.quant_config, cfg.weight_prefix)
    if note is not None:
        log.info(note, extra={"event": "lm_head_dense", "linear": name})
