"""Load a model from a Hugging Face directory, tensor by tensor, whole or not at all.

The model is built on the meta device, given uninitialized storage on the target device in
the target dtype (`to_empty`), then every checkpoint tensor is read through `safe_open` (a
memory map: one tensor in memory at a time, never a full state dict) and copied into its
parameter by the loader of that parameter's kind:

* plain: the tensor is the parameter (shape checked);
* stacked: q/k/v or gate/up shards copied into their rows of a fused parameter;
* sharded by its module: a module with `num_shards(leaf)`, `shard_name(leaf, shard)` and
  either `shard_view(leaf, shard)` (the stacked routed experts of workers/models/moe.py: the slice
  of its parameter each checkpoint tensor fills, shape checked here) or
  `load_shard(leaf, shard, tensor)` (the INT4 routed experts of workers/models/moe_int4.py, which
  check and copy the tensor themselves);
* module-defined: a linear module with a `load_weight(name, tensor, shard, shard_sizes)`
  method (the INT4 layers) loads its own parameters.

Tensors outside the served model are skipped: those not under `ModelConfig.weight_prefix`
(Kimi-K2.5's vision part, logged once) and the multi-token-prediction layers after the last
decoder layer. A model with `process_weights_after_loading` (MLA's W_UK/W_UV split) gets
that call once every parameter is loaded.

Every parameter (every shard of a fused one) must be loaded exactly once; a missing tensor, a
wrong shape, an unknown tensor or a missing/truncated file raises ValueError naming it, and
the half-built model is dropped with the exception.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory, dense_linear
from specd.workers.models.moe import expert_target
from specd.workers.models.registry import STACKED_PARAMS, CausalLM, build_meta_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Checkpoint tensors that carry nothing the model needs (recomputed rotary frequencies).
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")

log = logging.getLogger("specd.loader")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, and its shard if the parameter is fused."""

    param_name: str
    shard: int | None


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               make_linear: LinearFactory = dense_linear) -> CausalLM:
    """The model of `cfg.model_dir` with every weight loaded, in eval mode without grads."""
    model = build_meta_model(cfg, device, make_linear)
    model.to(dtype)  # floating-point parameters take the dtype; packed integers keep theirs
    model.to_empty(device=device)
    model.requires_grad_(False)
    model.eval()
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int | None]] = set()
    unserved: list[str] = []
    for path, names in checkpoint_files(cfg.model_dir):
        _load_file(model, params, path, names, loaded, unserved)
    _check_complete(model, params, loaded)
    if unserved:
        log.info("serving the language model only; %d tensors outside %r (e.g. %r) are not "
                 "served", len(unserved), cfg.weight_prefix, unserved[0], extra={
                     "event": "unserved_tensors_skipped", "count": len(unserved),
                     "weight_prefix": cfg.weight_prefix})
    finish = getattr(model, "process_weights_after_loading", None)
    if finish is not None:
        with torch.no_grad():
            finish()
    return model


def checkpoint_files(model_dir: Path) -> Iterator[tuple[Path, list[str] | None]]:
    """(file, tensor names expected in it or None for all) for a single or sharded checkpoint."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({e})") from e
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file in sorted(by_file):
            yield model_dir / file, by_file[file]
        return
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise ValueError(f"{model_dir}: no {SINGLE_FILE} and no {INDEX_FILE}")
    yield single, None


def _load_file(model: CausalLM, params: dict[str, nn.Parameter], path: Path,
               names: list[str] | None, loaded: set[tuple[str, int | None]],
               unserved: list[str]) -> None:
    if not path.is_file():
        raise ValueError(f"{path}: checkpoint file not found")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            present = set(f.keys())
            missing = [n for n in names or [] if n not in present]
            if missing:
                raise ValueError(f"{path}: the index lists {missing[0]!r} but the file lacks it")
            for name in sorted(present):
                if _is_unserved(model.config, name):
                    unserved.append(name)
                    continue
                target = _target(model, params, name)
                if target is not None:
                    _load_tensor(model, params, target, name, f.get_tensor(name), path)
                    _mark_loaded(loaded, target, name, path)
    except SafetensorError as e:
        raise ValueError(f"{path}: unreadable safetensors file, truncated or corrupt ({e})") from e


def _is_unserved(cfg: ModelConfig, name: str) -> bool:
    """A tensor of a part of the checkpoint specd does not serve (see module docstring)."""
    return bool(cfg.weight_prefix) and not name.startswith(cfg.weight_prefix)


def _target(model: CausalLM, params: dict[str, nn.Parameter],
            name: str) -> Target | None:
    """Where checkpoint tensor `name` goes; None for a known-harmless extra; raises otherwise."""
    cfg = model.config
    name = name.removeprefix(cfg.weight_prefix)
    layer = LAYER_INDEX.match(name)
    if layer is not None and 0 <= int(layer[1]) - cfg.num_layers < cfg.num_mtp_layers:
        return None  # a multi-token-prediction layer
    expert = expert_target(name)
    if expert is not None:
        return Target(*expert)
    for fused, part, shard in STACKED_PARAMS[type(model)]:
        if f".{part}." in name:
            return Target(name.replace(f".{part}.", f".{fused}."), shard)
    if name in params:
        return Target(name, None)
    if name.endswith(HARMLESS_SUFFIXES):
        return None
    if name.startswith("lm_head.") and model.config.tie_word_embeddings:
        return None  # some tied checkpoints store the shared matrix twice
    raise _no_parameter(model, name)


def _no_parameter(model: CausalLM, name: str) -> ValueError:
    return ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                      f"{model.config.architecture}")


def _load_tensor(model: CausalLM, params: dict[str, nn.Parameter], target: Target,
                 name: str, tensor: torch.Tensor, path: Path) -> None:
    module_name, _, param_leaf = target.param_name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError as e:  # e.g. an expert tensor of a dense layer
        raise _no_parameter(model, name) from e
    if _is_sharded(module) and target.shard is not None:
        if target.param_name not in params:
            raise _no_parameter(model, name)
        load_shard = getattr(module, "load_shard", None)
        if load_shard is not None:
            load_shard(param_leaf, target.shard, tensor)
        else:
            _copy_checked(module.shard_view(param_leaf, target.shard), tensor, name, path)
        return
    shard_sizes = _shard_sizes(model, module_name) if target.shard is not None else None
    custom = getattr(module, "load_weight", None)
    if custom is not None:
        custom(param_leaf, tensor, target.shard, shard_sizes)
        return
    if target.param_name not in params:
        raise _no_parameter(model, name)
    param = params[target.param_name]
    dest = param.data
    if target.shard is not None and shard_sizes is not None:
        # Output-major fused parameter: shard i owns rows [sum(sizes[:i]), + sizes[i]).
        offset = sum(shard_sizes[: target.shard])
        dest = dest.narrow(0, offset, shard_sizes[target.shard])
    _copy_checked(dest, tensor, name, path)


def _is_sharded(module: nn.Module) -> bool:
    """A module whose parameters the checkpoint fills shard by shard (see module docstring)."""
    return hasattr(module, "num_shards") and hasattr(module, "shard_name")


def _copy_checked(dest: torch.Tensor, tensor: torch.Tensor, name: str, path: Path) -> None:
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(f"{path}: tensor {name!r} has shape {list(tensor.shape)}, "
                         f"expected {list(dest.shape)}")
    dest.copy_(tensor)


def _shard_sizes(model: CausalLM, fused_module_name: str) -> tuple[int, ...]:
    """The fused layer's owner (attention or MLP) declares its output shard sizes."""
    owner = model.get_submodule(fused_module_name.rpartition(".")[0])
    sizes: tuple[int, ...] = owner.shard_sizes
    return sizes


def _mark_loaded(loaded: set[tuple[str, int | None]], target: Target, name: str,
                 path: Path) -> None:
    key = (target.param_name, target.shard)
    if key in loaded:
        raise ValueError(f"{path}: tensor {name!r} appears more than once in the checkpoint")
    loaded.add(key)


def _check_complete(model: CausalLM, params: dict[str, nn.Parameter],
                    loaded: set[tuple[str, int | None]]) -> None:
    """Every parameter, and every shard of every fused one, was loaded."""
    stacked_params = STACKED_PARAMS[type(model)]
    stacked = {fused: [(part, shard) for f, part, shard in stacked_params if f == fused]
               for fused, _, _ in stacked_params}
    missing: list[str] = []
    for param_name in params:
        module_name, _, leaf = param_name.rpartition(".")
        fused = module_name.rpartition(".")[2]
        module = model.get_submodule(module_name)
        if _is_sharded(module):
            missing += [model.config.weight_prefix + module.shard_name(leaf, shard)
                        for shard in range(module.num_shards(leaf))
                        if (param_name, shard) not in loaded]
        elif fused in stacked:
            for part, shard in stacked[fused]:
                if (param_name, shard) not in loaded:
                    missing.append(model.config.weight_prefix
                                   + param_name.replace(f".{fused}.", f".{part}."))
        elif (param_name, None) not in loaded:
            missing.append(model.config.weight_prefix + param_name)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"{model.config.model_dir}: checkpoint lacks tensor "
                         f"{missing[0]!r}{more}")
