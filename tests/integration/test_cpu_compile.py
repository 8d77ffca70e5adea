"""`--cpu-compile`: plain decode on the CPU as one compiled function (workers/cpu_decode.py).

The compiled step gives the eager engine's greedy output token for token (float32), with
the draft head's aux rows kept for speculation, arrivals, an abort and preemption; a
compilation that fails is logged with its traceback and the engine goes on eagerly.
Compiling takes a while on two cores, so the compiled engine is built once here.
"""

from __future__ import annotations

import logging

import pytest
import torch
from scenario import assert_same, run

from specd.workers.config import EngineConfig
from specd.workers.cpu_decode import attend_history_and_new


@pytest.fixture(scope="module")
def eager() -> dict[str, list[int]]:
    out, _ = run(False, speculative_algorithm=None)
    return out


def test_compiled_decode_gives_the_eager_engines_output(eager: dict[str, list[int]]) -> None:
    # Speculation auto by threshold: plain steps (compiled, their aux rows kept) and
    # speculative steps alternate; a tiny cache forces preemption.
    got, core = run(False, cpu_compile=True, spec_mode="auto",
                    spec_disable_batch_threshold=2, spec_auto_measure=False, num_kv_blocks=10)
    assert_same(got, eager)
    compiled = core.runner.compiled_decode
    assert compiled is not None and compiled.error is None
    assert compiled.num_steps > 20
    assert core.scheduler.num_preemptions > 0
    assert core.stats().num_accepted > 0  # drafts made from the compiled steps' aux rows
    assert core.resolved.graphs.startswith("cpu compiled decode (")


def test_a_failed_compilation_is_logged_and_decode_runs_eagerly(
        eager: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("C++ compile error: no compiler")

    # What torch.compile returns fails at its first call, as a failed compilation does.
    monkeypatch.setattr(torch, "compile", lambda fn, **options: broken)
    with caplog.at_level(logging.ERROR, logger="specd.cpu_decode"):
        got, core = run(False, cpu_compile=True, speculative_algorithm=None)
    records = [r for r in caplog.records if getattr(r, "event", "") == "cpu_compile_failed"]
    assert len(records) == 1 and records[0].exc_info is not None
    assert core.resolved.graphs.startswith("cpu compiled decode off (compilation failed")
    assert "no compiler" in core.resolved.graphs
    assert_same(got, eager)


@pytest.mark.parametrize("lengths", [[0], [7], [0, 5, 10]], ids=["1-empty", "1", "3"])
def test_attention_over_history_and_new_token_matches_sdpa(lengths: list[int]) -> None:
    # Batch 1 and larger batches take different paths (flash kernel vs batched matmuls).
    torch.manual_seed(0)
    g, heads, kvh, d, width = len(lengths), 4, 2, 16, 10
    q = torch.randn(g, heads, d)
    k_new, v_new = torch.randn(g, kvh, d), torch.randn(g, kvh, d)
    k_hist, v_hist = torch.randn(g, kvh, width, d), torch.randn(g, kvh, width, d)
    ok = torch.arange(width)[None] < torch.tensor(lengths)[:, None]  # history in use
    got = attend_history_and_new(q, k_new, v_new, k_hist, v_hist, ok, 0.25)
    for b, n in enumerate(lengths):
        keys = torch.cat([k_hist[b, :, :n], k_new[b, :, None]], dim=1)  # [kvh, n + 1, d]
        values = torch.cat([v_hist[b, :, :n], v_new[b, :, None]], dim=1)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[b].view(kvh, heads // kvh, d), keys, values, scale=0.25)
        torch.testing.assert_close(got[b], expected.reshape(heads, d))


def test_cpu_compile_is_refused_on_cuda_and_with_the_graph_stand_in() -> None:
    with pytest.raises(ValueError, match="cpu_compile"):
        EngineConfig(device="cuda", cpu_compile=True)
    with pytest.raises(ValueError, match="cpu_compile"):
        EngineConfig(cpu_compile=True, cuda_graphs=True)
