"""The activation dtype: its names and how "auto" resolves for a device and a checkpoint."""

from __future__ import annotations

import torch

from specd.workers.config import EngineConfig
from specd.workers.models.config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(config: EngineConfig, model_config: ModelConfig) -> str:
    """The dtype to run in: the configured one, or for "auto" the checkpoint's half
    precision where the device computes it natively (CUDA; bfloat16 on a CPU with
    AVX512-BF16 or AMX, where it halves the bytes per step and doubles the matmul rate),
    else float32 (half precision on other CPUs is emulated and slow)."""
    if config.dtype != "auto":
        return config.dtype
    stored = model_config.torch_dtype
    if config.device.startswith("cuda"):
        return stored if stored in ("bfloat16", "float16") else "bfloat16"
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if stored == "bfloat16" and native_bf16 else "float32"
