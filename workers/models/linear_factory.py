"""The linear factory a checkpoint asks for: dense, or INT4 where its quantization config says
and its tensors agree (workers/models/quant_stored.py)."""

from __future__ import annotations

from specd.workers.models.checkpoint import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    checkpoint_files,
    open_safetensors,
)
from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory, dense_linear


def linear_factory(cfg: ModelConfig) -> LinearFactory:
    """Dense linears, or INT4 ones where the checkpoint's quantization_config says so and its
    tensors are packed (lm_head: only when stored packed). A directory without weights (a
    config to build on the meta device) is decided by the config alone."""
    if cfg.quantization_config is None:
        return dense_linear
    # Imported only for quantized checkpoints: it pulls in the Triton INT4 kernel module.
    from specd.workers.models.quantization import StoredLinears, linear_factory_for

    names = checkpoint_tensor_names(cfg)
    stored = None if names is None else StoredLinears.from_names(names)
    return linear_factory_for(cfg.quantization_config, dense_linear, cfg.weight_prefix, stored)


def checkpoint_tensor_names(cfg: ModelConfig) -> list[str] | None:
    """Every tensor name of `cfg.model_dir`'s checkpoint: the index's, or a single file's
    header (no tensor data is read); None when the directory holds no safetensors weights."""
    root = cfg.model_dir
    if not (root / SAFETENSORS_INDEX).is_file() and not (root / SAFETENSORS_FILE).is_file():
        return None
    names: list[str] = []
    for path, listed in checkpoint_files(cfg.model_dir):
        if listed is None:
            with open_safetensors(path) as f:
                listed = f.names()
        names += listed
    return names
