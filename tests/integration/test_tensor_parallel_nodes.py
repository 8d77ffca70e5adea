"""Tensor parallelism over two "nodes" on this machine: node 0 is an engine in this process
(rank 0, and its local ranks), node 1 a second launch, `specd-worker --nnodes 2 --node-rank
1 --dist-init-addr 127.0.0.1:PORT` (workers/parallel/node_agent.py), one torch.distributed
world over gloo on 127.0.0.1.

Greedy float32 output equals one process's: one rank per node, and two per node (size 4).
Node 1's agent exits 0 when node 0 closes its engine; node 0's start-up waits for a node
that is not there for `--dist-init-timeout-s` and then names it with how to start it; an
agent whose node 0 never comes up, or that was started with another `--nnodes`, exits on
its own (75, 78). The daemon's side (kill the worker node mid-stream, kill the head) is in
test_tensor_parallel_daemon.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from specd.exit_codes import EXIT_CONFIG, EXIT_SCHEDULER_FAILED
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from tests.integration.test_tensor_parallel import generate

WORKER = [sys.executable, "-P", "-m", "specd.workers.parallel.node_agent"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_worker(port: int, *extra: str, nnodes: int = 2) -> subprocess.Popen[str]:
    """Node 1's agent, as `specd-worker` runs it."""
    return subprocess.Popen([*WORKER, "--nnodes", str(nnodes), "--node-rank", "1",
                             "--dist-init-addr", f"127.0.0.1:{port}", "--log-format", "json",
                             *extra], stderr=subprocess.PIPE, text=True)


@pytest.fixture()
def port() -> Iterator[int]:
    yield free_port()


@pytest.fixture(scope="module")
def one_process() -> dict[str, list[list[int]]]:
    return {"off": generate("fixture", speculative_algorithm=None)[0]}


def _two_nodes(port: int, size: int, **options: Any) -> tuple[list[list[int]], int]:
    worker = start_worker(port)
    seen: dict[str, Any] = {}

    def inspect(core: EngineCore) -> None:
        seen["ranks"], seen["nodes"] = core.resolved.ranks, core.resolved.nodes

    try:
        tokens, accepted = generate("fixture", tensor_parallel_size=size, nnodes=2,
                                    dist_init_addr=f"127.0.0.1:{port}", inspect=inspect,
                                    **options)
        assert worker.wait(30) == 0, worker.stderr.read() if worker.stderr else ""
    finally:
        worker.kill()
        worker.wait()
    per_node = size // 2
    host = socket.gethostname()
    assert [r.split(" pid ")[0] for r in seen["ranks"]] == [f"rank {r}" for r in range(size)]
    assert all(entry.endswith(f" on cpu of node 1 ({host})")
               for entry in seen["ranks"][per_node:])
    last = per_node - 1
    assert seen["nodes"] == (f"node 0 ({host}: ranks 0-{last})",
                             f"node 1 ({host}: ranks {per_node}-{size - 1})")
    return tokens, accepted


@pytest.mark.slow  # two launches, an agent and a rank on two cores: 20-40 s
def test_two_nodes_of_one_rank_give_the_tokens_of_one_process(
        port: int, one_process: dict[str, list[list[int]]]) -> None:
    tokens, _ = _two_nodes(port, 2, speculative_algorithm=None)
    assert tokens == one_process["off"]


@pytest.mark.slow  # four ranks and an agent on two cores
def test_two_nodes_of_two_ranks_give_the_tokens_of_one_process(
        port: int, one_process: dict[str, list[list[int]]]) -> None:
    """Size 4, speculation on: the K/V heads shared by two ranks each, drafts verified
    over both nodes."""
    tokens, accepted = _two_nodes(port, 4, spec_mode="on")
    assert tokens == one_process["off"]
    assert accepted > 0


def test_start_up_names_a_node_that_did_not_join(port: int) -> None:
    """No agent is started for node 1 (one with another --nnodes is, and refuses)."""
    mismatched = start_worker(port, nnodes=3)
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as raised:
            EngineCore(EngineConfig(dtype="float32", speculative_algorithm=None,
                                    tensor_parallel_size=2, nnodes=2,
                                    dist_init_addr=f"127.0.0.1:{port}",
                                    dist_init_timeout_s=3.0))
        assert str(raised.value) == (
            f"node 1 (ranks 1-1; not joined: start `specd-worker --nnodes 2 --node-rank 1 "
            f"--dist-init-addr 127.0.0.1:{port}` there) not joining after 3 s")
        assert time.monotonic() - started < 60
        assert mismatched.wait(30) == EXIT_CONFIG
        assert mismatched.stderr is not None
        assert "node 0 runs --nnodes 2, this node was started with --nnodes 3" in \
            mismatched.stderr.read()
    finally:
        mismatched.kill()
        mismatched.wait()


def test_an_agent_whose_node_zero_never_comes_up_exits(port: int) -> None:
    worker = start_worker(port, "--join-timeout-s", "2")
    try:
        assert worker.wait(60) == EXIT_SCHEDULER_FAILED
        assert worker.stderr is not None
        assert f"node 0 not reachable at 127.0.0.1:{port} within 2 s" in worker.stderr.read()
    finally:
        worker.kill()
        worker.wait()
