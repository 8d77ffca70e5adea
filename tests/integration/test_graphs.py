"""Captured forwards (workers/runner/graphs.py) on the CPU stand-in: steps of a captured shape
replay over static buffers, padded to the next captured batch size, and greedy output is
token for token the eager engine's, with and without overlap scheduling, for every
speculation mode, with arrivals, an abort and preemption. A capture that fails is logged
(one ERROR record with the traceback), shown in the status, and the engine runs eagerly."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from specd.workers.engine.core import EngineCore
from specd.workers.engine.isolation import StepFailed
from specd.workers.runner import graphs as graphs_module
from specd.workers.runner.graph_backend import GraphBackend, GraphDraftLoop
from specd.workers.runner.graphs import GraphRunner, GraphShape
from specd.workers.spec.draft_graphs import DraftGraphs
from tests.integration.scenario import MODES, assert_same, run


def _graphs(core: EngineCore) -> GraphRunner | None:
    """The target's captured forwards, if the runner's backend is the graph backend."""
    backend = core.runner.backend
    return backend.graphs if isinstance(backend, GraphBackend) else None


def _draft_graphs(core: EngineCore) -> DraftGraphs | None:
    """The captured draft loops, if the worker drafts through them."""
    loop = None if core.spec is None else core.spec.drafter.loop_runner
    return loop.graphs if isinstance(loop, GraphDraftLoop) else None


@pytest.fixture(scope="module")
def eager() -> dict[str, list[int]]:
    out, _ = run(False, speculative_algorithm=None)
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("overlap", [False, True], ids=["whole-step", "overlap"])
def test_graph_replay_gives_the_eager_engines_output(
        eager: dict[str, list[int]], mode: str, overlap: bool) -> None:
    # max_num_seqs 6: captured at 1, 2, 4 and 6, so batches of 3 and 5 are padded.
    got, core = run(overlap, cuda_graphs=True, max_num_seqs=6, **MODES[mode])
    assert_same(got, eager)
    graphs = _graphs(core)
    assert graphs is not None and graphs.error is None
    decode = [s for s in graphs.replays if s.query_len == 1]
    verify = [s for s in graphs.replays if s.query_len > 1]
    assert bool(decode) == (mode != "chain" and mode != "tree")  # spec on: every step verifies
    assert bool(verify) == (mode in ("chain", "tree", "auto-threshold"))
    assert all(s.tree_mask == (mode == "tree") for s in verify)
    assert any(s.num_seqs in (4, 6) for s in graphs.replays), "no step was padded"
    if mode in ("chain", "tree", "auto-threshold"):
        draft_graphs = _draft_graphs(core)
        assert draft_graphs is not None and draft_graphs.error is None
        assert sum(draft_graphs.replays.values()) > 0  # the draft loop replayed
    assert graphs.num_eager > 0  # prefill chunks are never captured


def test_graph_replay_under_preemption(eager: dict[str, list[int]]) -> None:
    for options in ({"speculative_algorithm": None}, {"spec_mode": "on"}):
        got, core = run(True, cuda_graphs=True, num_kv_blocks=10, **options)
        assert core.scheduler.num_preemptions > 0
        graphs = _graphs(core)
        assert graphs is not None and graphs.num_replays > 0
        assert_same(got, eager)


def test_padding_rows_touch_only_the_spare_block(eager: dict[str, list[int]]) -> None:
    def poison_spare_block(core: EngineCore) -> None:
        runner, graphs = core.runner, _graphs(core)
        assert graphs is not None and graphs.pad_block == runner.num_kv_blocks
        for layer in runner.kv_caches:
            assert layer.shape[1] == runner.num_kv_blocks + 1  # the scheduler's blocks + 1
            layer[:, runner.num_kv_blocks] = float("nan")

    got, core = run(False, cuda_graphs=True, speculative_algorithm=None, max_num_seqs=6,
                    _after_build=poison_spare_block)
    assert_same(got, eager)  # no real row read the spare block
    _, eager_core = run(False, speculative_algorithm=None, max_num_seqs=6)
    owned = core.runner.num_kv_blocks
    for graph_layer, eager_layer in zip(core.runner.kv_caches, eager_core.runner.kv_caches,
                                        strict=True):
        # Same K/V in the same blocks (the graphs took one block of the budget; padding
        # changes GEMM shapes: rounding only).
        torch.testing.assert_close(graph_layer[:, :owned], eager_layer[:, :owned], atol=1e-5,
                                   rtol=1e-5)


def test_status_names_the_captured_shapes_and_their_memory() -> None:
    _, core = run(False, cuda_graphs=True, spec_mode="on", spec_topk=1, spec_num_steps=4,
                  max_num_seqs=6)
    status = core.resolved.graphs
    assert status.startswith("cpu stand-in: decode at 1,2,4,6; verify T=5 at 1,2,4,6;")
    assert core.resolved.graph_memory_bytes > 0


def test_graphs_off_by_default_on_the_cpu() -> None:
    _, core = run(False, speculative_algorithm=None)
    assert _graphs(core) is None and core.resolved.graphs == "off"


@pytest.mark.parametrize("fixed_blocks", [None, 64], ids=["budget", "num_kv_blocks"])
@pytest.mark.parametrize("mode", ["no-head", "chain"])
def test_a_failed_capture_is_logged_and_the_engine_runs_eagerly(
        eager: dict[str, list[int]], fixed_blocks: int | None, mode: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: graphs_module.EagerGraph[object], forward: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_module.EagerGraph, "__init__", broken)
    with caplog.at_level(logging.ERROR, logger="specd.graphs"):
        got, core = run(False, cuda_graphs=True, num_kv_blocks=fixed_blocks, **MODES[mode])
    records = [r for r in caplog.records if getattr(r, "event", "") == "graph_capture_failed"]
    # One record per captured thing: the target forward, and the draft loop with a head.
    assert [getattr(r, "what", "") for r in records] == (
        ["target forward"] + (["draft loop"] if mode == "chain" else []))
    for record in records:
        # The traceback travels once, as exc_info (JSON's "traceback" field is made of it).
        assert record.exc_info is not None and record.exc_info[0] is RuntimeError
    status = core.resolved.graphs
    assert status.startswith("eager (capture of GraphShape(")
    assert "operation not permitted" in status
    assert (" | draft loop eager (capture of (" in status) == (mode == "chain")
    graphs = _graphs(core)
    assert graphs is not None and graphs.num_replays == 0
    assert_same(got, eager)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_nan_drafts_are_reported_on_both_paths(graphs: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The draft loop's NaN check runs on the host (a captured loop cannot read the device):
    # a head that yields NaN fails the step, whether the loop replays or not. Every request
    # fails alone too, so no request is blamed: the engine raises StepFailed with the NaN
    # error as its cause (the scheduler process exits 75 on it).
    with pytest.raises(StepFailed) as failed:
        run(False, cuda_graphs=graphs, spec_mode="on", max_num_seqs=6,
            _after_build=lambda core: _poison_head(core, monkeypatch))
    cause = failed.value.__cause__
    assert isinstance(cause, ValueError)
    assert "draft log-probabilities contain NaN" in str(cause)


def _poison_head(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    assert core.spec is not None
    head = core.spec.head
    real = head.logits
    monkeypatch.setattr(head, "logits", lambda out: real(out) * float("nan"))


def test_the_draft_cache_is_paid_from_the_kv_budget() -> None:
    # Same budget: with a head, each block also holds the head's K/V, so fewer blocks fit.
    _, plain = run(False, speculative_algorithm=None)
    _, spec = run(False, spec_mode="on")
    assert spec.runner.num_kv_blocks < plain.runner.num_kv_blocks
    assert spec.spec is not None
    target = spec.runner.kv_caches[0].nbytes * len(spec.runner.kv_caches)
    used = target + spec.spec.draft_kv.nbytes
    assert used <= spec.runner.kv_budget.num_bytes


def test_capture_sizes_and_padding() -> None:
    assert graphs_module.capture_sizes(6) == (1, 2, 4, 6)
    assert graphs_module.capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert graphs_module.capture_sizes(1) == (1,)
    sizes = graphs_module.capture_sizes(64)
    assert [graphs_module.padded_size(sizes, b) for b in (1, 3, 5, 9, 33, 64, 65)] == [
        1, 4, 8, 16, 48, 64, None]
    assert GraphShape(4, 6, True).num_tokens == 24


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["no-head", "chain", "tree"])
def test_cuda_graphs_give_the_eager_output_at_captured_sizes(mode: str) -> None:
    # bfloat16, batches of captured sizes only, so that graph and eager run the same kernels
    # on the same shapes; and the same KV split count: a graph is sized for the longest
    # sequence (max_model_len + a draft tree), an eager step for its own, and the attention
    # picks its splits from that bound (kernels/tree_attention.py). max_model_len 192 bounds
    # both at 256 keys, one split. Across split counts bf16 outputs differ by a rounding
    # (tests/kernels/test_tree_attention.py::test_what_holds_across_split_counts), which can
    # turn a near-tie into another greedy token: token equality holds at equal counts only.
    import specd

    prompts = ["def fib(n):", "import os\n", "class Foo:\n    def", "for i in range(10):"]
    outs = {}
    for graphs in (False, True):
        engine = specd.Engine(device="cuda", dtype="bfloat16", cuda_graphs=graphs,
                              spec_auto_measure=False, kv_cache_memory_bytes=256 * 2**20,
                              max_model_len=192, **MODES[mode])
        done = engine.generate(prompts, specd.SamplingParams(max_tokens=48, ignore_eos=True))
        outs[graphs] = [o.token_ids for o in done]
        captured = _graphs(engine.core)
        if graphs:
            assert captured is not None and captured.error is None
            assert captured.num_replays > 0
            assert engine.core.resolved.graphs.startswith("cuda: decode at 1,2,4,8")
            assert engine.core.resolved.graph_memory_bytes > 0
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_cuda_graph_replay_in_the_mixed_scenario() -> None:
    # Padded batches run other GEMM shapes than eager ones, so bfloat16 may round a
    # near-tie differently: every request must start the same and most must match whole.
    expected, _ = run(False, device="cuda", dtype="bfloat16", cuda_graphs=False,
                      speculative_algorithm=None)
    got, core = run(True, device="cuda", dtype="bfloat16", cuda_graphs=True,
                    speculative_algorithm=None)
    graphs = _graphs(core)
    assert graphs is not None and graphs.num_replays > 0
    same = sum(got[r] == expected[r] for r in expected)
    assert all(got[r][:4] == expected[r][:4] for r in expected)
    assert same >= len(expected) - 1


@pytest.mark.gpu
def test_a_failed_cuda_capture_is_reported(monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    # A host sync inside the captured forward is what breaks real captures.
    import specd
    from specd.workers.models.decoder import DecoderForCausalLM

    real = DecoderForCausalLM.forward

    def syncing(self: DecoderForCausalLM, *args: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_current_stream_capturing():
            args[0].sum().item()  # not permitted while capturing: the capture fails
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DecoderForCausalLM, "forward", syncing)
    with caplog.at_level(logging.ERROR, logger="specd.graphs"):
        engine = specd.Engine(device="cuda", dtype="bfloat16", cuda_graphs=True,
                              speculative_algorithm=None)
    assert any(getattr(r, "event", "") == "graph_capture_failed" for r in caplog.records)
    assert engine.core.resolved.graphs.startswith("eager (")
    out = engine.generate(["def fib(n):"], specd.SamplingParams(max_tokens=8,
                                                                 ignore_eos=True))
    assert len(out[0].token_ids) == 8
