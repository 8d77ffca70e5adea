"""`specctl doctor`'s rank checks (daemon/ctl/doctor_ranks.py).

The live check reads real processes: this test process stands for rank 0 and a `sleep`
child for rank 1, stopped, killed and reaped in turn. The log check reads records in the
front's JSON format (specd/logs.py); the records a real tensor-parallel daemon leaves are
checked in tests/integration/test_tensor_parallel_daemon.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specd.daemon.ctl.doctor_ranks import (
    check_last_failure,
    check_ranks,
    read_records,
)
from specd.ipc.messages import StatusReply


def _status(ranks: list[str]) -> StatusReply:
    return StatusReply(id=1, state="ready", protocol=1, version="0", uptime_s=1.0, model="m",
                       num_open_requests=0, num_connections=1,
                       resolved={"ranks": ranks} if ranks else {}, engine={}, provenance={},
                       config={})


@pytest.fixture()
def rank1() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait()


def _wait_state(pid: int, code: str) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rindex(")") + 2] == code:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} not in state {code}")


def test_one_process_has_no_ranks_to_check() -> None:
    assert check_ranks(_status([])) is None


def test_running_ranks_are_listed_with_their_devices(rank1: subprocess.Popen[bytes]) -> None:
    _wait_state(rank1.pid, "S")  # `sleep` asleep in nanosleep
    entries = [f"rank 0 pid {os.getpid()} on cuda:0", f"rank 1 pid {rank1.pid} on cuda:1"]
    result = check_ranks(_status(entries))
    assert result is not None and result.ok
    assert result.detail.startswith(f"rank 0 pid {os.getpid()} on cuda:0: running; "
                                    f"rank 1 pid {rank1.pid} on cuda:1: sleeping")


def test_a_stopped_rank_fails_naming_it_and_how_to_resume_it(
        rank1: subprocess.Popen[bytes]) -> None:
    os.kill(rank1.pid, signal.SIGSTOP)
    _wait_state(rank1.pid, "T")
    entries = [f"rank 0 pid {os.getpid()} on cuda:0", f"rank 1 pid {rank1.pid} on cuda:1"]
    result = check_ranks(_status(entries))
    assert result is not None and not result.ok
    assert result.detail.startswith(f"failed: rank 1 pid {rank1.pid} on cuda:1; ")
    assert f"rank 1 is stopped: kill -CONT {rank1.pid}" in result.advice


def test_an_exited_rank_fails_naming_it_before_and_after_it_is_reaped(
        rank1: subprocess.Popen[bytes]) -> None:
    entries = [f"rank 0 pid {os.getpid()} on cpu", f"rank 1 pid {rank1.pid} on cpu"]
    rank1.kill()
    _wait_state(rank1.pid, "Z")  # its parent (this process) has not waited for it yet
    zombie = check_ranks(_status(entries))
    rank1.wait()
    gone = check_ranks(_status(entries))
    for result, state in ((zombie, "a zombie"), (gone, "gone")):
        assert result is not None and not result.ok
        assert f"failed: rank 1 pid {rank1.pid} on cpu; " in result.detail
        assert f"rank 1 pid {rank1.pid} on cpu: {state}" in result.detail
        assert "rank 1 has exited: the next step fails the daemon (exit 75)" in result.advice


def test_ranks_of_other_nodes_are_listed_as_watched_by_node_zero(
        rank1: subprocess.Popen[bytes]) -> None:
    """Their pids are another host's: no /proc state is read for them (here pid 1 would be
    this machine's init), nothing fails because of them."""
    _wait_state(rank1.pid, "S")
    entries = [f"rank 0 pid {os.getpid()} on cuda:0", f"rank 1 pid {rank1.pid} on cuda:1",
               "rank 2 pid 1 on cuda:0 of node 1 (gpu-b)"]
    result = check_ranks(_status(entries))
    assert result is not None and result.ok
    assert result.detail.endswith(
        f"rank 1 pid {rank1.pid} on cuda:1: sleeping; rank 2 pid 1 on cuda:0 of node 1 "
        "(gpu-b): on another node (node 0 watches it; silent for 5 s fails the daemon)")


def test_ranks_invisible_from_here_are_listed_without_states() -> None:
    # pid_max caps real pids far below this one: rank 0 cannot be seen, so neither can rank 1
    entries = ["rank 0 pid 2000000000 on cuda:0", "rank 1 pid 2000000001 on cuda:1"]
    result = check_ranks(_status(entries))
    assert result is not None and result.ok
    assert "not visible from here" in result.detail


def _record(event: str, pid: int, ts: float, msg: str, **fields: Any) -> str:
    return json.dumps({"ts": ts, "level": "info", "logger": "specd.front", "pid": pid,
                       "msg": msg, "event": event, **fields})


RANKS = ["rank 0 pid 200 on cuda:0", "rank 1 pid 201 on cuda:1"]
FAILED = ("scheduler failed in stage loop: RankFailed('rank 1 (pid 201 on cuda:1) exited "
          "with code -9')")


def test_the_last_failure_names_the_failed_rank_and_its_runs_ranks() -> None:
    lines = [
        "not a record: a child's stderr",
        _record("ready", 100, 1.0, "scheduler ready", resolved={"ranks": RANKS}),
        _record("scheduler_failed", 100, 2.0, FAILED, exit_code=75, scheduler_traceback="..."),
    ]
    result = check_last_failure(read_records(lines))
    assert not result.ok
    assert "front pid 100, exit 75: " + FAILED in result.detail
    assert result.detail.endswith("; failed rank 1 (pid 201 on cuda:1); the run's ranks: "
                                  "rank 0 pid 200 on cuda:0, rank 1 pid 201 on cuda:1")


def test_a_hang_names_no_rank_and_a_later_ready_run_passes() -> None:
    hang = _record("scheduler_failed", 100, 2.0, "scheduler hung: no step in 5 s", exit_code=75,
                   scheduler_traceback="Thread 0x1 (most recent call first): all_reduce")
    ready = _record("ready", 100, 1.0, "scheduler ready", resolved={"ranks": RANKS})
    failed = check_last_failure(read_records([ready, hang]))
    assert not failed.ok
    assert "; the record names no failed rank; the run's ranks: rank 0 pid 200" in failed.detail
    restarted = check_last_failure(read_records([ready, hang, _record(
        "ready", 300, 9.0, "scheduler ready", resolved={"ranks": RANKS})]))
    assert restarted.ok and restarted.detail.startswith("a run since got ready")


def test_a_failure_while_loading_names_the_rank_from_the_record_alone() -> None:
    record = _record("scheduler_failed", 100, 2.0, "scheduler failed in stage load: "
                     "RuntimeError('rank 1 (pid 201 on cpu) exited with code 1 before it was "
                     "ready')", exit_code=70)
    result = check_last_failure(read_records([record]))
    assert not result.ok and result.detail.endswith("; failed rank 1 (pid 201 on cpu)")


def test_a_log_without_json_records_fails_saying_what_to_pass() -> None:
    result = check_last_failure(read_records(["12:00:01.000 info specd.front: ready"]))
    assert not result.ok and "--log-format json" in result.advice
    assert check_last_failure(read_records([_record("ready", 1, 1.0, "ready")])).ok
