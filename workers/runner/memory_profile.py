"""What a CUDA device has left for the KV cache: one profiling forward after the weights load.

`measure_device_memory` runs the model once over `max_num_batched_tokens` tokens (the
largest step the scheduler builds) and computes logits for as many rows as a step samples
at most (`max_num_seqs`, times the verified draft length with a draft head), the way a
step does, over a one-block scratch cache; it records the activation peak (the most the
caching allocator held above the weights meanwhile) and, once the temporaries are released,
the memory still free on the device. `kv_cache.kv_budget` turns the two into the budget.

The scratch cache has one block: every token's K/V goes to a slot of it and every block
table entry names it. The attention output is meaningless, but the kernels, shapes and
temporaries are a real step's, which is all the profile needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from specd.workers.models.registry import CausalLM
from specd.workers.runner.attention import build_attention_metadata
from specd.workers.runner.kv_cache import DeviceMemory

log = logging.getLogger("specd.engine")


def measure_device_memory(model: CausalLM, capture_layers: Sequence[int],
                          allocate_kv: Callable[[int], list[torch.Tensor]],
                          block_size: int, vocab_size: int, num_tokens: int,
                          num_sample_rows: int, device: torch.device) -> DeviceMemory:
    """Profile one forward of `num_tokens` tokens (logits for `num_sample_rows` of them)
    on CUDA `device`; allocate_kv(num_blocks): the runner's cache allocator."""
    if device.type != "cuda":
        raise ValueError(f"device memory is profiled on cuda only, got {device}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # blocks freed earlier (another engine's) are free again
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    profile_forward(model, capture_layers, allocate_kv, block_size, vocab_size, num_tokens,
                    num_sample_rows, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    memory = DeviceMemory(total_bytes=total, free_bytes=free, activation_peak_bytes=peak)
    log.info("device memory profiled", extra={
        "event": "device_memory_profiled", "total_bytes": total, "free_bytes": free,
        "activation_peak_bytes": peak, "num_tokens": num_tokens})
    return memory


@torch.inference_mode()
def profile_forward(model: CausalLM, capture_layers: Sequence[int],
                    allocate_kv: Callable[[int], list[torch.Tensor]], block_size: int,
                    vocab_size: int, num_tokens: int, num_sample_rows: int,
                    device: torch.device) -> None:
    """One prefill-shaped forward over a one-block scratch cache, then logits and their
    softmax (the sampler's largest temporaries) for num_sample_rows rows."""
    scratch = allocate_kv(1)
    num_blocks = -(-num_tokens // block_size)
    # Every table entry is block 0, so token t's slot is t % block_size: the writes
    # collide, which is harmless here.
    meta = build_attention_metadata([num_tokens], [num_tokens], [[0] * num_blocks],
                                    block_size, device)
    # Distinct tokens, so that a mixture of experts routes them as real text would (all
    # alike would send every token to the same experts).
    input_ids = torch.arange(num_tokens, dtype=torch.int64, device=device) % vocab_size
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    hidden, _ = model(input_ids, positions, scratch, meta, tuple(capture_layers))
    rows = hidden[-min(num_sample_rows, num_tokens):]  # [M, hidden]
    logits = model.compute_logits(rows).float()  # [M, vocab]
    torch.softmax(logits, dim=-1)
