"""Tensor and expert parallelism on two GPUs over NCCL: size 2 generates, greedy in float32,
the size-1 tokens (the CPU tests' oracle and prompts), dense and MoE fixtures, speculation
off and on, and whole experts per rank. Skipped with fewer than two CUDA devices
(tools/gpu_check.sh runs it on the GPU machine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integration.test_tensor_parallel import generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices"),
]


@pytest.mark.parametrize(("model", "options"), [
    ("fixture", {"speculative_algorithm": None}),
    ("fixture", {"spec_mode": "on"}),
    ("fixture-moe", {"spec_mode": "on"}),
    ("fixture-moe", {"speculative_algorithm": None, "expert_parallel": True}),
])
def test_size_two_over_nccl_generates_the_size_one_tokens(model: str,
                                                          options: dict[str, Any]) -> None:
    single, _ = generate(model, device="cuda", speculative_algorithm=None)
    tokens, accepted = generate(model, device="cuda", tensor_parallel_size=2, **options)
    assert tokens == single
    assert (accepted > 0) == (options.get("spec_mode") == "on")
