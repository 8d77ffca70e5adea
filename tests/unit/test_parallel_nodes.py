"""Node 0's links to the other nodes (workers/parallel/nodes.py), against a stand-in agent
speaking node_messages.py over real ZeroMQ sockets found through a real TCP store: a node
that joins, reports its start-up and takes calls; one that never joins is named with how to
start it; one that runs other code, reports a failed rank or falls silent after start-up
fails the group (the watch callback, then every call); the messages round-trip."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import msgspec
import pytest
import torch.distributed as dist
import zmq

from specd import provenance
from specd.workers.config import EngineConfig
from specd.workers.parallel import node_messages as nm
from specd.workers.parallel.local_ranks import wait_for
from specd.workers.parallel.nodes import NodeLinks
from specd.workers.parallel.peers import RankFailed


class Agent:
    """The node 1 side of the links: a DEALER and a PULL, driven by the test."""

    def __init__(self, store: dist.TCPStore) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.control = self.context.socket(zmq.DEALER)
        self.control.setsockopt(zmq.IDENTITY, nm.node_identity(1))
        self.control.connect(store.get(nm.CONTROL_KEY).decode())
        self.steps = self.context.socket(zmq.PULL)
        self.steps.connect(store.get(nm.steps_key(1)).decode())
        self.config = msgspec.json.decode(store.get(nm.CONFIG_KEY), type=EngineConfig)

    def send(self, message: nm.FromNode) -> None:
        self.control.send(nm.ENCODER.encode(message))

    def hello(self, version: str | None = None) -> None:
        self.send(nm.NodeHello(1, "node1.example", version or provenance.code_version(),
                               "/opt/specd", [nm.RankEntry(1, 4242, "cuda:0")]))

    def received(self, timeout_s: float) -> list[nm.ToNode]:
        got = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.control.poll(100):
                got.append(nm.TO_NODE.decode(self.control.recv()))
        return got

    def close(self) -> None:
        self.control.close(linger=0)
        self.steps.close(linger=0)
        self.context.term()


@pytest.fixture()
def links() -> Iterator[tuple[NodeLinks, Agent]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    config = EngineConfig(tensor_parallel_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}")
    node_links = NodeLinks(config, store, "127.0.0.1")
    agent = Agent(store)
    yield node_links, agent
    agent.close()
    node_links.close()


def test_a_node_joins_reports_its_start_and_takes_calls(links: tuple[NodeLinks, Agent]) -> None:
    node_links, agent = links
    assert agent.config == node_links.config  # every node runs node 0's config
    agent.hello()
    agent.send(nm.NodeStatus("loading"))
    agent.send(nm.NodeStatus("joining"))
    with node_links.waiting():
        wait_for(node_links.members, "joining", 10.0)
        agent.send(nm.NodeStatus("ready"))
        wait_for(node_links.members, "ready", 10.0)
    assert node_links.rank_entries() == ["rank 1 pid 4242 on cuda:0 of node 1 (node1.example)"]
    assert node_links.node_entries() == ["node 1 (node1.example: ranks 1-1)"]
    node_links.send(bytearray(b"a call"))
    node_links.send(bytearray(100_000))  # sent from where it is
    assert agent.steps.recv() == b"a call"
    assert agent.steps.recv() == bytes(100_000)
    assert any(isinstance(m, nm.HeadBeat) for m in agent.received(1.5))  # node 0 beats
    node_links.check()  # no failure


def test_a_node_that_never_joins_is_named_with_how_to_start_it(
        links: tuple[NodeLinks, Agent]) -> None:
    node_links, _ = links
    beats: list[int] = []
    addr = node_links.config.dist_init_addr
    with node_links.waiting(), pytest.raises(RuntimeError) as raised:
        wait_for(node_links.members, "joining", 2.5, lambda: beats.append(1))
    assert str(raised.value) == (
        f"node 1 (ranks 1-1; not joined: start `specd-worker --nnodes 2 --node-rank 1 "
        f"--dist-init-addr {addr}` there) not joining after 2 s")
    assert beats  # waiting on its behalf is progress (the stage watch), until the deadline


def test_a_node_running_other_code_fails_the_start(links: tuple[NodeLinks, Agent]) -> None:
    node_links, agent = links
    agent.hello(version="0123456789abcdef")
    with node_links.waiting(), pytest.raises(RuntimeError, match=(
            r"node 1 \(node1.example: ranks 1-1\) was lost before it was joining: it runs "
            r"specd code version 0123456789abcdef \(from /opt/specd\), node 0 \w+")):
        wait_for(node_links.members, "joining", 10.0)
    with pytest.raises(RankFailed, match="install the same specd on every node"):
        node_links.check()


def _ready(node_links: NodeLinks, agent: Agent) -> list[Exception]:
    failures: list[Exception] = []
    node_links.watch(failures.append)
    agent.hello()
    agent.send(nm.NodeStatus("joining"))
    agent.send(nm.NodeStatus("ready"))
    with node_links.waiting():
        wait_for(node_links.members, "joining", 10.0)
        wait_for(node_links.members, "ready", 10.0)
    return failures


def test_a_failed_rank_on_a_ready_node_fails_the_group(links: tuple[NodeLinks, Agent]) -> None:
    node_links, agent = links
    failures = _ready(node_links, agent)
    agent.send(nm.NodeFailed("rank 1 (pid 4242 on cuda:0) exited with code -9"))
    _wait(lambda: failures)
    assert str(failures[0]) == ("node 1 (node1.example: ranks 1-1) failed: rank 1 (pid 4242 "
                                "on cuda:0) exited with code -9")
    with pytest.raises(RankFailed, match="exited with code -9"):
        node_links.check()


def test_a_ready_node_that_falls_silent_fails_the_group(links: tuple[NodeLinks, Agent]) -> None:
    node_links, agent = links
    failures = _ready(node_links, agent)
    silent_from = time.monotonic()
    _wait(lambda: failures, nm.SILENCE_S + 5)
    assert time.monotonic() - silent_from >= nm.SILENCE_S - 0.5
    assert "failed: silent for" in str(failures[0])


@pytest.mark.slow  # 5-15 s: in the second tier, to keep the README's command under 10 min
def test_beats_keep_a_ready_node_alive(links: tuple[NodeLinks, Agent]) -> None:
    node_links, agent = links
    failures = _ready(node_links, agent)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(nm.BEAT_S):
            agent.send(nm.NodeBeat())

    beater = threading.Thread(target=beat)
    beater.start()
    time.sleep(nm.SILENCE_S + 1.5)
    stop.set()
    beater.join()
    assert failures == []
    node_links.check()


def _wait(got: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not got() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got()


@pytest.mark.parametrize("message", [
    nm.NodeHello(2, "h", "v", "/p", [nm.RankEntry(4, 10, "cuda:1")]), nm.NodeStatus("ready"),
    nm.NodeStatus("failed", "Traceback ..."), nm.NodeBeat(), nm.NodeFailed("gone")])
def test_messages_from_a_node_round_trip(message: nm.FromNode) -> None:
    assert nm.FROM_NODE.decode(nm.ENCODER.encode(message)) == message


@pytest.mark.parametrize("message", [nm.HeadBeat(), nm.HeadStop()])
def test_messages_to_a_node_round_trip(message: nm.ToNode) -> None:
    assert nm.TO_NODE.decode(nm.ENCODER.encode(message)) == message
