"""The process entry of ranks 1..N-1: `python -P -m specd.workers.parallel.rank_main ...`
(launch.py starts it; never by hand).

Only what the control pipe needs is imported before the pipe is open: from its first second
the rank beats (`loading`, every HEARTBEAT_S, from a thread), through the import of torch
and the model code, joining the group and loading its shard (worker.py), until it reports
`ready` or `failed` with the traceback. A slow interpreter start on a loaded host is then
progress to rank 0's wait and to the scheduler's stage watch (stage_watch.py); a stopped
rank is silence; one that hangs while running is ended by rank 0's timeout.
"""

from __future__ import annotations

import argparse
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from specd.workers.config import EngineConfig
from specd.workers.process.parent import die_with_parent

HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class RankSpec:
    """What rank 0 tells a rank it starts: its rank, where the group's store listens, the
    engine config, and the host settings to copy (torch threads, log level)."""

    rank: int
    store_port: int
    config: EngineConfig
    num_threads: int
    log_level: str
    parent_pid: int

    def arguments(self) -> list[str]:
        """The command-line arguments `parse` reads back into this spec."""
        return ["--rank", str(self.rank), "--store-port", str(self.store_port),
                "--engine-config", msgspec.json.encode(self.config).decode(),
                "--num-threads", str(self.num_threads), "--log-level", self.log_level,
                "--parent-pid", str(self.parent_pid)]

    @staticmethod
    def parse(argv: list[str] | None) -> tuple[RankSpec, int]:
        """(the spec, the control pipe's descriptor) from `arguments()` + `--control-fd`."""
        parser = argparse.ArgumentParser(description="a specd tensor-parallel rank (started "
                                                     "by rank 0, never by hand)")
        parser.add_argument("--rank", type=int, required=True)
        parser.add_argument("--store-port", type=int, required=True)
        parser.add_argument("--engine-config", required=True, help="EngineConfig as JSON")
        parser.add_argument("--num-threads", type=int, required=True)
        parser.add_argument("--log-level", required=True)
        parser.add_argument("--parent-pid", type=int, required=True)
        parser.add_argument("--control-fd", type=int, required=True)
        args = parser.parse_args(argv)
        config = msgspec.json.decode(args.engine_config, type=EngineConfig)
        spec = RankSpec(args.rank, args.store_port, config, args.num_threads, args.log_level,
                        args.parent_pid)
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


def main(argv: list[str] | None = None) -> None:
    """Start rank `--rank` (module docstring), then serve rank 0's calls until `stop`."""
    spec, control_fd = RankSpec.parse(argv)
    # Killed with rank 0 even when stopped or inside a collective (prctl(2)).
    die_with_parent(spec.parent_pid)
    status = StatusPipe(Connection(control_fd))
    try:
        with status.beating():
            from specd.workers.parallel.worker import start_rank

            server = start_rank(spec, status)
    except BaseException:
        status.report("failed", traceback.format_exc())
        raise
    status.report("ready")
    server.serve(status.conn)


if __name__ == "__main__":
    main()
