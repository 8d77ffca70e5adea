"""`specd-worker`: the ranks of one node other than node 0.

    specd-worker --nnodes N --node-rank R --dist-init-addr HOST:PORT

The agent connects to node 0's TCP store at HOST:PORT (waiting up to `--join-timeout-s`
for node 0 to be up), reads the engine config node 0 published there (every node runs the
same model, dtype, sizes; its own node rank), connects its control link and step socket
(node_messages.py, nodes.py) and starts ranks R * N/nnodes .. (R + 1) * N/nnodes - 1 as
fresh interpreters (local_ranks.py) on its devices (`--device` of node 0: cuda is cuda:0,
and so on). It says hello, passes their start-up statuses on to node 0 (a beat a second at
most while they load), and once they are ready relays every call node 0 sends into this
node's step ring (a thread), beating to node 0 every BEAT_S.

It exits 0 once its ranks stopped on node 0's `stop` (node 0 stopped or restarts: the
service manager starts the agent again, to wait for the next run); 75 when one of its
ranks dies (node 0 is told first, and fails) or node 0 has been silent for SILENCE_S (node
0 died, hung or is cut off: no rank is left waiting in a collective); 78 when its command
line or node 0's config cannot serve (another `--nnodes`, a bad address).
"""

from __future__ import annotations

import argparse
import logging
import queue
import socket
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import wait

import msgspec
import torch.distributed as dist
import zmq

from specd import provenance
from specd.exit_codes import EXIT_CONFIG, EXIT_OK, EXIT_SCHEDULER_FAILED
from specd.logs import log_event, setup_logging
from specd.workers.config import EngineConfig, parse_host_port
from specd.workers.parallel import node_messages as nm
from specd.workers.parallel.context import COLLECTIVE_TIMEOUT
from specd.workers.parallel.local_ranks import STOP_TIMEOUT_S, WorkerGroup
from specd.workers.parallel.peers import RankFailed

log = logging.getLogger("specd.worker")

POLL_S = 0.1
JOIN_TIMEOUT_S = 600.0
RELAY_JOIN_S = 1.0


class NodeLink:
    """The agent's control link to node 0: a thread owns the DEALER socket (hello, beats,
    statuses queued by the main thread, node 0's beats and stop)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], address: str,
                 node_rank: int) -> None:
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, nm.node_identity(node_rank))
        self.sock.setsockopt(zmq.LINGER, int(nm.SILENCE_S * 1000))
        if address.startswith("tcp://["):
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.connect(address)
        self.outbox: queue.Queue[nm.FromNode] = queue.Queue()
        self.stopped = threading.Event()  # node 0 said stop
        self.lost = threading.Event()  # node 0 has been silent for SILENCE_S
        self.done = threading.Event()
        self.last_heard = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="node-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Send what is queued, stop the thread, close the socket: lingering up to SILENCE_S
        for what is queued to go out, or not at all once node 0 is lost (nothing reaches
        it, and the agent must be gone soon after its node 0)."""
        self.done.set()
        self._thread.join()
        self.sock.close(linger=0 if self.lost.is_set() else None)

    def _run(self) -> None:
        try:
            self._beat_and_listen()
        except Exception:  # noqa: BLE001 - reported; the agent then stops its ranks
            log.exception("the link to node 0 failed", extra={"event": "node_link_failed"})
            self.lost.set()

    def _beat_and_listen(self) -> None:
        next_beat = 0.0
        while not self.done.is_set():
            if self.sock.poll(int(POLL_S * 1000)):
                message = nm.TO_NODE.decode(self.sock.recv())
                self.last_heard = time.monotonic()
                if isinstance(message, nm.HeadStop):
                    self.stopped.set()
            self._flush()
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + nm.BEAT_S
                self.sock.send(nm.ENCODER.encode(nm.NodeBeat()))
            if now - self.last_heard > nm.SILENCE_S and not self.lost.is_set():
                self.lost.set()
        self._flush()

    def _flush(self) -> None:
        while True:
            try:
                message = self.outbox.get_nowait()
            except queue.Empty:
                return
            self.sock.send(nm.ENCODER.encode(message))


class NodeAgent:
    """One node's agent (module docstring); `run` returns the exit code."""

    def __init__(self, nnodes: int, node_rank: int, dist_init_addr: str,
                 join_timeout_s: float) -> None:
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.dist_init_addr = dist_init_addr
        self.join_timeout_s = join_timeout_s
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.relay_error: BaseException | None = None
        self._last_relayed_beat = 0.0

    def run(self) -> int:
        try:
            config, store = self._join()
        except ValueError as e:
            log_event(log, logging.ERROR, "worker_config", f"specd-worker cannot serve: {e}")
            return EXIT_CONFIG
        except dist.DistError as e:  # node 0 not up in time: restart and wait again
            log_event(log, logging.ERROR, "worker_unjoined",
                      f"node 0 not reachable at {self.dist_init_addr} within "
                      f"{self.join_timeout_s:g} s: {e}")
            return EXIT_SCHEDULER_FAILED
        steps = self.context.socket(zmq.PULL)
        link = NodeLink(self.context, store.get(nm.CONTROL_KEY).decode(), self.node_rank)
        steps.connect(store.get(nm.steps_key(self.node_rank)).decode())
        first = self.node_rank * config.ranks_per_node
        ranks = WorkerGroup(config, range(first, first + config.ranks_per_node),
                            config.dist_init_addr or "")
        link.outbox.put(nm.NodeHello(
            self.node_rank, socket.gethostname(), provenance.code_version(),
            str(provenance.package_dirs()["specd"]),
            [nm.RankEntry(p.rank, p.pid, p.device) for p in ranks.processes]))
        link.start()
        try:
            return self._serve(ranks, link, steps)
        finally:
            link.close()
            steps.close(linger=0)
            self.context.term()

    def _join(self) -> tuple[EngineConfig, dist.TCPStore]:
        """Node 0's store and engine config (this node's rank in it); ValueError when the
        two cannot work together."""
        host, port = parse_host_port(self.dist_init_addr)
        log_event(log, logging.INFO, "worker_joining",
                  f"node {self.node_rank} joining node 0 at {self.dist_init_addr}")
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=timedelta(seconds=self.join_timeout_s))
        config = msgspec.json.decode(store.get(nm.CONFIG_KEY), type=EngineConfig)
        if config.nnodes != self.nnodes:
            raise ValueError(f"node 0 runs --nnodes {config.nnodes}, this node was started "
                             f"with --nnodes {self.nnodes}")
        return replace(config, node_rank=self.node_rank), store

    def _serve(self, ranks: WorkerGroup, link: NodeLink, steps: zmq.Socket[bytes]) -> int:
        try:
            ranks.wait_for("joining", COLLECTIVE_TIMEOUT.total_seconds(),
                           lambda: self._relay_beat(link))
            link.outbox.put(nm.NodeStatus("joining"))
            ranks.wait_for("ready", COLLECTIVE_TIMEOUT.total_seconds(),
                           lambda: self._relay_beat(link))
        except RuntimeError as e:
            link.outbox.put(nm.NodeStatus("failed", str(e)))
            log_event(log, logging.ERROR, "worker_failed", f"node {self.node_rank}: {e}")
            ranks.abort()
            return EXIT_SCHEDULER_FAILED
        link.outbox.put(nm.NodeStatus("ready"))
        relay = threading.Thread(target=self._relay, args=(steps, ranks, link), name="relay",
                                 daemon=True)
        relay.start()
        try:
            return self._watch(ranks, link)
        finally:
            # The relay ends within POLL_S once the link is done (or its ring write raises,
            # the ranks gone); only then may the step socket close under it.
            link.done.set()
            relay.join(RELAY_JOIN_S)

    def _relay_beat(self, link: NodeLink) -> None:
        """One `loading` to node 0 a second at most, whichever rank beat."""
        now = time.monotonic()
        if now - self._last_relayed_beat >= nm.BEAT_S:
            self._last_relayed_beat = now
            link.outbox.put(nm.NodeStatus("loading"))

    def _relay(self, steps: zmq.Socket[bytes], ranks: WorkerGroup, link: NodeLink) -> None:
        """Every call from node 0 into the ring, until the link is done."""
        try:
            while not link.done.is_set():
                if steps.poll(int(POLL_S * 1000)):
                    ranks.write(steps.recv(copy=False).buffer)
        except BaseException as e:  # noqa: BLE001 - logged here; the watch loop then exits
            log.exception("relaying node 0's calls failed", extra={"event": "relay_failed"})
            self.relay_error = e

    def _watch(self, ranks: WorkerGroup, link: NodeLink) -> int:
        """Until the ranks stop, one dies, or node 0 is lost."""
        while True:
            wait([p.sentinel for p in ranks.processes], POLL_S * 5)
            gone = ranks.first_exited()
            if gone is not None and gone.exitcode == 0:  # the `stop` call: all stop
                ranks.join(STOP_TIMEOUT_S)
                log_event(log, logging.INFO, "worker_stopped",
                          f"node {self.node_rank}: ranks stopped")
                return EXIT_OK
            if gone is not None:
                try:
                    ranks.check_alive()
                except RankFailed as failed:  # names the rank, its exit code and error
                    return self._fail(ranks, link, str(failed))
            if self.relay_error is not None:
                return self._fail(ranks, link, f"relaying calls failed: {self.relay_error!r}")
            if link.stopped.is_set():  # after the `stop` call: they are stopping
                ranks.join(STOP_TIMEOUT_S)
                log_event(log, logging.INFO, "worker_stopped",
                          f"node {self.node_rank}: node 0 stopped its ranks")
                return EXIT_OK
            if link.lost.is_set():
                return self._fail(ranks, link, f"node 0 silent for {nm.SILENCE_S:.0f} s "
                                               "(gone, hung or cut off)", tell=False)

    def _fail(self, ranks: WorkerGroup, link: NodeLink, error: str, tell: bool = True) -> int:
        log_event(log, logging.ERROR, "worker_failed", f"node {self.node_rank}: {error}")
        if tell:
            link.outbox.put(nm.NodeFailed(f"{error}"))
        ranks.kill()
        ranks.join(STOP_TIMEOUT_S)
        return EXIT_SCHEDULER_FAILED


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="specd-worker", description="Run one node's tensor-parallel ranks of a specd "
        "deployment over several nodes (node 0 runs specd itself).")
    parser.add_argument("--nnodes", type=int, required=True, help="nodes in the deployment")
    parser.add_argument("--node-rank", type=int, required=True,
                        help="this node's index, 1..nnodes-1 (node 0 runs specd)")
    parser.add_argument("--dist-init-addr", required=True, metavar="HOST:PORT",
                        help="node 0's --dist-init-addr")
    parser.add_argument("--join-timeout-s", type=float, default=JOIN_TIMEOUT_S,
                        help="how long to wait for node 0 to be up [default: %(default)s]")
    parser.add_argument("--log-format", default="json", choices=("json", "text"))
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    if not 1 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [1, {args.nnodes}) (node 0 runs specd)")
    agent = NodeAgent(args.nnodes, args.node_rank, args.dist_init_addr, args.join_timeout_s)
    sys.exit(agent.run())


if __name__ == "__main__":
    main()
