"""The other nodes as node 0 (rank 0, in the scheduler process) sees them.

With `--nnodes N` the tensor-parallel ranks are spread over N hosts, N / nnodes each, all
in one torch.distributed world (NCCL on GPUs, gloo on the CPU) whose TCP store rank 0 hosts
at `--dist-init-addr`. Node 0 runs the front, the scheduler (rank 0) and its other local
ranks; every other node runs `specd-worker` (node_agent.py), which starts that node's ranks.

`NodeLinks` publishes in the store what an agent needs (the engine config, so that every
node runs the same; the addresses of its control and step sockets), then keeps for each
node:

* a step socket (ZeroMQ PUSH, one hop per node): every call rank 0 sends its local ranks
  through the step ring goes to each node's agent too, which writes it into that node's
  ring (`send`; the main thread's);
* a control link (node_messages.py; the watch thread's): the node's hello, the start-up
  statuses of its ranks, beats both ways, and its failures. While a node starts, what it
  reports reaches rank 0's main thread through a pipe per node (`members`, which
  local_ranks.wait_for reads as it reads a local rank's), so that a node's loading beats
  are rank 0's progress for the stage watch; a node that has not said hello yet beats
  there once a second on its behalf (waiting for it is bounded by
  `--dist-init-timeout-s`, after which the wait names it and how to start it).

A node that fails after start-up (its agent reports a rank that died, or it is silent for
SILENCE_S: killed, hung, cut off) sets `failure`, which the next call raises as RankFailed,
and calls the `watch` callback from the watch thread: the scheduler process ends itself
there, as rank 0 may be waiting for that node inside a collective that would only time
out after COLLECTIVE_TIMEOUT.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import Pipe

import msgspec
import torch.distributed as dist
import zmq

from specd import provenance
from specd.workers.config import EngineConfig
from specd.workers.parallel import node_messages as nm
from specd.workers.parallel.peers import RankFailed

log = logging.getLogger("specd.parallel")

POLL_S = 0.1
ZERO_COPY_BYTES = 65536  # smaller calls are copied into zmq's buffers (cheaper than pinning)


class RemoteNode:
    """Node `node_rank` as rank 0's start-up wait sees it (local_ranks.Starting): `pipe`
    carries its statuses; it has no process here, so its end is the pipe's end."""

    sentinel = None

    def __init__(self, node_rank: int, config: EngineConfig) -> None:
        self.node_rank = node_rank
        self.config = config
        self.pipe, self.writer = Pipe(duplex=False)
        self.hello: nm.NodeHello | None = None
        self.last_heard = time.monotonic()
        self.is_ready = False
        self.lost = ""  # why it is gone

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.config.ranks_per_node

    def describe(self) -> str:
        """"node R (HOST: ranks A-B)", or how to start it while it has not joined."""
        last = self.first_rank + self.config.ranks_per_node - 1
        if self.hello is None:
            return (f"node {self.node_rank} (ranks {self.first_rank}-{last}; not joined: start "
                    f"`specd-worker --nnodes {self.config.nnodes} --node-rank {self.node_rank} "
                    f"--dist-init-addr {self.config.dist_init_addr}` there)")
        return f"node {self.node_rank} ({self.hello.host}: ranks {self.first_rank}-{last})"

    def exit_error(self, expected: str) -> str:
        return f"{self.describe()} was lost before it was {expected}: {self.lost}"

    def rank_entries(self) -> list[str]:
        """"rank R pid P on DEVICE of node N (HOST)" for each of its ranks."""
        if self.hello is None:
            return []
        return [f"rank {r.rank} pid {r.pid} on {r.device} of node {self.node_rank} "
                f"({self.hello.host})" for r in self.hello.ranks]

    def report(self, status: str, detail: str = "") -> None:
        """A start-up status for rank 0's wait (the watch thread's only)."""
        if not self.writer.closed:
            self.writer.send((status, detail))


class NodeLinks:
    """Nodes 1..nnodes-1 of `config` (module docstring); none, and no thread, with one
    node. `store`: the group's TCP store; `host`: node 0's address the agents reach."""

    def __init__(self, config: EngineConfig, store: dist.Store, host: str) -> None:
        self.config = config
        self.members = [RemoteNode(r, config) for r in range(1, config.nnodes)]
        self.failure: RankFailed | None = None
        self.code_version = provenance.code_version()
        self._on_failure: Callable[[Exception], None] | None = None
        self._stopping = threading.Event()
        # Set while rank 0's main thread waits on `members`: only then are beats passed on
        # (they are its progress; unread, they would fill the pipes and block this thread).
        self._waiting = threading.Event()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._control = self._context.socket(zmq.ROUTER)
        self._steps: list[zmq.Socket[bytes]] = []
        self._thread = threading.Thread(target=self._watch, name="node-watch", daemon=True)
        if not self.members:
            return
        store.set(nm.CONFIG_KEY, msgspec.json.encode(config).decode())
        store.set(nm.CONTROL_KEY, self._bind(self._control, host))
        for member in self.members:
            sock = self._context.socket(zmq.PUSH)
            # A call a node does not take for SILENCE_S is that node's failure (`send`);
            # on close, what is queued (the `stop` call) still goes out for a while.
            sock.setsockopt(zmq.SNDTIMEO, int(nm.SILENCE_S * 1000))
            sock.setsockopt(zmq.LINGER, int(nm.SILENCE_S * 1000))
            store.set(nm.steps_key(member.node_rank), self._bind(sock, host))
            self._steps.append(sock)
        self._thread.start()

    @staticmethod
    def _bind(sock: zmq.Socket[bytes], host: str) -> str:
        """Listen at a free port of `host`'s address (only there: what crosses these links
        is every request's token ids); the address the agents connect to."""
        address = str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])
        if ":" in address:
            sock.setsockopt(zmq.IPV6, 1)
            address = f"[{address}]"
        port = sock.bind_to_random_port(f"tcp://{address}")
        return f"tcp://{address}:{port}"

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """While rank 0's main thread waits on `members` (module docstring)."""
        self._waiting.set()
        try:
            yield
        finally:
            self._waiting.clear()

    def watch(self, callback: Callable[[Exception], None]) -> None:
        """Call `callback(failure)` (from the watch thread) when a node fails after
        start-up."""
        self._on_failure = callback

    def check(self) -> None:
        """RankFailed if a node has failed."""
        if self.failure is not None:
            raise self.failure

    def send(self, frame: bytearray) -> None:
        """One call to every node's agent; RankFailed for one that does not take it."""
        for member, sock in zip(self.members, self._steps, strict=True):
            try:
                if len(frame) < ZERO_COPY_BYTES:
                    sock.send(frame)
                else:  # the frame is never written again: zmq may send it from where it is
                    sock.send(frame, copy=False)
            except zmq.Again as e:
                raise RankFailed(f"{member.describe()} has not taken a call for "
                                 f"{nm.SILENCE_S:.0f} s") from e

    def rank_entries(self) -> list[str]:
        return [entry for member in self.members for entry in member.rank_entries()]

    def node_entries(self) -> list[str]:
        return [member.describe() for member in self.members]

    def close(self) -> None:
        """Tell every node to stop (after the `stop` call went down its step socket), stop
        the watch thread and release the sockets."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        for sock in self._steps:
            sock.close()  # lingers until what is queued has gone out, or SILENCE_S
        self._control.close(linger=int(nm.SILENCE_S * 1000))
        self._context.term()
        for member in self.members:
            member.pipe.close()
            member.writer.close()

    # ---- the watch thread ----------------------------------------------------------------

    def _watch(self) -> None:
        try:
            self._watch_nodes()
        except Exception as e:  # noqa: BLE001 - the group fails with it, named
            log.exception("the node watch failed", extra={"event": "node_watch_failed"})
            for member in self.members:
                self._fail(member, f"node 0's watch of it failed: {e!r}")

    def _watch_nodes(self) -> None:
        next_beat = 0.0
        while not self._stopping.is_set():
            if self._control.poll(int(POLL_S * 1000)):
                identity, payload = self._control.recv_multipart()
                self._on_message(identity, nm.FROM_NODE.decode(payload))
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + nm.BEAT_S
                self._beat(now)
        for member in self.members:
            if member.hello is not None:
                self._send(member, nm.HeadStop())

    def _on_message(self, identity: bytes, message: nm.FromNode) -> None:
        member = next((m for m in self.members if nm.node_identity(m.node_rank) == identity),
                      None)
        if member is None or member.lost:
            log.warning("message from an unknown or lost node %r ignored", identity,
                        extra={"event": "node_message_ignored"})
            return
        member.last_heard = time.monotonic()
        if isinstance(message, nm.NodeHello):
            self._on_hello(member, message)
        elif isinstance(message, nm.NodeStatus):
            member.is_ready = member.is_ready or message.status == "ready"
            if message.status != "loading" or self._waiting.is_set():
                member.report(message.status, message.detail)
        elif isinstance(message, nm.NodeFailed):
            self._fail(member, message.error)

    def _on_hello(self, member: RemoteNode, hello: nm.NodeHello) -> None:
        member.hello = hello
        log.info("node %d joined from %s", member.node_rank, hello.host, extra={
            "event": "node_joined", "node_rank": member.node_rank, "host": hello.host,
            "ranks": [f"{r.rank}:{r.pid}:{r.device}" for r in hello.ranks]})
        if hello.code_version != self.code_version:
            self._fail(member, f"it runs specd code version {hello.code_version} (from "
                               f"{hello.source_root}), node 0 {self.code_version} (from "
                               f"{provenance.package_dirs()['specd']}): install the same "
                               "specd on every node")
        elif self._waiting.is_set():
            member.report("loading")  # a beat: it is alive

    def _beat(self, now: float) -> None:
        """Beat to every joined node; beat on behalf of one not joined yet (module
        docstring); fail one that has been silent for SILENCE_S."""
        for member in self.members:
            if member.lost:
                continue
            if member.hello is None:
                if self._waiting.is_set():
                    member.report("loading")
            elif now - member.last_heard > nm.SILENCE_S:
                self._fail(member, f"silent for {now - member.last_heard:.1f} s (killed, "
                                   "stopped or cut off from node 0)")
            else:
                self._send(member, nm.HeadBeat())

    def _send(self, member: RemoteNode, message: nm.ToNode) -> None:
        self._control.send_multipart([nm.node_identity(member.node_rank),
                                      nm.ENCODER.encode(message)])

    def _fail(self, member: RemoteNode, reason: str) -> None:
        member.lost = reason
        failure = RankFailed(f"{member.describe()} failed: {reason}")
        log.error("%s", failure, extra={"event": "node_failed", "node_rank": member.node_rank,
                                        "reason": reason})
        first = self.failure is None
        if first:
            # Before the writer closes: a start-up wait that the close ends reads `check()`
            # next, and must find the failure there.
            self.failure = failure
        member.writer.close()  # a start-up wait on it ends (exit_error says why)
        if first and member.is_ready and self._on_failure is not None:
            self._on_failure(failure)
