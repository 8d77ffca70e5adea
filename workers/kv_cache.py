"""The paged KV cache: how many blocks fit a memory budget, and the per-layer tensors.

Layout: one tensor per layer of `ModelConfig.kv_layer_shape(num_blocks, block_size)`: for
the dense decoders `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K at [0], V at
[1]), for MLA `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` (one latent row per
token, shared by all heads). Block ids index the block axis of every layer alike, so one
block table serves all layers. A token takes `ModelConfig.kv_elements_per_token` elements
over all layers; a block, that times `block_size`.
"""

from __future__ import annotations

import torch

from specd.workers.config import EngineConfig
from specd.workers.model_config import ModelConfig


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one token's K/V (or latent) takes across all layers, in `dtype`."""
    return cfg.kv_elements_per_token * element_bytes(dtype)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers."""
    return kv_bytes_per_token(cfg, dtype) * block_size


def num_kv_blocks(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype,
                  reserved_bytes: int = 0, extra_elements_per_token: int = 0) -> int:
    """`config.num_kv_blocks` if set, else as many blocks as `kv_cache_memory_bytes` holds
    after `reserved_bytes` (captured graphs and their padding block, graphs.py).
    extra_elements_per_token: another cache indexed by the same blocks (the EAGLE-3 head's
    K/V), in `dtype`, paid from the same budget."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    block_bytes = (kv_block_bytes(cfg, config.block_size, dtype)
                   + extra_elements_per_token * config.block_size * element_bytes(dtype))
    count = (config.kv_cache_memory_bytes - reserved_bytes) // block_bytes
    if count < 1:
        raise ValueError(f"kv_cache_memory_bytes ({config.kv_cache_memory_bytes}) holds no KV "
                         f"block; one block of {config.block_size} tokens needs {block_bytes}"
                         + (f" after {reserved_bytes} bytes for captured graphs"
                            if reserved_bytes else ""))
    return count


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """One zeroed `cfg.kv_layer_shape(num_blocks, block_size)` tensor per layer.

    Zeroed rather than empty so that padded key slots read by the batched CPU attention (and
    masked out there) never hold NaN bit patterns, which a masked softmax would still spread.
    """
    shape = cfg.kv_layer_shape(num_blocks, block_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
