"""The paged KV cache: how many blocks fit a memory budget, and the per-layer tensors.

Layout: one tensor per layer of `ModelConfig.kv_layer_shape(num_blocks, block_size)`: for
the dense decoders `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K at [0], V at
[1]), for MLA `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` (one latent row per
token, shared by all heads). Block ids index the block axis of every layer alike, so one
block table serves all layers. A token takes `ModelConfig.kv_elements_per_token` elements
over all layers; a block, that times `block_size`.

The budget the blocks are bought from (`kv_budget`): `kv_cache_memory_bytes` when given;
on the CPU otherwise a fixed 256 MiB; on CUDA otherwise `gpu_memory_utilization` of the
device memory still free once the weights are loaded, less the activation peak of a forward
at `max_num_batched_tokens` (measured by memory_profile.py). Captured graphs' memory (the
target's, and the draft head's loops) comes out of whichever budget, and on the device rule
the draft head's weights too, loaded after the measurement (`num_kv_blocks`' reserved_bytes;
spec/draft_budget.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.workers.config import CPU_KV_CACHE_BYTES, EngineConfig
from specd.workers.models.config import ModelConfig


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory at start-up, in bytes (memory_profile.measure_device_memory).

    total_bytes: the device's capacity. free_bytes: free once the weights are loaded and
    the profiling forward has run and released its temporaries (what this process keeps,
    the CUDA context and library workspaces included, and what other processes hold are
    not free). activation_peak_bytes: the most a forward at max_num_batched_tokens (with its
    logits) allocated above the weights.
    """

    total_bytes: int
    free_bytes: int
    activation_peak_bytes: int


@dataclass(frozen=True)
class KvBudget:
    """The bytes the KV cache (and the draft head's K/V, and captured graphs) may take,
    where that figure comes from (for status) and, on CUDA, the memory it was computed from."""

    num_bytes: int
    source: str
    memory: DeviceMemory | None = None


def device_kv_budget(memory: DeviceMemory, utilization: float) -> int:
    """utilization x (free_bytes - activation_peak_bytes), floored: a fraction of what the
    device has left once weights and the activation peak are paid, so that several engines
    on one device (tests, benchmarks) each get a share instead of the second failing.
    Raises a ValueError when nothing is left."""
    usable = memory.free_bytes - memory.activation_peak_bytes
    budget = int(utilization * usable)
    if budget <= 0:
        raise ValueError(
            f"no device memory left for the KV cache: {memory.free_bytes} bytes free of "
            f"{memory.total_bytes} after the weights, and the activation peak takes "
            f"{memory.activation_peak_bytes}; free device memory or lower "
            "max_num_batched_tokens")
    return budget


def kv_budget(config: EngineConfig, memory: DeviceMemory | None = None) -> KvBudget:
    """The KV budget (module docstring): `config.kv_cache_memory_bytes` when set, else the
    device rule when `memory` was measured (CUDA), else the CPU's fixed default."""
    if config.kv_cache_memory_bytes is not None:
        return KvBudget(config.kv_cache_memory_bytes, "kv_cache_memory_bytes")
    if memory is None:
        return KvBudget(CPU_KV_CACHE_BYTES, "default for the cpu")
    fraction = config.gpu_memory_utilization
    return KvBudget(device_kv_budget(memory, fraction),
                    f"gpu_memory_utilization {fraction} of {memory.free_bytes} bytes free "
                    f"after the weights, less an activation peak of "
                    f"{memory.activation_peak_bytes}", memory)


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one token's K/V (or latent) takes across all layers, in `dtype`."""
    return cfg.kv_elements_per_token * element_bytes(dtype)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers."""
    return kv_bytes_per_token(cfg, dtype) * block_size


def num_kv_blocks(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype,
                  reserved_bytes: int = 0, extra_elements_per_token: int = 0,
                  budget: KvBudget | None = None) -> int:
    """`config.num_kv_blocks` if set, else as many blocks as the budget holds after
    `reserved_bytes` (captured graphs and their padding block, graphs.py; the draft head's
    weights and draft loops, spec/draft_budget.py). budget: None is
    `kv_budget(config)` (the configured bytes, or the CPU's default).
    extra_elements_per_token: another cache indexed by the same blocks (the EAGLE-3 head's
    K/V), in `dtype`, paid from the same budget."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if budget is None:
        budget = kv_budget(config)
    block_bytes = (kv_block_bytes(cfg, config.block_size, dtype)
                   + extra_elements_per_token * config.block_size * element_bytes(dtype))
    count = (budget.num_bytes - reserved_bytes) // block_bytes
    if count < 1:
        raise ValueError(f"{budget.source} gives a KV budget of {budget.num_bytes} bytes, "
                         f"which holds no KV block; one block of {config.block_size} tokens "
                         f"needs {block_bytes}"
                         + (f" after {reserved_bytes} bytes reserved for captured graphs "
                            "and the draft head"
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
