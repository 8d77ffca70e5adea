"""The load's heartbeat: sent while the load reads and fills memory (rank 0 reading its
workers' beats included), silent while it is stuck or spins."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from specd.ipc import messages as m
from specd.workers.parallel.driver import WorkerGroup
from specd.workers.parallel.launch import RankProcess
from specd.workers.process.io_threads import LinkIO
from specd.workers.process.stage_watch import StageWatch

SAMPLE_S = 0.1
STOP_AFTER_S = 3.5


class _Outbox:
    def __init__(self) -> None:
        self.messages: list[m.StartupStage] = []
        self.lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self.lock:
            self.messages.append(message)

    def count(self) -> int:
        with self.lock:
            return len(self.messages)


def test_heartbeats_follow_what_the_load_reads_and_fills_never_cpu_time_alone(
        tmp_path: Path) -> None:
    checkpoint = tmp_path / "weights.bin"
    checkpoint.write_bytes(os.urandom(2**20))
    outbox = _Outbox()
    with StageWatch(cast(LinkIO, outbox), "load", sample_s=SAMPLE_S):
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # a load: reads, and memory filled
            chunks = [checkpoint.read_bytes() for _ in range(4)]
            del chunks
        loading = outbox.count()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # a spin: CPU time and Python lines move
            sum(range(1000))
        spinning = outbox.count() - loading
        stuck = threading.Event()
        stuck.wait(1.5)  # one C call: no CPU, no reads, the same line
        silent = outbox.count() - loading - spinning
    assert loading >= 4  # nearly one per sample
    # Spinning or stuck for 1.5 s at 0.1 s samples: a watch that counted them would send
    # about 15 each. At most the sample that saw the reading end, and one more.
    assert spinning <= 2 and silent <= 1
    assert all(msg.stage == "load" and "MiB read" in msg.detail and "s CPU" in msg.detail
               for msg in outbox.messages)


# A worker rank that joined and loads for ever, beating as parallel/rank_spec.py does.
LOADING_RANK = ("import sys, time\n"
                "from multiprocessing.connection import Connection\n"
                "from specd.workers.parallel.rank_spec import StatusPipe\n"
                "conn = Connection(int(sys.argv[sys.argv.index('--control-fd') + 1]))\n"
                "conn.send(('joining', ''))\n"
                "with StatusPipe(conn).beating():\n"
                "    time.sleep(60)\n")


@pytest.mark.slow  # 5-15 s: in the second tier, to keep the README's command under 10 min
def test_rank_zero_waiting_for_a_loading_rank_moves_until_that_rank_is_stopped() -> None:
    """Rank 0's wait for its workers (WorkerGroup.wait_for) reads their beats: the watch
    sees progress while a worker loads, and silence once it is stopped (SIGSTOP)."""
    # The real constructor starts model workers: a group of this stand-in instead, started
    # as they are (a fresh interpreter with an inherited control pipe).
    rank1 = RankProcess(1, "cpu", [sys.executable, "-c", LOADING_RANK])
    group = WorkerGroup.__new__(WorkerGroup)
    group.processes = [rank1]
    outbox = _TimedOutbox()
    stopper = threading.Timer(STOP_AFTER_S, os.kill, (rank1.pid, signal.SIGSTOP))
    try:
        group.wait_for("joining", 60.0)  # its interpreter imports torch first
        stop_at = time.monotonic() + STOP_AFTER_S
        stopper.start()
        with StageWatch(cast(LinkIO, outbox), "load"), \
                pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+ on cpu\) not ready"):
            group.wait_for("ready", STOP_AFTER_S + 5.0)
        timed_out_at = time.monotonic()
    finally:
        stopper.cancel()
        rank1.kill()
        rank1.join(10)
        rank1.close()
    loading = [t for t in outbox.times if t < stop_at]
    # A beat sent just before the stop is read and seen up to a sample later; the raise at
    # the deadline is movement again.
    stopped = [t for t in outbox.times if stop_at + 2.0 < t < timed_out_at - 0.5]
    assert len(loading) >= 2  # a beat a second, each read: moved
    assert stopped == [], str([round(t - stop_at, 2) for t in outbox.times])


class _TimedOutbox:
    def __init__(self) -> None:
        self.times: list[float] = []

    def send(self, message: Any) -> None:
        self.times.append(time.monotonic())
