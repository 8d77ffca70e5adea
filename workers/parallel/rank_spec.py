"""What a rank is told when it starts, and its end of the control pipe (rank_main.py is the
rank's entry; local_ranks.py starts it)."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from specd.workers.config import EngineConfig

HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class RankSpec:
    """What a rank is told by the process that starts it (rank 0, or a node agent): its
    rank and index on its node (its device), where the group's TCP store listens, the step
    ring's descriptor and its reader index there, the engine config, and the host settings
    to copy (torch threads, log level)."""

    rank: int
    local_rank: int
    store_addr: str  # HOST:PORT
    ring_fd: int
    reader: int
    config: EngineConfig
    num_threads: int
    log_level: str
    parent_pid: int

    def arguments(self) -> list[str]:
        """The command-line arguments `parse` reads back into this spec."""
        return ["--rank", str(self.rank), "--local-rank", str(self.local_rank),
                "--store", self.store_addr, "--ring-fd", str(self.ring_fd),
                "--reader", str(self.reader),
                "--engine-config", msgspec.json.encode(self.config).decode(),
                "--num-threads", str(self.num_threads), "--log-level", self.log_level,
                "--parent-pid", str(self.parent_pid)]

    @staticmethod
    def parse(argv: list[str] | None) -> tuple[RankSpec, int]:
        """(the spec, the control pipe's descriptor) from `arguments()` + `--control-fd`."""
        parser = argparse.ArgumentParser(description="a specd tensor-parallel rank (started "
                                                     "by rank 0 or a node agent, never by "
                                                     "hand)")
        for name in ("rank", "local-rank", "ring-fd", "reader", "num-threads", "parent-pid",
                     "control-fd"):
            parser.add_argument(f"--{name}", type=int, required=True)
        parser.add_argument("--store", required=True, help="HOST:PORT of the TCP store")
        parser.add_argument("--engine-config", required=True, help="EngineConfig as JSON")
        parser.add_argument("--log-level", required=True)
        args = parser.parse_args(argv)
        config = msgspec.json.decode(args.engine_config, type=EngineConfig)
        spec = RankSpec(args.rank, args.local_rank, args.store, args.ring_fd, args.reader,
                        config, args.num_threads, args.log_level, args.parent_pid)
        return spec, args.control_fd


class StatusPipe:
    """The rank's end of its control pipe: (status, detail) messages, sent from the main
    thread and the beat thread alike (a lock keeps each message whole)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def report(self, status: str, detail: str = "") -> None:
        with self._lock:
            self.conn.send((status, detail))

    @contextmanager
    def beating(self) -> Iterator[None]:
        """While the block runs, report `loading` every HEARTBEAT_S from a thread (stopped
        and joined before the block's end, so nothing is sent after it)."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                self.report("loading")

        thread = threading.Thread(target=beat, name="rank-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
