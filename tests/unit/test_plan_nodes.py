"""`specctl plan --nnodes`: Kimi-K2.5 INT4 over two nodes of 8 x 80 GB (H100).

Oracles: rank 0 of 16 built on the meta device (a GPU of either node holds what rank 0 of a
16-way split does), specd's own command-line parser for node 0's command line and
`specd-worker`'s for the other node's, and the engine's refusals of a node count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specd.daemon.main import main as specd_main
from specd.workers.models.config import ModelConfig
from specd.workers.models.linear_factory import linear_factory
from specd.workers.models.registry import MODEL_CLASSES
from specd.workers.parallel import node_agent
from specd.workers.parallel.context import ParallelContext
from specd.workers.parallel.sharding import shard_model_config
from tests.unit.test_plan import KIMI_IGNORE, KIMI_K2, KIMI_QUANTIZATION, _run, _write_config

ADDR = "10.0.0.1:29500"


@pytest.fixture()
def kimi_k25_dir(tmp_path: Path) -> Path:
    """Kimi-K2.5 as published: Kimi-K2's language model under `text_config`, INT4 experts."""
    text = {k: v for k, v in KIMI_K2.items() if k != "quantization_config"}
    quantization = {**KIMI_QUANTIZATION, "ignore": [
        "language_model.lm_head", *KIMI_IGNORE[1:], "re:vision_tower.*"]}
    return _write_config(tmp_path / "kimi-k2.5", {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "quantization_config": quantization})


def _two_nodes(model_dir: Path, *extra: str) -> dict[str, object]:
    result = _run(str(model_dir), "-tp", "16", "--nnodes", "2", "--dist-init-addr", ADDR,
                  "--gpu-memory-gib", "80", "--json", *extra)
    assert result.exit_code == 0, result.output
    plan: dict[str, object] = json.loads(result.output)
    return plan


def test_kimi_k25_int4_on_two_nodes_of_8_h100_fits_with_rank_zero_of_16(
        kimi_k25_dir: Path) -> None:
    plan = _two_nodes(kimi_k25_dir)
    cfg = ModelConfig.from_dir(kimi_k25_dir)
    par = ParallelContext(0, 16)
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](shard_model_config(cfg, par),
                                                linear_factory(cfg), torch.device("cpu"), par)
    model.to(torch.bfloat16)  # the loader's cast; the router keeps float32
    assert plan["weight_bytes"] == sum(t.numel() * t.element_size()
                                       for t in [*model.parameters(), *model.buffers()])
    assert plan["nnodes"] == 2 and plan["tensor_parallel_size"] == 16
    assert plan["fits"] is True
    # On one node of 8 the same model does not fit an 80 GB GPU.
    one_node = json.loads(_run(str(kimi_k25_dir), "-tp", "8", "--gpu-memory-gib", "80",
                               "--json").output)
    assert one_node["fits"] is False


def test_the_two_nodes_command_lines_parse_as_specd_and_specd_worker(
        kimi_k25_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _two_nodes(kimi_k25_dir)
    serve = str(plan["serve_command"]).split()
    assert serve[0] == "specd"
    params = specd_main.make_context("specd", serve[1:]).params
    assert (params["nnodes"], params["dist_init_addr"]) == (2, ADDR)
    assert params["tensor_parallel_size"] == 16
    assert params["num_kv_blocks"] == plan["num_kv_blocks"]

    assert plan["worker_commands"] == [
        f"specd-worker --nnodes 2 --node-rank 1 --dist-init-addr {ADDR}"]
    started: list[tuple[object, ...]] = []

    class Agent:
        def __init__(self, *args: object) -> None:
            started.append(args)

        def run(self) -> int:
            return 0

    monkeypatch.setattr(node_agent, "NodeAgent", Agent)
    monkeypatch.setattr(node_agent, "setup_logging", lambda *args: None)
    with pytest.raises(SystemExit) as exited:
        node_agent.main(str(plan["worker_commands"][0]).split()[1:])
    assert exited.value.code == 0
    assert started == [(2, 1, ADDR, node_agent.JOIN_TIMEOUT_S)]


def test_the_table_shows_the_nodes_and_each_command_line(kimi_k25_dir: Path) -> None:
    result = _run(str(kimi_k25_dir), "-tp", "16", "--nnodes", "2", "--dist-init-addr", ADDR,
                  "--gpu-memory-gib", "80")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "layout       16 x 80.0 GiB over 2 nodes (8 each), tensor parallel, bfloat16" in lines
    (serve,) = [x for x in lines if x.startswith("serve with   specd ")]
    assert serve.endswith("  (node 0)") and f"--nnodes 2 --dist-init-addr {ADDR}" in serve
    assert f"node 1       specd-worker --nnodes 2 --node-rank 1 --dist-init-addr {ADDR}" in lines


@pytest.mark.parametrize(("args", "message"), [
    (["-tp", "16", "--nnodes", "2"], "--nnodes > 1 needs --dist-init-addr"),
    (["-tp", "12", "--nnodes", "8", "--dist-init-addr", ADDR],
     "tensor_parallel_size 12 must be a multiple of nnodes 8"),
    (["-tp", "16", "--nnodes", "2", "--dist-init-addr", "10.0.0.1"], "HOST:PORT"),
])
def test_a_node_layout_the_engine_refuses_is_refused_naming_it(
        kimi_k25_dir: Path, args: list[str], message: str) -> None:
    result = _run(str(kimi_k25_dir), *args, "--gpu-memory-gib", "80")
    assert result.exit_code == 2
    assert message in result.output
