"""Tensor and expert parallelism on the CPU over gloo (workers/parallel/).

Size 2 (rank 0 in this process, rank 1 a worker process) generates, greedy in float32, the
same tokens as size 1 on held-out prompts: for the dense fixture and the MoE fixture (MLA
query heads split, the latent cache whole on each rank, each expert's width split), with
speculation off, chains and trees (the EAGLE-3 head runs on rank 0 only), with whole
experts per rank (`expert_parallel`; INT4 experts too), with captured forwards (the CPU
stand-in of CUDA graphs) and with `--cpu-compile` (the all-reduces inside the compiled
steps). Speculation on must also have accepted drafts, so the verify path really ran
sharded. Size 4 keeps the tokens too (chains, and trees for both fixtures). Every call
reaches the workers through the step ring (workers/parallel/ring.py).
A rank that dies fails the engine, not a request.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from specd import Engine
from specd.ipc.sampling import SamplingParams
from specd.workers.config import FIXTURE_DIR, FIXTURE_MOE_DIR, EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.models.config import ModelConfig
from specd.workers.parallel.context import rank_device
from specd.workers.parallel.driver import RankFailed
from specd.workers.runner.cpu_backend import CpuBackend
from specd.workers.runner.graph_backend import GraphBackend
from specd.workers.runner.kv_cache import kv_bytes_per_token
from tests.integration.heldout import heldout_prompt_ids

PROMPTS = heldout_prompt_ids(3, 7, 11)
NEW_TOKENS = 12


def generate(model: str, device: str = "cpu", inspect: Callable[[EngineCore], None] | None = None,
             **options: Any) -> tuple[list[list[int]], int]:
    """Greedy continuations of PROMPTS (batched) and the number of accepted drafts. The
    engine is closed after (`inspect` sees it before), and its worker ranks must have
    exited cleanly."""
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(model=model, device=device, dtype="float32",
                                   max_num_batched_tokens=32, **options))
    driver = core.runner.driver
    processes = [] if driver is None else driver.workers.processes
    assert len(processes) == core.config.ranks_per_node - 1  # this node's
    pids = [os.getpid()] + [p.pid for p in processes]
    assert core.resolved.ranks[:len(pids)] == (() if driver is None else tuple(
        f"rank {r} pid {pid} on {rank_device(device, r)}" for r, pid in enumerate(pids)))
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        for i, ids in enumerate(PROMPTS):
            core.add_request(f"r{i}", ids, params)
        outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        accepted = 0
        while core.has_unfinished():
            for delta in core.step():
                outs[delta.request_id] += delta.new_token_ids
                if delta.finish_reason is not None:
                    accepted += delta.num_accepted
        if inspect is not None:
            inspect(core)
    finally:
        core.close()
    assert all(p.exitcode == 0 for p in processes)
    return [outs[f"r{i}"] for i in range(len(PROMPTS))], accepted


@pytest.fixture(scope="module")
def single_rank() -> dict[str, list[list[int]]]:
    """Size 1, speculation off: the reference for every parallel run."""
    return {model: generate(model, speculative_algorithm=None)[0]
            for model in ("fixture", "fixture-moe")}


@pytest.mark.parametrize("model", ["fixture", "fixture-moe"])
def test_size_two_generates_the_size_one_tokens(model: str,
                                                single_rank: dict[str, Any]) -> None:
    tokens, _ = generate(model, speculative_algorithm=None, tensor_parallel_size=2)
    assert tokens == single_rank[model]


@pytest.mark.parametrize("model", ["fixture", "fixture-moe"])
def test_size_two_with_speculation_keeps_the_tokens_and_accepts_drafts(
        model: str, single_rank: dict[str, Any]) -> None:
    tokens, accepted = generate(model, spec_mode="on", tensor_parallel_size=2)
    assert tokens == single_rank[model]
    assert accepted > 0


@pytest.mark.slow  # 5-15 s: in the second tier, to keep the README's command under 10 min
def test_size_four_replicates_kv_heads_and_keeps_the_tokens(
        single_rank: dict[str, Any]) -> None:
    """The dense fixture's 2 K/V heads over 4 ranks: each rank holds one query head and the
    K/V head it shares with its neighbour (speculation on, so verify runs over them too)."""
    tokens, accepted = generate("fixture", spec_mode="on", tensor_parallel_size=4)
    assert tokens == single_rank["fixture"]
    assert accepted > 0


@pytest.mark.slow  # five processes on two cores, each rank verifying trees: 20-30 s each
@pytest.mark.parametrize("model", ["fixture", "fixture-moe"])
def test_size_four_with_tree_speculation_keeps_the_tokens(model: str,
                                                          single_rank: dict[str, Any]) -> None:
    """Four ranks verifying draft trees: one query head each (the dense fixture's K/V heads
    shared by two ranks each; MLA's latent cache whole on each), three readers of the step
    ring."""
    tokens, accepted = generate(model, spec_mode="on", spec_topk=2, spec_num_steps=3,
                                spec_num_draft_tokens=6, tensor_parallel_size=4)
    assert tokens == single_rank[model]
    assert accepted > 0


@pytest.mark.parametrize("model", ["fixture", "fixture-moe"])
def test_size_two_with_tree_speculation_keeps_the_tokens(model: str,
                                                         single_rank: dict[str, Any]) -> None:
    """Draft trees (top-k 2): verification with a tree mask over split K/V heads, and over
    MLA's latent cache; the tree's KV compaction runs on every rank."""
    tokens, accepted = generate(model, spec_mode="on", spec_topk=2, spec_num_steps=3,
                                spec_num_draft_tokens=6, tensor_parallel_size=2)
    assert tokens == single_rank[model]
    assert accepted > 0


def _replayed(core: EngineCore) -> None:
    backend = core.runner.backend
    assert isinstance(backend, GraphBackend) and backend.graphs.error is None
    assert backend.graphs.num_replays > 0


@pytest.mark.parametrize("options", [{"speculative_algorithm": None}, {"spec_mode": "on"}],
                         ids=["plain", "chain"])
@pytest.mark.slow  # 5-15 s: in the second tier, to keep the README's command under 10 min
def test_size_two_with_captured_forwards_keeps_the_tokens(
        options: dict[str, Any], single_rank: dict[str, Any]) -> None:
    """Graphs with parallelism, through the CPU stand-in of CUDA graphs: every rank
    captures the same shapes (decode, and verify with a head) and replays them."""
    tokens, _ = generate("fixture", tensor_parallel_size=2, cuda_graphs=True,
                         inspect=_replayed, **options)
    assert tokens == single_rank["fixture"]


def _compiled(core: EngineCore) -> None:
    backend = core.runner.backend
    assert isinstance(backend, CpuBackend) and backend.compiled_decode is not None
    assert backend.compiled_decode.error is None
    # Decode steps compiled (speculation off) or verify steps (on), all-reduces inside.
    if core.spec is None:
        assert backend.compiled_decode.num_steps > 0
    else:
        assert backend.compiled_decode.num_verify_steps > 0


@pytest.mark.compile  # each rank compiles decode and verify at batch 1 and above
@pytest.mark.parametrize("options", [{"speculative_algorithm": None},
                                     {"spec_mode": "on"},
                                     {"spec_mode": "on", "spec_topk": 2, "spec_num_steps": 3,
                                      "spec_num_draft_tokens": 6}],
                         ids=["plain", "chain", "tree"])
def test_size_two_with_cpu_compile_keeps_the_tokens(options: dict[str, Any],
                                                    single_rank: dict[str, Any]) -> None:
    tokens, _ = generate("fixture", tensor_parallel_size=2, cpu_compile=True,
                         inspect=_compiled, **options)
    assert tokens == single_rank["fixture"]


@pytest.mark.parametrize("spec_mode", ["off", "on"])
def test_expert_parallel_generates_the_size_one_tokens(
        spec_mode: str, single_rank: dict[str, Any]) -> None:
    tokens, accepted = generate("fixture-moe", spec_mode=spec_mode, tensor_parallel_size=2,
                                expert_parallel=True)
    assert tokens == single_rank["fixture-moe"]
    assert (accepted > 0) == (spec_mode == "on")


def test_a_worker_rank_killed_mid_stream_fails_the_engine_not_a_request() -> None:
    """SIGKILL of rank 1 between steps: the next step raises RankFailed (which the engine
    does not isolate: the scheduler process exits 75) within a second, naming the rank."""
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(dtype="float32", speculative_algorithm=None,
                                   tensor_parallel_size=2))
    try:
        core.add_request("r0", PROMPTS[0], SamplingParams(max_tokens=NEW_TOKENS,
                                                          ignore_eos=True))
        core.step()
        driver = core.runner.driver
        assert driver is not None
        rank1 = driver.workers.processes[0]
        assert rank1.pid is not None
        os.kill(rank1.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+ on cpu\) exited with code -9"):
            while True:  # a step that began before the kill may still complete
                core.step()
        assert time.monotonic() - started < 2.0
    finally:
        core.close()


@pytest.fixture(scope="module")
def int4_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MoE fixture with INT4 routed experts (tools/quantize.py's moe recipe, group 32)."""
    from tools import quantize

    out = tmp_path_factory.mktemp("moe-int4") / "int4"
    assert quantize.main([str(FIXTURE_MOE_DIR), str(out), "--recipe", "moe"]) == 0
    return out


def test_expert_parallel_places_int4_experts_and_keeps_the_tokens(int4_moe_dir: Path) -> None:
    head = str(FIXTURE_MOE_DIR / "eagle3")
    single, _ = generate(str(int4_moe_dir), speculative_algorithm=None, draft_model=head)
    tokens, accepted = generate(str(int4_moe_dir), spec_mode="on", tensor_parallel_size=2,
                                expert_parallel=True, draft_model=head)
    assert tokens == single and accepted > 0


def test_int4_experts_that_would_split_a_quantization_group_are_refused(
        int4_moe_dir: Path) -> None:
    """Each expert's width 96 split in 2 is 48 columns of down_proj: not whole groups of 32."""
    with pytest.raises(ValueError, match="group_size 32 does not divide"):
        EngineCore(EngineConfig(model=str(int4_moe_dir), speculative_algorithm=None,
                                dtype="float32", tensor_parallel_size=2))


def test_each_rank_sizes_its_kv_cache_by_its_own_heads() -> None:
    """The budget is each rank's: at size 2 a rank of the dense fixture holds 1 of its 2 K/V
    heads, so a token costs half the bytes and the same budget holds twice the blocks."""
    budget = 2**22
    full = ModelConfig.from_dir(FIXTURE_DIR)
    config = EngineConfig(dtype="float32", speculative_algorithm=None,
                          kv_cache_memory_bytes=budget, tensor_parallel_size=2)
    core = EngineCore(config)
    try:
        per_token = kv_bytes_per_token(full, torch.float32) // 2
        assert core.resolved.kv_bytes_per_token == per_token
        assert core.runner.num_kv_blocks == budget // (per_token * config.block_size)
        assert [tuple(layer.shape) for layer in core.runner.kv_caches[:1]] == [
            (2, core.runner.num_kv_blocks, config.block_size, 1, full.head_dim)]
    finally:
        core.close()


def test_engine_close_stops_its_worker_ranks(single_rank: dict[str, Any]) -> None:
    """`specd.Engine` as a context manager: its worker rank serves while the block runs and
    has exited cleanly when it ends; a second close is a no-op and a closed engine refuses
    to generate."""
    torch.set_num_threads(1)
    with Engine("fixture", device="cpu", dtype="float32", speculative_algorithm=None,
                tensor_parallel_size=2) as engine:
        driver = engine.core.runner.driver
        assert driver is not None
        (rank1,) = driver.workers.processes
        outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS,
                                                          ignore_eos=True))
        assert [o.token_ids for o in outputs] == single_rank["fixture"]
        assert rank1.is_alive()
    assert rank1.exitcode == 0
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(PROMPTS[:1])


# No `if __name__ == "__main__":` guard: the ranks must not re-run this script.
NO_MAIN_GUARD = """\
import json, specd, torch
torch.set_num_threads(1)
engine = specd.Engine("fixture", dtype="float32", speculative_algorithm=None,
                      max_num_batched_tokens=32, tensor_parallel_size=2)
params = specd.SamplingParams(max_tokens={tokens}, ignore_eos=True)
print(json.dumps([o.token_ids for o in engine.generate({prompts}, params)]))
"""


def test_a_script_without_a_main_guard_runs_a_parallel_engine(
        tmp_path: Path, single_rank: dict[str, Any]) -> None:
    script = tmp_path / "generate.py"
    script.write_text(NO_MAIN_GUARD.format(tokens=NEW_TOKENS, prompts=json.dumps(PROMPTS)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == single_rank["fixture"]


@pytest.mark.parametrize(("module", "error"), [
    # Imported before its control pipe is open: the exception line of its stderr.
    ("msgspec", r"exited with code 1 before it was joining: ImportError: planted"),
    # Imported after: it reports the traceback itself.
    ("torch", r"failed while starting:\n(.*\n)*ImportError: planted"),
])
def test_a_rank_that_fails_to_start_is_named_with_its_own_error(
        module: str, error: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's interpreter finds a planted module that raises on import: rank 0's error
    carries that exception line, not only an exit code."""
    (tmp_path / module).mkdir()
    (tmp_path / module / "__init__.py").write_text(
        f"raise ImportError('planted: no {module} for this interpreter')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # rank 0 imported the real one already
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+ on cpu\) " + error):
        EngineCore(EngineConfig(dtype="float32", speculative_algorithm=None,
                                tensor_parallel_size=2))
