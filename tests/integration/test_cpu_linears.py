"""The float32 linears' kernels on the CPU (workers/runner/cpu_linears.py): whichever one
`--cpu-linear` names, or `auto` measures fastest, the engine's greedy output is the same,
token for token, with speculation (a tree) and without, through arrivals, an abort and a
preemption (tests/integration/scenario.py)."""

from __future__ import annotations

import pytest

from specd.workers.config import CPU_LINEAR_KERNELS
from tests.integration.scenario import assert_same, run


@pytest.mark.parametrize("speculation", [
    {"speculative_algorithm": None},
    {"spec_mode": "on", "spec_topk": 2, "spec_num_steps": 3, "spec_num_draft_tokens": 6},
], ids=["plain", "tree"])
def test_every_float32_linear_kernel_gives_the_same_greedy_tokens(
        speculation: dict[str, object]) -> None:
    outputs = {}
    for kernel in CPU_LINEAR_KERNELS:
        outputs[kernel], core = run(False, cpu_linear=kernel, num_kv_blocks=10, **speculation)
        assert core.runner.backend.linears_status() == f"float32 on {kernel} (requested)"
        assert core.scheduler.num_preemptions > 0
        core.close()
    for kernel in CPU_LINEAR_KERNELS[1:]:
        assert_same(outputs[kernel], outputs["mkl"])
