"""--dtype float32 on CUDA (skipped on the CPU): the kernels take IEEE fp32 products there
(kernels/common.py), so float32 is exact arithmetic on the GPU as on the CPU, and speculation
is lossless to the token: greedy output with speculation on equals it off, dense and MoE, chain
and tree. The CPU's float32 engine agrees on the opening tokens (another device sums in
another order: a near-tie later on may round the other way)."""

from __future__ import annotations

import pytest

import specd
from tests.integration.scenario import MODES

pytestmark = pytest.mark.gpu

PROMPTS = ["def fib(n):", "import os\n", "class Foo:\n    def", "for i in range(10):"]


def _greedy(model: str, device: str, mode: str) -> list[list[int]]:
    engine = specd.Engine(model=model, device=device, dtype="float32",
                          kv_cache_memory_bytes=128 * 2**20, spec_auto_measure=False,
                          **MODES[mode])
    try:
        assert engine.core.resolved.dtype == "float32"
        done = engine.generate(PROMPTS, specd.SamplingParams(max_tokens=32, ignore_eos=True))
        return [o.token_ids for o in done]
    finally:
        engine.close()


@pytest.mark.parametrize("model", ["fixture", "fixture-moe"])
def test_float32_on_cuda_is_lossless_and_agrees_with_the_cpu(model: str) -> None:
    plain = _greedy(model, "cuda", "no-head")
    for mode in ("chain", "tree"):
        assert _greedy(model, "cuda", mode) == plain, mode
    cpu = _greedy(model, "cpu", "no-head")
    assert [t[:8] for t in plain] == [t[:8] for t in cpu]
