"""The daemon at tensor-parallel size 2 on the CPU: it serves, and SIGKILL of one worker rank
mid-stream gives every client an error frame (`scheduler_unavailable`) and ends specd with
exit 75 within 10 s, leaving no rank behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from daemon_harness import Daemon
from test_daemon_failures import StreamInThread, _is_dead

from specd.exit_codes import EXIT_SCHEDULER_FAILED
from specd.ipc import errors


@pytest.mark.slow  # a daemon whose scheduler starts a second rank and warms both: ~40 s
def test_a_worker_rank_killed_mid_stream_fails_every_request_and_exits_75(
        tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, "--tensor-parallel-size", "2").wait_ready()
    try:
        (ready,) = daemon.events("tensor_parallel_ready")
        (worker_pid,) = ready["worker_pids"]
        streams = [StreamInThread(daemon) for _ in range(2)]
        for s in streams:
            assert s.first_delta.wait(60)
        killed_at = time.monotonic()
        os.kill(worker_pid, signal.SIGKILL)
        for s in streams:
            s.join()
            assert isinstance(s.error, errors.SchedulerUnavailable)
            assert s.error_at - killed_at < 10.0
        assert daemon.wait() == EXIT_SCHEDULER_FAILED
        assert time.monotonic() - killed_at < 10.0
        assert any("RankFailed" in str(r) for r in daemon.events("scheduler_failed"))
        assert _is_dead(worker_pid)
    finally:
        daemon.stop()
