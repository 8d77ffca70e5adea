"""The KV budget: which rule applies, its arithmetic, and where status shows it.

On CUDA without `kv_cache_memory_bytes` the budget is `gpu_memory_utilization` x (memory free
after the weights - the profiled activation peak); the figures are passed in here (the
measurement itself runs in tests/integration/test_kv_budget_gpu.py). On the CPU it is a
fixed 256 MiB; an explicit `kv_cache_memory_bytes` overrides both, `num_kv_blocks` all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
import torch
from click.testing import CliRunner

from specd.daemon.ctl import cli as ctl_cli
from specd.daemon.ctl.common import Settings
from specd.ipc.messages import StatusReply
from specd.workers.config import CPU_KV_CACHE_BYTES, FIXTURE_DIR, EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.models.config import ModelConfig
from specd.workers.runner.kv_cache import (
    DeviceMemory,
    KvBudget,
    device_kv_budget,
    kv_block_bytes,
    kv_budget,
    num_kv_blocks,
)
from specd.workers.runner.memory_profile import measure_device_memory, profile_forward
from specd.workers.runner.model_runner import ModelRunner

GiB = 2**30
# An H200-like device: 139 GiB, 16 GiB of weights and context in use, a 3 GiB peak.
H200 = DeviceMemory(total_bytes=139 * GiB, free_bytes=123 * GiB, activation_peak_bytes=3 * GiB)


def test_the_device_budget_is_the_fraction_of_what_is_free_after_the_peak() -> None:
    assert device_kv_budget(H200, 0.9) == int(0.9 * 120 * GiB)
    assert device_kv_budget(H200, 1.0) == 120 * GiB
    # Floored to whole bytes: 0.5 x 899 = 449.5.
    assert device_kv_budget(DeviceMemory(2000, 1000, 101), 0.5) == 449


def test_a_device_with_nothing_left_is_refused() -> None:
    with pytest.raises(ValueError, match="no device memory left for the KV cache"):
        device_kv_budget(DeviceMemory(total_bytes=GiB, free_bytes=GiB // 4,
                                      activation_peak_bytes=GiB // 2), 0.9)


def test_an_explicit_budget_wins_over_the_device_rule() -> None:
    config = EngineConfig(device="cuda", kv_cache_memory_bytes=5 * GiB)
    assert kv_budget(config, H200) == KvBudget(5 * GiB, "kv_cache_memory_bytes")


def test_without_a_measurement_the_budget_is_the_cpu_default() -> None:
    assert kv_budget(EngineConfig()) == KvBudget(256 * 2**20, "default for the cpu")
    assert CPU_KV_CACHE_BYTES == 256 * 2**20


def test_the_device_rule_names_its_figures() -> None:
    budget = kv_budget(EngineConfig(device="cuda", gpu_memory_utilization=0.5), H200)
    assert budget.num_bytes == 60 * GiB and budget.memory == H200
    assert budget.source == (f"gpu_memory_utilization 0.5 of {123 * GiB} bytes free after "
                             f"the weights, less an activation peak of {3 * GiB}")


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01])
def test_gpu_memory_utilization_is_a_fraction(value: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=value)


def test_blocks_come_from_the_device_budget_after_graphs() -> None:
    cfg = ModelConfig.from_dir(FIXTURE_DIR)
    config = EngineConfig(device="cuda", block_size=16)
    budget = kv_budget(config, H200)
    block = kv_block_bytes(cfg, 16, torch.bfloat16)
    graphs = 3 * GiB
    assert num_kv_blocks(config, cfg, torch.bfloat16, graphs, budget=budget) == (
        (budget.num_bytes - graphs) // block)
    fixed = EngineConfig(device="cuda", num_kv_blocks=7)
    assert num_kv_blocks(fixed, cfg, torch.bfloat16, graphs, budget=budget) == 7


def test_a_budget_without_a_block_names_its_source() -> None:
    cfg = ModelConfig.from_dir(FIXTURE_DIR)
    tiny = KvBudget(10, "gpu_memory_utilization 0.9 of ...")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.9 of \.\.\. gives a KV "
                                         r"budget of 10 bytes, which holds no KV block"):
        num_kv_blocks(EngineConfig(), cfg, torch.float32, budget=tiny)


def test_the_cpu_runner_does_not_profile_and_uses_the_default() -> None:
    runner = ModelRunner(EngineConfig(dtype="float32", cuda_graphs=False))
    assert runner.kv_budget == KvBudget(CPU_KV_CACHE_BYTES, "default for the cpu")
    block = kv_block_bytes(runner.model_config, runner.config.block_size, torch.float32)
    assert runner.num_kv_blocks == CPU_KV_CACHE_BYTES // block


def test_the_profiling_forward_runs_the_largest_step_over_one_block() -> None:
    # The device measurement needs CUDA; the forward it profiles is checked here: a step
    # of max_num_batched_tokens tokens whose K/V all land in the one scratch block.
    runner = ModelRunner(EngineConfig(dtype="float32", cuda_graphs=False, num_kv_blocks=4))
    scratch: list[list[torch.Tensor]] = []

    def allocate(num_blocks: int) -> list[torch.Tensor]:
        scratch.append(runner._allocate_kv(num_blocks))
        return scratch[-1]

    profile_forward(runner.model, (), allocate, 16, 300, 100, 8, torch.device("cpu"))
    assert len(scratch) == 1 and scratch[0][0].shape[1] == 1
    assert all(layer.abs().sum() > 0 for layer in scratch[0])  # written by the forward
    with pytest.raises(ValueError, match="profiled on cuda only"):
        measure_device_memory(runner.model, (), allocate, 16, 300, 100, 8,
                              torch.device("cpu"))


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    core = EngineCore(EngineConfig(dtype="float32", speculative_algorithm=None,
                                   cuda_graphs=False, kv_cache_memory_bytes=3 * 2**20))
    figures: dict[str, Any] = msgspec.to_builtins(core.resolved)
    return figures


def test_resolved_reports_the_budget_and_the_tokens_it_holds(resolved: dict[str, Any]
                                                             ) -> None:
    block = resolved["kv_bytes_per_token"] * resolved["block_size"]
    assert resolved["kv_budget_bytes"] == 3 * 2**20
    assert resolved["kv_budget_source"] == "kv_cache_memory_bytes"
    assert resolved["num_kv_blocks"] == 3 * 2**20 // block
    assert resolved["kv_cache_tokens"] == resolved["num_kv_blocks"] * resolved["block_size"]


def test_with_a_block_count_the_budget_is_those_blocks() -> None:
    core = EngineCore(EngineConfig(dtype="float32", speculative_algorithm=None,
                                   num_kv_blocks=9, block_size=16))
    block = kv_block_bytes(core.model_config, 16, torch.float32)
    assert (core.resolved.kv_budget_bytes, core.resolved.kv_budget_source,
            core.resolved.kv_cache_tokens) == (9 * block, "num_kv_blocks", 9 * 16)


def _status_reply(resolved: dict[str, Any]) -> StatusReply:
    return StatusReply(id=1, state="ready", protocol=1, version="test", uptime_s=1.0,
                       model="fixture", num_open_requests=0, num_connections=1,
                       resolved=resolved, engine={"num_running": 0, "num_waiting": 0,
                                                  "num_free_kv_blocks": 3,
                                                  "num_kv_blocks": 3},
                       provenance={}, config={})


def test_specctl_status_shows_the_budget_and_tokens(resolved: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeClient:
        def status(self) -> StatusReply:
            return _status_reply(resolved)

    @contextmanager
    def client(self: Settings) -> Iterator[FakeClient]:
        yield FakeClient()

    monkeypatch.setattr(Settings, "client", client)
    text = CliRunner().invoke(ctl_cli.cli, ["status"])
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    assert (f"kv cache     {resolved['kv_cache_tokens']} tokens in a budget of {3 * 2**20} "
            "bytes (kv_cache_memory_bytes)") in lines
    assert f"resolved     kv_budget_bytes = {3 * 2**20}" in lines
    assert "resolved     kv_budget_source = kv_cache_memory_bytes" in lines
    assert f"resolved     kv_cache_tokens = {resolved['kv_cache_tokens']}" in lines
    as_json = CliRunner().invoke(ctl_cli.cli, ["status", "--json"])
    assert as_json.exit_code == 0, as_json.output
    shown = json.loads(as_json.output)["resolved"]
    assert (shown["kv_budget_bytes"], shown["kv_cache_tokens"]) == (
        3 * 2**20, resolved["kv_cache_tokens"])
