"""On CUDA the default KV budget follows --gpu-memory-utilization (skipped on the CPU).

The rule (workers/runner/kv_cache.py): budget = gpu_memory_utilization x (memory free after the
weights - the activation peak of a forward at max_num_batched_tokens), and captured graphs
come out of it, with the draft head's weights and draft loops (spec/draft_budget.py). Checked
against the device's own figures (`torch.cuda.mem_get_info`).
"""

from __future__ import annotations

import gc

import pytest
import torch

from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.runner.kv_cache import DeviceMemory, kv_block_bytes

pytestmark = pytest.mark.gpu

MiB = 2**20


def build(fraction: float) -> tuple[EngineCore, DeviceMemory]:
    gc.collect()
    torch.cuda.empty_cache()
    core = EngineCore(EngineConfig(device="cuda", dtype="bfloat16", speculative_algorithm=None,
                                   cuda_graphs=False, gpu_memory_utilization=fraction))
    memory = core.runner.kv_budget.memory
    assert memory is not None  # measured, not given
    return core, memory


def test_the_budget_is_the_fraction_of_free_memory_after_the_peak() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    core, memory = build(0.5)
    assert memory.total_bytes == total
    assert 0 < memory.activation_peak_bytes < memory.free_bytes <= free_before
    budget = core.runner.kv_budget.num_bytes
    assert budget == int(0.5 * (memory.free_bytes - memory.activation_peak_bytes))
    # The cache takes the budget, to one block.
    block = kv_block_bytes(core.model_config, core.config.block_size, torch.bfloat16)
    cache_bytes = sum(layer.nbytes for layer in core.runner.kv_caches)
    assert budget - block < cache_bytes <= budget
    assert core.resolved.kv_budget_bytes == budget
    assert core.resolved.kv_cache_tokens == core.runner.num_kv_blocks * core.config.block_size
    # What the device says is free now: what was free, less the cache (and small change).
    free_after, _ = torch.cuda.mem_get_info()
    assert abs((memory.free_bytes - cache_bytes) - free_after) < 512 * MiB


def test_twice_the_fraction_buys_twice_the_budget() -> None:
    budgets = {}
    for fraction in (0.2, 0.4):
        core, memory = build(fraction)
        budgets[fraction] = core.runner.kv_budget.num_bytes
        del core, memory
    assert budgets[0.4] == pytest.approx(2 * budgets[0.2], rel=0.01)


def test_an_explicit_budget_is_not_profiled() -> None:
    core = EngineCore(EngineConfig(device="cuda", dtype="bfloat16", speculative_algorithm=None,
                                   cuda_graphs=False, kv_cache_memory_bytes=64 * MiB))
    assert core.runner.kv_budget.memory is None
    assert core.resolved.kv_budget_bytes == 64 * MiB


def test_the_head_its_cache_and_every_graph_fit_the_budget() -> None:
    """Speculative, graphs on: what the engine takes after the profile (the target's cache and
    graphs, the head's weights, K/V and captured draft loops) stays within the budget, up to
    the allocator's segment rounding."""
    gc.collect()
    torch.cuda.empty_cache()
    core = EngineCore(EngineConfig(device="cuda", dtype="bfloat16", spec_mode="on",
                                   cuda_graphs=True, gpu_memory_utilization=0.5))
    memory = core.runner.kv_budget.memory
    assert memory is not None and core.spec is not None
    assert "draft loop at" in core.resolved.graphs and "eager" not in core.resolved.graphs
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    taken = memory.free_bytes - free_after
    budget = core.runner.kv_budget.num_bytes
    assert taken <= budget + 128 * MiB, (taken, budget)
    # The trial's measure of the draft loops covers what the capture proper took, roughly.
    assert core.spec.drafter.loop_runner.memory_bytes > 0
