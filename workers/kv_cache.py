"""The paged KV cache: how many blocks fit a memory budget, and the per-layer tensors.

Layout (shared/contracts): one tensor per layer, `[2, num_blocks, block_size, num_kv_heads,
head_dim]`, K at [0] and V at [1]. Block ids index dim 1 in every layer alike, so one block
table serves all layers.
"""

from __future__ import annotations

import torch

from specd.workers.config import EngineConfig
from specd.workers.model_config import ModelConfig


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element


def num_kv_blocks(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype,
                  reserved_bytes: int = 0, extra_elements_per_token: int = 0) -> int:
    """`config.num_kv_blocks` if set, else as many blocks as `kv_cache_memory_bytes` holds
    after `reserved_bytes` (captured graphs and their padding block, graphs.py).
    extra_elements_per_token: another cache indexed by the same blocks (the EAGLE-3 head's
    K/V), in `dtype`, paid from the same budget."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    element = torch.empty((), dtype=dtype).element_size()
    block_bytes = (kv_block_bytes(cfg, config.block_size, dtype)
                   + extra_elements_per_token * config.block_size * element)
    count = (config.kv_cache_memory_bytes - reserved_bytes) // block_bytes
    if count < 1:
        raise ValueError(f"kv_cache_memory_bytes ({config.kv_cache_memory_bytes}) holds no KV "
                         f"block; one block of {config.block_size} tokens needs {block_bytes}"
                         + (f" after {reserved_bytes} bytes for captured graphs"
                            if reserved_bytes else ""))
    return count


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """One zeroed `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer.

    Zeroed rather than empty so that padded key slots read by the batched CPU attention (and
    masked out there) never hold NaN bit patterns, which a masked softmax would still spread.
    """
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
