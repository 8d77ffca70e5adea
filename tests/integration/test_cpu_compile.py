"""`--cpu-compile`: decode and verify steps on the CPU as one compiled function
(workers/runner/cpu_decode.py), and the draft loop as another (workers/runner/cpu_draft.py): the CPU
backend's compiled paths (workers/runner/cpu_backend.py).

The compiled steps and drafts give the eager engine's greedy output token for token
(float32), with the draft head's aux rows kept for speculation, verify steps, arrivals, an
abort and preemption; the attention they use matches SDPA for decode, chain and tree rows; a
compilation that fails is logged with its traceback and the engine goes on eagerly.
Compiling takes minutes on two cores: the tests that compile are marked `compile`, which
the README's test command leaves out and CI runs after the rest (.ci/run).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch

from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.runner.cpu_backend import CpuBackend
from specd.workers.runner.cpu_compile_thread import BackgroundCompiles
from specd.workers.runner.cpu_decode import KINDS, _new_rows_mask, attend_history_and_new
from specd.workers.runner.cpu_draft import CompiledDraftLoop
from tests.integration.scenario import assert_same, run


def _raise(exc: Exception) -> None:
    raise exc


def _cpu_backend(core: EngineCore) -> CpuBackend:
    backend = core.runner.backend
    assert isinstance(backend, CpuBackend)
    return backend


def _compiled_draft_loop(core: EngineCore) -> CompiledDraftLoop:
    """The compiled draft loop the worker drafts through (no CUDA graphs on the CPU)."""
    assert core.spec is not None
    loop = core.spec.drafter.loop_runner
    assert isinstance(loop, CompiledDraftLoop)
    return loop


@pytest.fixture(scope="module")
def eager() -> dict[str, list[int]]:
    out, _ = run(False, speculative_algorithm=None)
    return out


@pytest.mark.compile  # minutes of compiling on two cores
def test_compiled_decode_gives_the_eager_engines_output(eager: dict[str, list[int]]) -> None:
    # Speculation auto by threshold: plain steps (compiled, their aux rows kept) and
    # speculative steps alternate; a tiny cache forces preemption.
    got, core = run(False, cpu_compile=True, spec_mode="auto",
                    spec_disable_batch_threshold=2, spec_auto_measure=False, num_kv_blocks=10)
    assert_same(got, eager)
    backend = _cpu_backend(core)
    compiled = backend.compiled_decode
    assert compiled is not None and compiled.error is None
    assert compiled.num_steps > 20  # plain decode steps compiled
    # Requests finished and joined while others decoded, so some steps ran in the kept
    # copy's row order rather than the batch's (decode_stage.py).
    assert compiled.num_row_order_steps > 0
    # and a prefill joining the decoding batch ran beside a compiled decode, not eagerly
    assert backend.num_split_steps > 0
    assert compiled.num_verify_steps > 0  # and verify steps
    assert core.scheduler.num_preemptions > 0
    assert core.stats().num_accepted > 0  # drafts made from the compiled steps' aux rows
    assert core.resolved.graphs.startswith("cpu compiled decode (")
    # The draft loop is compiled too (no CUDA graphs on the CPU), and drafted every tree.
    draft_loop = _compiled_draft_loop(core)
    assert draft_loop.error is None
    assert draft_loop.num_calls > 0
    assert core.resolved.graphs.endswith("| draft loop compiled")


@pytest.mark.compile  # minutes of compiling on two cores
def test_compiled_verify_and_draft_loop_under_overlapped_speculation(
        eager: dict[str, list[int]]) -> None:
    # Overlap scheduling: verifies launched before the previous step is read (positions
    # and KV lengths completed on the device) run through the compiled verify step, and
    # the draft loop starts from roots the device computed; a tiny cache preempts.
    got, core = run(True, cpu_compile=True, spec_mode="on", num_kv_blocks=10)
    assert_same(got, eager)
    compiled = _cpu_backend(core).compiled_decode
    assert compiled is not None and compiled.error is None
    assert compiled.num_verify_steps > 0
    assert core.spec is not None and core.spec.verifier.num_lagged_verifies > 0
    assert _compiled_draft_loop(core).num_calls > 0
    assert core.scheduler.num_preemptions > 0


@pytest.mark.compile  # minutes of compiling on two cores
def test_compiling_in_the_background_serves_eagerly_then_compiled(
        eager: dict[str, list[int]], caplog: pytest.LogCaptureFixture) -> None:
    pending_after_warmup: list[str] = []
    gate = "held until the warm-up returned"

    def warm_then_wait(core: EngineCore) -> None:
        # The warm-up runs every kind eagerly and hands each to the compile thread; the
        # engine is ready at once, with the fallback naming what is still compiling. A
        # first job holds the thread until the warm-up returned: with a warm inductor
        # cache a kind compiles in under a second, and would otherwise be ready (and run
        # compiled) before the warm-up's last step.
        backend = _cpu_backend(core)
        assert backend.background is not None
        warmed = threading.Event()
        backend.background.submit(gate, lambda: warmed.wait(600), on_error=_raise)
        core.warmup()
        assert backend.compiled_decode is not None
        assert backend.compiled_decode.num_steps == 0  # nothing ran compiled yet
        pending_after_warmup.extend(f.name for f in backend.fallbacks())
        warmed.set()
        assert backend.background.wait(1800)
        assert backend.fallbacks() == []

    with caplog.at_level(logging.INFO, logger="specd.cpu_compile"):
        got, core = run(False, cpu_compile=True, cpu_compile_background=True,
                        spec_mode="auto", spec_disable_batch_threshold=2,
                        spec_auto_measure=False, _after_build=warm_then_wait)
    assert pending_after_warmup == ["cpu_compile_pending"]
    assert_same(got, eager)
    compiled = _cpu_backend(core).compiled_decode
    assert compiled is not None and compiled.error is None
    assert compiled.num_steps > 0 and compiled.num_verify_steps > 0
    assert _compiled_draft_loop(core).num_calls > 0
    kinds = sorted(vars(r)["kind"] for r in caplog.records
                   if getattr(r, "event", "") == "cpu_compiled" and vars(r)["kind"] != gate)
    assert kinds == sorted([*KINDS, "draft loop, batch 1", "draft loop, batch 2+"])


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
@pytest.mark.parametrize("rows", ["decode", "chain", "tree"])
def test_attention_over_history_and_new_rows_matches_sdpa(lengths: list[int], rows: str
                                                          ) -> None:
    # Batch 1 and larger batches take different paths (flash kernel vs batched matmuls);
    # decode has one new row per sequence, verification T (causal, or a draft tree).
    torch.manual_seed(0)
    g, heads, kvh, d, width = len(lengths), 4, 2, 16, 10
    t = 1 if rows == "decode" else 4
    parents = [-1, 0, 0, 1]  # the tree: node 0 the root, 1 and 2 its children, 3 under 1
    if rows == "tree":
        bits = [1, 0b11, 0b101, 0b1011] * g  # each node sees itself and its ancestors
        new_ok = _new_rows_mask(torch.tensor(bits), g, t)
        assert new_ok[0].tolist() == [[j == i or _is_ancestor(parents, j, i) for j in range(t)]
                                      for i in range(t)]
    else:
        new_ok = _new_rows_mask(None, g, t)
    q = torch.randn(g * t, heads, d)
    k_new, v_new = torch.randn(g * t, kvh, d), torch.randn(g * t, kvh, d)
    k_hist, v_hist = torch.randn(g, kvh, width, d), torch.randn(g, kvh, width, d)
    hist_ok = torch.arange(width)[None] < torch.tensor(lengths)[:, None]  # history in use
    got = attend_history_and_new(q, k_new, v_new, k_hist, v_hist, hist_ok, new_ok, 0.25)
    for b, n in enumerate(lengths):
        for i in range(t):
            row = b * t + i
            seen = [b * t + j for j in range(t) if new_ok[b, i, j]]
            keys = torch.cat([k_hist[b, :, :n], k_new[seen].transpose(0, 1)], dim=1)
            values = torch.cat([v_hist[b, :, :n], v_new[seen].transpose(0, 1)], dim=1)
            expected = torch.nn.functional.scaled_dot_product_attention(
                q[row].view(kvh, heads // kvh, 1, d).squeeze(2), keys, values, scale=0.25)
            torch.testing.assert_close(got[row], expected.reshape(heads, d))


def _is_ancestor(parents: list[int], j: int, i: int) -> bool:
    while i >= 0:
        i = parents[i]
        if i == j:
            return True
    return False


def test_a_failed_draft_loop_compilation_is_logged_once_and_drafting_goes_on_eagerly(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from specd.workers.spec.draft_graphs import DraftInputs

    def broken(*args: object) -> None:
        raise RuntimeError("C++ compile error: no compiler")

    monkeypatch.setattr(torch, "compile", lambda fn, **options: broken)
    eager_outputs: Any = object()  # what the eager loop returns, whatever it is
    eager_calls: list[DraftInputs] = []

    def eager_loop(inputs: DraftInputs) -> Any:
        eager_calls.append(inputs)
        return eager_outputs

    compiled = CompiledDraftLoop(eager_loop)
    inputs = DraftInputs(last_out=torch.zeros(1, 8), prefix_slots=torch.zeros(1, 4).long(),
                         prefix_ok=torch.ones(1, 4, dtype=torch.bool),
                         roots=torch.zeros(1).long(), root_ids=torch.zeros(1).long())
    with caplog.at_level(logging.ERROR, logger="specd.cpu_draft"):
        assert compiled.run(inputs) is eager_outputs  # drafting goes on eagerly
        assert compiled.run(inputs) is eager_outputs
    assert len(eager_calls) == 2 and compiled.num_calls == 0
    records = [r for r in caplog.records if getattr(r, "event", "") == "cpu_compile_failed"]
    assert len(records) == 1 and records[0].exc_info is not None
    assert compiled.status().startswith("draft loop eager (compilation failed")


def test_cpu_compile_is_refused_on_cuda_and_with_the_graph_stand_in() -> None:
    with pytest.raises(ValueError, match="cpu_compile"):
        EngineConfig(device="cuda", cpu_compile=True)
    with pytest.raises(ValueError, match="cpu_compile"):
        EngineConfig(cpu_compile=True, cuda_graphs=True)


def test_background_compilation_needs_cpu_compile_and_one_rank() -> None:
    with pytest.raises(ValueError, match="needs cpu_compile"):
        EngineConfig(cpu_compile_background=True)
    with pytest.raises(ValueError, match="all-reduces"):
        EngineConfig(cpu_compile=True, cpu_compile_background=True, tensor_parallel_size=2)


def test_a_failed_background_compilation_is_logged_once_and_drafting_stays_eager(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from specd.workers.spec.draft_graphs import DraftInputs

    def broken(*args: object) -> None:
        raise RuntimeError("C++ compile error: no compiler")

    monkeypatch.setattr(torch, "compile", lambda fn, **options: broken)
    eager_outputs: Any = object()
    eager_calls: list[DraftInputs] = []

    def eager_loop(inputs: DraftInputs) -> Any:
        eager_calls.append(inputs)
        return eager_outputs

    background = BackgroundCompiles()
    compiled = CompiledDraftLoop(eager_loop, background)
    inputs = DraftInputs(last_out=torch.zeros(1, 8), prefix_slots=torch.zeros(1, 4).long(),
                         prefix_ok=torch.ones(1, 4, dtype=torch.bool),
                         roots=torch.zeros(1).long(), root_ids=torch.zeros(1).long())
    with caplog.at_level(logging.ERROR, logger="specd.cpu_draft"):
        assert compiled.run(inputs) is eager_outputs  # eager while it compiles
        assert background.pending() == ["draft loop, batch 1"]
        assert background.wait(30)
        assert compiled.run(inputs) is eager_outputs  # and after it failed
    assert len(eager_calls) == 2 and compiled.num_calls == 0
    records = [r for r in caplog.records if getattr(r, "event", "") == "cpu_compile_failed"]
    assert len(records) == 1 and records[0].exc_info is not None
    assert compiled.status().startswith("draft loop eager (compilation failed")
