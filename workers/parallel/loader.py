"""Load one rank's shard of a model: every checkpoint tensor read as the rank's slice only.

The same contract as workers/models/loader.py (built on the meta device, then every tensor copied
into its parameter by its kind: plain, stacked q/k/v or gate/up, a routed expert's slice of
the stacked experts, a module's own `load_weight` for INT4; every parameter loaded exactly
once, ValueError naming what is wrong), with two differences: the model is the rank's
(`shard_model_config`, a `ParallelContext`), and each tensor is read through
`safe_open(...).get_slice` as the slice `tensor_slice` gives, so no rank ever reads a whole
sharded tensor, nor another rank's experts. Each rank logs its progress per file.
"""

from __future__ import annotations

import logging
import resource
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory
from specd.workers.models.loader import HARMLESS_SUFFIXES, LAYER_INDEX, checkpoint_files
from specd.workers.models.moe import expert_target
from specd.workers.models.registry import MODEL_CLASSES, STACKED_PARAMS, CausalLM
from specd.workers.parallel.context import ParallelContext
from specd.workers.parallel.sharding import (
    local_experts,
    local_weight_shape,
    read_slice,
    shard_model_config,
    tensor_slice,
)

log = logging.getLogger("specd.parallel")

Loaded = set[tuple[str, int | None]]


def load_model_shard(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                     make_linear: LinearFactory, par: ParallelContext) -> CausalLM:
    """Rank `par.rank`'s model of `cfg.model_dir` (cfg: the whole model's config), every
    weight loaded, in eval mode without grads."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}")
    with torch.device("meta"):
        model = cls(shard_model_config(cfg, par), make_linear, device, par)
    model.to(dtype)  # floating-point parameters take the dtype; packed integers keep theirs
    model.to_empty(device=device)
    model.requires_grad_(False)
    model.eval()
    params = dict(model.named_parameters())
    loaded: Loaded = set()
    files = list(checkpoint_files(cfg.model_dir))
    t0 = time.monotonic()
    for i, (path, _) in enumerate(files):
        num_bytes = _load_file(model, params, cfg, par, path, loaded)
        log.info("rank %d loaded %s (%d/%d)", par.rank, path.name, i + 1, len(files), extra={
            "event": "rank_load_progress", "rank": par.rank, "file": path.name,
            "files_done": i + 1, "files": len(files), "bytes_read": num_bytes,
            "elapsed_s": round(time.monotonic() - t0, 3),
            # The process's peak resident memory so far (Linux reports KiB).
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    _check_complete(model, params, loaded)
    finish = getattr(model, "process_weights_after_loading", None)
    if finish is not None:
        with torch.no_grad():
            finish()
    return model


def read_full_tensor(cfg: ModelConfig, name: str, device: torch.device,
                     dtype: torch.dtype) -> torch.Tensor:
    """One whole checkpoint tensor (`name` without the weight prefix), e.g. the token
    embedding a draft head on rank 0 shares while the target holds only its vocabulary
    range. ValueError when no file has it."""
    full_name = cfg.weight_prefix + name
    for path, names in checkpoint_files(cfg.model_dir):
        if names is not None and full_name not in names:
            continue
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if full_name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                return f.get_tensor(full_name).to(device=device, dtype=dtype)
    raise ValueError(f"{cfg.model_dir}: checkpoint lacks tensor {full_name!r}")


def _load_file(model: CausalLM, params: dict[str, nn.Parameter], cfg: ModelConfig,
               par: ParallelContext, path: Path, loaded: Loaded) -> int:
    """Load this rank's part of every tensor of one file; returns the bytes read."""
    if not path.is_file():
        raise ValueError(f"{path}: checkpoint file not found")
    num_bytes = 0
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for full_name in sorted(f.keys()):
                if cfg.weight_prefix and not full_name.startswith(cfg.weight_prefix):
                    continue  # a part of the checkpoint specd does not serve
                name = full_name.removeprefix(cfg.weight_prefix)
                part = tensor_slice(name, f.get_slice(full_name).get_shape(), cfg, par)
                target = None if part.skip else _target(model, params, name, par)
                if target is None:
                    continue
                tensor = read_slice(f, full_name, part)
                num_bytes += tensor.numel() * tensor.element_size()
                if name.endswith(".weight_shape"):
                    tensor = local_weight_shape(name, tensor, cfg, par)
                _load_tensor(model, params, target, name, tensor, path)
                if target in loaded:
                    raise ValueError(f"{path}: tensor {name!r} appears more than once")
                loaded.add(target)
    except SafetensorError as e:
        raise ValueError(f"{path}: unreadable safetensors file, truncated or corrupt ({e})") from e
    return num_bytes


def _target(model: CausalLM, params: dict[str, nn.Parameter], name: str,
            par: ParallelContext) -> tuple[str, int | None] | None:
    """(parameter, shard) tensor `name` fills on this rank; None for a tensor not served
    (an MTP layer, a harmless extra); ValueError for one that matches nothing."""
    cfg = model.config
    layer = LAYER_INDEX.match(name)
    if layer is not None and 0 <= int(layer[1]) - cfg.num_layers < cfg.num_mtp_layers:
        return None
    expert = expert_target(name)
    if expert is not None:
        param, shard = expert
        # Under expert parallelism the rank's experts are numbered from its first one.
        first = local_experts(cfg.moe.num_routed_experts if cfg.moe else 0, par).start
        offset = 2 * first if ".w13" in param else first  # w13 (dense) or w13_packed, ...
        return param, shard - offset
    for fused, part, shard in STACKED_PARAMS[type(model)]:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    if name in params:
        return name, None
    if name.endswith(HARMLESS_SUFFIXES):
        return None
    if name.startswith("lm_head.") and cfg.tie_word_embeddings:
        return None
    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {cfg.architecture}")


def _load_tensor(model: CausalLM, params: dict[str, nn.Parameter],
                 target: tuple[str, int | None], name: str, tensor: torch.Tensor,
                 path: Path) -> None:
    param_name, shard = target
    module_name, _, leaf = param_name.rpartition(".")
    module = model.get_submodule(module_name)
    if hasattr(module, "num_shards") and shard is not None:  # stacked routed experts
        load_shard = getattr(module, "load_shard", None)
        if load_shard is not None:  # INT4: the module checks and copies
            load_shard(leaf, shard, tensor)
        else:
            _copy_checked(module.shard_view(leaf, shard), tensor, name, path)
        return
    sizes: tuple[int, ...] | None = None
    if shard is not None:
        sizes = model.get_submodule(module_name.rpartition(".")[0]).shard_sizes
    custom = getattr(module, "load_weight", None)
    if custom is not None:
        custom(leaf, tensor, shard, sizes)
        return
    if param_name not in params:
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter")
    dest = params[param_name].data
    if shard is not None and sizes is not None:
        dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])  # the shard's rows
    _copy_checked(dest, tensor, name, path)


def _copy_checked(dest: torch.Tensor, tensor: torch.Tensor, name: str, path: Path) -> None:
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(f"{path}: the rank's slice of {name!r} has shape "
                         f"{list(tensor.shape)}, expected {list(dest.shape)}")
    dest.copy_(tensor)


def _check_complete(model: CausalLM, params: dict[str, nn.Parameter], loaded: Loaded) -> None:
    """Every parameter, every shard of a fused or stacked one, was loaded on this rank."""
    stacked: dict[str, list[int]] = {}
    for fused, _, shard in STACKED_PARAMS[type(model)]:
        stacked.setdefault(fused, []).append(shard)
    missing: list[str] = []
    for param_name in params:
        module_name, _, leaf = param_name.rpartition(".")
        module = model.get_submodule(module_name)
        fused = module_name.rpartition(".")[2]
        if hasattr(module, "num_shards"):
            shards: list[int | None] = list(range(module.num_shards(leaf)))
        elif fused in stacked:
            shards = list(stacked[fused])
        else:
            shards = [None]
        missing += [f"{param_name} (shard {s})" for s in shards if (param_name, s) not in loaded]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"{model.config.model_dir}: this rank's shard lacks {missing[0]!r}"
                         f"{more}")
