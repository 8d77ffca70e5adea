"""Load a model from a Hugging Face directory, tensor by tensor, whole or not at all: in one
process, or one rank's shard under tensor (or expert) parallelism. One process is a world of
size 1 (`SINGLE_RANK`), whose slice of every tensor is the whole tensor: the same code loads
both.

The model (the rank's: `shard_model_config`) is built on the meta device, given uninitialized
storage on the target device in the target dtype (`to_empty`), then every checkpoint tensor
is read as the rank's slice of it (`sharding.tensor_slice`) through
`checkpoint.open_safetensors` (a memory map and `get_slice`: one slice in memory at a time, and
a rank never reads a whole sharded tensor nor another rank's experts) and copied into its
parameter by the loader of that parameter's kind:

* plain: the tensor is the parameter (shape checked);
* stacked: q/k/v or gate/up shards copied into their rows of a fused parameter;
* sharded by its module: a module with `num_shards(leaf)`, `shard_name(leaf, shard)` and
  either `shard_view(leaf, shard)` (the stacked routed experts of workers/models/moe.py: the
  slice of its parameter each checkpoint tensor fills, shape checked here) or
  `load_shard(leaf, shard, tensor)` (the INT4 routed experts of workers/models/moe_int4.py,
  which check and copy the tensor themselves); under expert parallelism the rank's experts
  are numbered from its first one (`sharding.expert_shard_offset`);
* module-defined: a linear module with a `load_weight(name, tensor, shard, shard_sizes)`
  method (the INT4 layers) loads its own parameters.

Tensors outside the served model are skipped: those not under `ModelConfig.weight_prefix`
(Kimi-K2.5's vision part, logged once) and the multi-token-prediction layers after the last
decoder layer. A model with `process_weights_after_loading` (MLA's W_UK/W_UV split) gets
that call once every parameter is loaded. Each file loaded is one `rank_load_progress`
record (bytes read, the process's peak resident memory).

Every parameter (every shard of a fused one) must be loaded exactly once; a missing tensor, a
wrong shape, an unknown or duplicated tensor or a missing/truncated file raises ValueError
naming it, and the half-built model is dropped with the exception.
"""

from __future__ import annotations

import logging
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specd.workers.models.checkpoint import (
    SAFETENSORS_INDEX,
    checkpoint_files,
    open_safetensors,
    require_listed,
)
from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory, dense_linear
from specd.workers.models.moe import expert_target
from specd.workers.models.registry import STACKED_PARAMS, CausalLM, build_meta_model
from specd.workers.parallel.context import SINGLE_RANK, ParallelContext
from specd.workers.parallel.sharding import (
    expert_shard_offset,
    local_weight_shape,
    shard_model_config,
    tensor_slice,
)

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
               make_linear: LinearFactory = dense_linear,
               par: ParallelContext = SINGLE_RANK) -> CausalLM:
    """Rank `par.rank`'s model of `cfg.model_dir` (cfg: the whole model's config; at size 1
    the whole model) with every weight loaded, in eval mode without grads."""
    model = build_meta_model(shard_model_config(cfg, par), device, make_linear, par)
    model.to(dtype)  # floating-point parameters take the dtype; packed integers keep theirs
    model.to_empty(device=device)
    model.requires_grad_(False)
    model.eval()
    loading = _Loading(model, cfg, par)
    files = checkpoint_files(cfg.model_dir)
    t0 = time.monotonic()
    for i, (path, names) in enumerate(files):
        num_bytes = loading.load_file(path, names)
        log.info("rank %d loaded %s (%d/%d)", par.rank, path.name, i + 1, len(files), extra={
            "event": "rank_load_progress", "rank": par.rank, "file": path.name,
            "files_done": i + 1, "files": len(files), "bytes_read": num_bytes,
            "elapsed_s": round(time.monotonic() - t0, 3),
            # The process's peak resident memory so far (Linux reports KiB).
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    loading.check_complete()
    if loading.unserved:
        log.info("serving the language model only; %d tensors outside %r (e.g. %r) are not "
                 "served", len(loading.unserved), cfg.weight_prefix, loading.unserved[0],
                 extra={"event": "unserved_tensors_skipped", "count": len(loading.unserved),
                        "weight_prefix": cfg.weight_prefix})
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
        with open_safetensors(path) as f:
            if full_name in f.names():
                return f.read(full_name).to(device=device, dtype=dtype)
    raise ValueError(f"{cfg.model_dir}: checkpoint lacks tensor {full_name!r}")


class _Loading:
    """One load in progress: which (parameter, shard) pairs are loaded, which tensors were
    not served. `cfg` is the whole model's config (slices are computed from it),
    `model.config` the rank's."""

    def __init__(self, model: CausalLM, cfg: ModelConfig, par: ParallelContext) -> None:
        self.model = model
        self.cfg = cfg
        self.par = par
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        self.loaded: set[tuple[str, int | None]] = set()
        self.unserved: list[str] = []

    def load_file(self, path: Path, names: list[str] | None) -> int:
        """Load this rank's slice of every tensor of `path` (`names`: those its index
        places there); returns the bytes read."""
        prefix = self.cfg.weight_prefix
        num_bytes = 0
        with open_safetensors(path) as f:
            present = f.names()
            if names is not None:
                require_listed(path, names, present, SAFETENSORS_INDEX)
            for full_name in present:
                if prefix and not full_name.startswith(prefix):
                    self.unserved.append(full_name)  # a part specd does not serve
                    continue
                name = full_name.removeprefix(prefix)
                target = self._target(name, full_name, path)
                if target is None:
                    continue
                part = tensor_slice(name, f.shape(full_name), self.cfg, self.par)
                if part.skip:  # another rank's expert: not read
                    continue
                tensor = f.read(full_name, part)
                num_bytes += tensor.numel() * tensor.element_size()
                if name.endswith(".weight_shape"):
                    tensor = local_weight_shape(name, tensor, self.cfg, self.par)
                self._load_tensor(target, full_name, tensor, path)
                self._mark_loaded(target, full_name, path)
        return num_bytes

    def _target(self, name: str, full_name: str, path: Path) -> Target | None:
        """Where tensor `name` (weight prefix removed) goes on this rank; None for a tensor
        not served (an MTP layer, a known-harmless extra); ValueError for one that matches
        nothing."""
        cfg = self.model.config
        layer = LAYER_INDEX.match(name)
        if layer is not None and 0 <= int(layer[1]) - cfg.num_layers < cfg.num_mtp_layers:
            return None  # a multi-token-prediction layer
        expert = expert_target(name)
        if expert is not None:
            param, shard = expert
            return Target(param, shard - expert_shard_offset(param, self.cfg, self.par))
        for fused, part, shard in STACKED_PARAMS[type(self.model)]:
            if f".{part}." in name:
                return Target(name.replace(f".{part}.", f".{fused}."), shard)
        if name in self.params:
            return Target(name, None)
        if name.endswith(HARMLESS_SUFFIXES):
            return None
        if name.startswith("lm_head.") and cfg.tie_word_embeddings:
            return None  # some tied checkpoints store the shared matrix twice
        raise self._no_parameter(full_name, path)

    def _no_parameter(self, full_name: str, path: Path) -> ValueError:
        return ValueError(f"{path}: checkpoint tensor {full_name!r} matches no parameter of "
                          f"{self.cfg.architecture}")

    def _load_tensor(self, target: Target, full_name: str, tensor: torch.Tensor,
                     path: Path) -> None:
        module_name, _, param_leaf = target.param_name.rpartition(".")
        try:
            module = self.model.get_submodule(module_name)
        except AttributeError as e:  # e.g. an expert tensor of a dense layer
            raise self._no_parameter(full_name, path) from e
        if _is_sharded(module) and target.shard is not None:
            if target.param_name not in self.params:
                raise self._no_parameter(full_name, path)
            load_shard = getattr(module, "load_shard", None)
            if load_shard is not None:
                load_shard(param_leaf, target.shard, tensor)
            else:
                self._copy_checked(module.shard_view(param_leaf, target.shard), tensor,
                                   full_name, path)
            return
        shard_sizes = (_shard_sizes(self.model, module_name) if target.shard is not None
                       else None)
        custom = getattr(module, "load_weight", None)
        if custom is not None:
            custom(param_leaf, tensor, target.shard, shard_sizes)
            return
        if target.param_name not in self.params:
            raise self._no_parameter(full_name, path)
        dest = self.params[target.param_name].data
        if target.shard is not None and shard_sizes is not None:
            # Output-major fused parameter: shard i owns rows [sum(sizes[:i]), + sizes[i]).
            offset = sum(shard_sizes[: target.shard])
            dest = dest.narrow(0, offset, shard_sizes[target.shard])
        self._copy_checked(dest, tensor, full_name, path)

    def _copy_checked(self, dest: torch.Tensor, tensor: torch.Tensor, full_name: str,
                      path: Path) -> None:
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"{path}: tensor {full_name!r} has shape {list(tensor.shape)}, "
                             f"expected {list(dest.shape)}{self._for_rank()}")
        dest.copy_(tensor)

    def _for_rank(self) -> str:
        """How an error names the rank: nothing at size 1."""
        par = self.par
        return f" (rank {par.rank} of {par.world_size})" if par.is_parallel else ""

    def _mark_loaded(self, target: Target, full_name: str, path: Path) -> None:
        key = (target.param_name, target.shard)
        if key in self.loaded:
            raise ValueError(f"{path}: tensor {full_name!r} appears more than once in the "
                             "checkpoint")
        self.loaded.add(key)

    def check_complete(self) -> None:
        """Every parameter, and every shard of every fused one, was loaded: ValueError naming
        the first checkpoint tensor missing (and the parameter shard it fills)."""
        missing = [(name, param, shard) for param in self.params
                   for name, shard in self._checkpoint_names(param)
                   if (param, shard) not in self.loaded]
        if missing:
            name, param, shard = missing[0]
            fills = "" if shard is None else f" for {param} (shard {shard})"
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ValueError(f"{self.cfg.model_dir}: checkpoint lacks tensor {name!r}{fills}"
                             f"{more}{self._for_rank()}")

    def _checkpoint_names(self, param_name: str) -> list[tuple[str, int | None]]:
        """(checkpoint name, shard) of every tensor that fills parameter `param_name`."""
        prefix = self.cfg.weight_prefix
        module_name, _, leaf = param_name.rpartition(".")
        module = self.model.get_submodule(module_name)
        if _is_sharded(module):
            offset = expert_shard_offset(param_name, self.cfg, self.par)
            return [(prefix + module.shard_name(leaf, shard + offset), shard)
                    for shard in range(module.num_shards(leaf))]
        fused = module_name.rpartition(".")[2]
        parts = [(part, shard) for f, part, shard in STACKED_PARAMS[type(self.model)]
                 if f == fused]
        if parts:
            return [(prefix + param_name.replace(f".{fused}.", f".{part}."), shard)
                    for part, shard in parts]
        return [(prefix + param_name, None)]


def _is_sharded(module: nn.Module) -> bool:
    """A module whose parameters the checkpoint fills shard by shard (see module docstring)."""
    return hasattr(module, "num_shards") and hasattr(module, "shard_name")


def _shard_sizes(model: CausalLM, fused_module_name: str) -> tuple[int, ...]:
    """The fused layer's owner (attention or MLP) declares its output shard sizes."""
    owner = model.get_submodule(fused_module_name.rpartition(".")[0])
    sizes: tuple[int, ...] = owner.shard_sizes
    return sizes
