"""The linear factory a checkpoint asks for: dense, or INT4 where its quantization config says."""

from __future__ import annotations

from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory, dense_linear


def linear_factory(cfg: ModelConfig) -> LinearFactory:
    """Dense linears, or INT4 ones where the checkpoint's quantization_config says so."""
    if cfg.quantization_config is None:
        return dense_linear
    # Imported only for quantized checkpoints: it pulls in the Triton INT4 kernel module.
    from specd.workers.models.quantization import linear_factory_for

    return linear_factory_for(cfg.quantization_config, dense_linear, cfg.weight_prefix)
