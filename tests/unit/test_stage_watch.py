"""The load's heartbeat: sent while the main thread moves, silent while it is stuck."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

from specd.ipc import messages as m
from specd.workers.io_threads import LinkIO
from specd.workers.stage_watch import StageWatch

SAMPLE_S = 0.1


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


def test_heartbeats_follow_the_main_threads_work_and_stop_when_it_is_stuck() -> None:
    outbox = _Outbox()
    with StageWatch(cast(LinkIO, outbox), "load", sample_s=SAMPLE_S):
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # work: CPU time and Python lines move
            sum(range(1000))
        working = outbox.count()
        stuck = threading.Event()
        stuck.wait(1.5)  # one C call: no CPU, no reads, the same line
        silent = outbox.count() - working
    assert working >= 5  # nearly one per sample (a sample may fall between clock ticks)
    assert silent <= 1  # at most the sample that saw the work end
    assert all(msg.stage == "load" and "s CPU" in msg.detail for msg in outbox.messages)
