"""Failure and shutdown paths of the real daemon: a killed or hung scheduler, SIGTERM drain,
drain timeout, start-up failures, and the exit-code contract (0 / 75 / 78)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from specd.client import SpecdError
from specd.exit_codes import EXIT_CONFIG, EXIT_OK, EXIT_SCHEDULER_FAILED
from specd.ipc import errors
from specd.workers.config import FIXTURE_DIR
from tests.integration.daemon_harness import Daemon


class StreamInThread:
    """Streams one request on its own connection; records the error and when it came."""

    def __init__(self, daemon: Daemon, max_tokens: int = 5000) -> None:
        self.error: SpecdError | None = None
        self.error_at = 0.0
        self.finish_reason: str | None = None
        self.num_deltas = 0
        self.first_delta = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(daemon, max_tokens))
        self._thread.start()

    def _run(self, daemon: Daemon, max_tokens: int) -> None:
        try:
            with daemon.client() as client:
                stream = client.stream("def main():\n", max_tokens=max_tokens, ignore_eos=True)
                for _ in stream:
                    self.num_deltas += 1
                    self.first_delta.set()
                self.finish_reason = stream.result.finish_reason if stream.result else None
        except SpecdError as exc:
            self.error = exc
            self.error_at = time.monotonic()
        finally:
            self.first_delta.set()

    def join(self, timeout: float = 60) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive()


def test_scheduler_killed_mid_stream(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path).wait_ready()
    try:
        streams = [StreamInThread(daemon) for _ in range(3)]
        for s in streams:
            assert s.first_delta.wait(60)
        pid = daemon.scheduler_pid
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for s in streams:
            s.join()
            assert isinstance(s.error, errors.SchedulerUnavailable)
            assert "SIGKILL" in s.error.message
            assert s.error_at - killed_at < 1.0
        assert daemon.wait() == EXIT_SCHEDULER_FAILED
        (record,) = daemon.events("scheduler_failed")
        assert record["level"] == "error" and "SIGKILL" in record["msg"]
        assert record["open_requests"] == 3
    finally:
        daemon.stop()


def _is_dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (a container's pid 1 may not reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_after_kill_9_of_the_front_its_scheduler_dies_and_the_next_start_cleans_up(
        tmp_path: Path) -> None:
    daemon = Daemon(tmp_path).wait_ready()
    try:
        scheduler_pid = daemon.scheduler_pid
        daemon.signal(signal.SIGKILL)
        daemon.wait()
        deadline = time.monotonic() + 5
        while not _is_dead(scheduler_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _is_dead(scheduler_pid)
    finally:
        daemon.stop()
    (stale,) = tmp_path.glob("link-*")  # nothing ran to remove it
    successor = Daemon(tmp_path).wait_ready()
    try:
        assert not stale.exists()
        (record,) = successor.events("stale_link_removed")
        assert record["path"] == str(stale)
        (own,) = tmp_path.glob("link-*")
        assert own.name.startswith(f"link-{successor.process.pid}-")
    finally:
        successor.stop()


def test_hung_scheduler_is_detected_dumped_and_killed(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, "--hang-timeout-s", "1.5").wait_ready()
    try:
        scheduler_pid = daemon.scheduler_pid
        stream = StreamInThread(daemon)
        assert stream.first_delta.wait(60)
        os.kill(scheduler_pid, signal.SIGSTOP)  # no progress from now on
        stream.join()
        assert isinstance(stream.error, errors.SchedulerUnavailable)
        assert "hung" in stream.error.message
        assert daemon.wait() == EXIT_SCHEDULER_FAILED
        (record,) = daemon.events("scheduler_failed")
        assert "no progress" in record["msg"] and record["scheduler_traceback"]
        with pytest.raises(ProcessLookupError):
            os.kill(scheduler_pid, 0)
    finally:
        daemon.stop()


def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path).wait_ready()
    try:
        streams = [StreamInThread(daemon, max_tokens=40) for _ in range(2)]
        for s in streams:
            assert s.first_delta.wait(60)
        daemon.signal(signal.SIGTERM)
        time.sleep(0.2)
        with daemon.client() as client, pytest.raises(errors.ShuttingDown):
            client.generate("x", max_tokens=2)
        for s in streams:
            s.join()
            assert s.error is None and s.finish_reason == "length"
        assert daemon.wait() == EXIT_OK
        assert daemon.events("drain") and daemon.events("stopped")
        assert not daemon.socket_path.exists()
    finally:
        daemon.stop()


def test_drain_timeout_ends_the_rest_with_an_error(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path).wait_ready()
    try:
        stream = StreamInThread(daemon, max_tokens=100_000)
        assert stream.first_delta.wait(60)
        with daemon.client() as client:
            client.drain(timeout_s=0.5)
        stream.join()
        assert isinstance(stream.error, errors.Drained)
        assert daemon.wait() == EXIT_OK
    finally:
        daemon.stop()


def test_model_that_cannot_load_exits_78_naming_the_stage(tmp_path: Path) -> None:
    model = tmp_path / "broken-model"
    model.mkdir()
    # A tokenizer and a configuration (which the front checks), but no weights.
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(FIXTURE_DIR / name, model / name)
    daemon = Daemon(tmp_path, "--model", str(model))
    try:
        assert daemon.wait(240) == EXIT_CONFIG
        (record,) = daemon.events("scheduler_failed")
        assert "stage load" in record["msg"]
        assert "model.safetensors" in record["scheduler_traceback"]
    finally:
        daemon.stop()


def test_bad_configuration_exits_78(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, "--model", str(tmp_path / "no-such-model"))
    try:
        assert daemon.wait(60) == EXIT_CONFIG
        assert daemon.events("config_error")
    finally:
        daemon.stop()
