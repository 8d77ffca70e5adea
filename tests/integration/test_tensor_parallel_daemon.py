"""The daemon at tensor-parallel size 2 on the CPU: it serves; SIGKILL of the worker rank
mid-stream gives every client an error frame (`scheduler_unavailable`) and ends specd with
exit 75 within 10 s, leaving no rank behind; SIGSTOP of it is caught by the hang watchdog.
`specctl doctor` lists the ranks and their devices, fails naming a stopped rank (without
trying a generation, which would wait for it), and reads the killed rank from the log the
failed run left (`--log`). A worker rank's records come out in rank 0's console format.

Over two "nodes" (specd --nnodes 2 and a `specd-worker` launch, gloo over 127.0.0.1):
status and doctor show both nodes and their ranks; node 1 killed or stopped mid-stream
ends every client with an error frame and specd with 75 within 10 s; specd killed leaves
no process of node 1 behind within 10 s."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from specd.daemon.ctl.common import EXIT_DOCTOR_PROBLEM
from specd.exit_codes import EXIT_SCHEDULER_FAILED
from specd.ipc import errors
from tests.integration.daemon_harness import Daemon
from tests.integration.test_daemon_failures import StreamInThread, _is_dead
from tests.integration.test_scheduler_watch import specctl
from tests.integration.test_tensor_parallel_nodes import free_port, start_worker

HANG_TIMEOUT_S = 5


@pytest.mark.slow  # a daemon whose scheduler starts a second rank and warms both: 10-40 s
def test_a_worker_rank_killed_mid_stream_fails_every_request_and_exits_75(
        tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, "--tensor-parallel-size", "2").wait_ready()
    try:
        (ready,) = daemon.events("tensor_parallel_ready")
        (worker_pid,) = ready["worker_pids"]
        ranks = [f"rank 0 pid {daemon.scheduler_pid} on cpu", f"rank 1 pid {worker_pid} on cpu"]
        with daemon.client() as client:  # specctl status shows the ranks
            assert client.status().resolved["ranks"] == ranks
        doctor = specctl(daemon, "doctor")  # (its install check depends on the checkout)
        assert f"\nok    ranks: {ranks[0]}: " in doctor.stdout
        assert f"; {ranks[1]}: sleeping\nok    generation: one token" in doctor.stdout
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
        doctor = specctl(daemon, "doctor", "--log", str(daemon.log_path))
        assert doctor.returncode == EXIT_DOCTOR_PROBLEM
        assert "FAIL  daemon:" in doctor.stdout
        assert (f"exit 75: scheduler failed in stage loop: RankFailed('rank 1 (pid {worker_pid} "
                f"on cpu) exited with code -9')") in doctor.stdout
        assert (f"; failed rank 1 (pid {worker_pid} on cpu); the run's ranks: {ranks[0]}, "
                f"{ranks[1]}\n") in doctor.stdout
    finally:
        daemon.stop()


@pytest.mark.slow  # as above
def test_a_stopped_worker_rank_is_caught_by_the_hang_watchdog(tmp_path: Path) -> None:
    """SIGSTOP of the worker rank: rank 0 waits inside a collective, no step completes, the
    front's hang watchdog kills the scheduler (exit 75, the client told `hung`), and the
    stopped rank dies with it (PR_SET_PDEATHSIG)."""
    # Start-up passes under it: the worker's loading beats reach rank 0 as progress.
    daemon = Daemon(tmp_path, "--tensor-parallel-size", "2", "--hang-timeout-s",
                    str(HANG_TIMEOUT_S)).wait_ready()
    try:
        (ready,) = daemon.events("tensor_parallel_ready")
        (worker_pid,) = ready["worker_pids"]
        os.kill(worker_pid, signal.SIGSTOP)  # idle: nothing waits for it yet
        doctor = specctl(daemon, "doctor")
        assert doctor.returncode == EXIT_DOCTOR_PROBLEM
        assert f"FAIL  ranks: failed: rank 1 pid {worker_pid} on cpu; " in doctor.stdout
        assert f"rank 1 is stopped: kill -CONT {worker_pid}" in doctor.stdout
        assert "FAIL  generation: not tried" in doctor.stdout
        os.kill(worker_pid, signal.SIGCONT)
        stream = StreamInThread(daemon)
        assert stream.first_delta.wait(60)
        stopped_at = time.monotonic()
        os.kill(worker_pid, signal.SIGSTOP)
        stream.join()
        assert isinstance(stream.error, errors.SchedulerUnavailable)
        assert "hung" in stream.error.message
        assert daemon.wait() == EXIT_SCHEDULER_FAILED
        assert time.monotonic() - stopped_at < HANG_TIMEOUT_S + 10.0
        deadline = time.monotonic() + 5
        while not _is_dead(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _is_dead(worker_pid)
    finally:
        daemon.stop()


@pytest.mark.slow  # as above
def test_a_worker_ranks_records_come_out_in_rank_zeros_console_format(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, "--tensor-parallel-size", "2", "--speculative-algorithm",
                    "none", "--log-format", "text").wait_ready()  # the last --log-format wins
    try:
        lines = daemon.log_path.read_text().splitlines()
        assert not [x for x in lines if x.startswith("{")], "a record in JSON on a text console"
        loaded = [x for x in lines if "event=rank_load_progress" in x]
        assert any(": rank 1 loaded " in x for x in loaded)  # the worker rank's own record
        assert any(": rank 0 loaded " in x for x in loaded)
    finally:
        daemon.stop()


def _two_node_daemon(tmp_path: Path) -> tuple[Daemon, subprocess.Popen[str], int]:
    """specd as node 0 (rank 0) and `specd-worker` as node 1 (rank 1), on 127.0.0.1; the
    daemon ready, and node 1's rank pid (from status)."""
    port = free_port()
    worker = start_worker(port)
    daemon = Daemon(tmp_path, "--tensor-parallel-size", "2", "--nnodes", "2",
                    "--dist-init-addr", f"127.0.0.1:{port}")
    try:
        daemon.wait_ready()
        with daemon.client() as client:
            resolved = client.status().resolved
    except BaseException:
        daemon.stop()
        worker.kill()
        raise
    host = socket.gethostname()
    rank1 = resolved["ranks"][1]
    assert resolved["ranks"][0] == f"rank 0 pid {daemon.scheduler_pid} on cpu"
    assert rank1.startswith("rank 1 pid ") and rank1.endswith(f" on cpu of node 1 ({host})")
    assert resolved["nodes"] == [f"node 0 ({host}: ranks 0-0)", f"node 1 ({host}: ranks 1-1)"]
    return daemon, worker, int(rank1.split(" pid ")[1].split()[0])


def _streams_end_with_an_error_and_specd_exits_75(daemon: Daemon, streams: list[StreamInThread],
                                                  since: float) -> None:
    for s in streams:
        s.join()
        assert isinstance(s.error, errors.SchedulerUnavailable)
        assert s.error_at - since < 10.0
    assert daemon.wait() == EXIT_SCHEDULER_FAILED
    assert time.monotonic() - since < 10.0


@pytest.mark.slow  # two launches, each with a rank to start and warm up
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_worker_node_lost_mid_stream_fails_every_request_and_exits_75(
        tmp_path: Path, how: signal.Signals) -> None:
    """Node 1's agent and rank killed (their sockets close: rank 0's collective fails) or
    stopped (they go silent: node 0's watch of node 1 ends the scheduler after 5 s)."""
    daemon, worker, rank1 = _two_node_daemon(tmp_path)
    try:
        doctor = specctl(daemon, "doctor")
        assert (f"; rank 1 pid {rank1} on cpu of node 1 ({socket.gethostname()}): on another "
                "node") in doctor.stdout
        streams = [StreamInThread(daemon) for _ in range(2)]
        for s in streams:
            assert s.first_delta.wait(60)
        lost_at = time.monotonic()
        for pid in (worker.pid, rank1):
            os.kill(pid, how)
        _streams_end_with_an_error_and_specd_exits_75(daemon, streams, lost_at)
        failed = daemon.events("scheduler_failed")
        assert any("RankFailed" in str(r) for r in failed), failed
    finally:
        daemon.stop()
        for pid in (worker.pid, rank1):
            if not _is_dead(pid):
                os.kill(pid, signal.SIGKILL)
        worker.wait()


@pytest.mark.slow  # as above
def test_a_worker_node_whose_head_is_killed_exits_by_itself(tmp_path: Path) -> None:
    """SIGKILL of specd (the front; its scheduler and ranks die with it) mid-stream: node 1's
    agent hears node 0 no more, stops its rank and exits 75 within 10 s."""
    daemon, worker, rank1 = _two_node_daemon(tmp_path)
    try:
        stream = StreamInThread(daemon)
        assert stream.first_delta.wait(60)
        killed_at = time.monotonic()
        daemon.signal(signal.SIGKILL)
        assert worker.wait(10) == EXIT_SCHEDULER_FAILED
        deadline = killed_at + 10
        while not _is_dead(rank1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _is_dead(rank1)
        assert time.monotonic() - killed_at < 10.0
        stream.join()
    finally:
        daemon.stop()
        worker.kill()
        worker.wait()
