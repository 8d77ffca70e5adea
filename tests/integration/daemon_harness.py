"""Starts the real daemon (`python -m specd.daemon.main`: front + scheduler processes) for
integration tests, on the fixture model unless $SPECD_TEST_MODEL names another directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from specd.client import Client, DaemonUnavailable, SpecdError

START_TIMEOUT_S = 240.0


def model_under_test() -> str | None:
    """The model the daemon tests serve: None = the embedded fixture."""
    return os.environ.get("SPECD_TEST_MODEL") or None


class Daemon:
    """One `specd` process tree with JSON logs in `log_path`."""

    def __init__(self, tmp: Path, *args: str, socket_path: Path | None = None) -> None:
        self.socket_path = socket_path or tmp / "specd.sock"
        self.log_path = tmp / "specd.log"
        model = model_under_test()
        command = [sys.executable, "-P", "-m", "specd.daemon.main",
                   "--socket", str(self.socket_path), "--log-format", "json",
                   *(["--model", model] if model else []), *args]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in wait()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> Daemon:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"specd exited with {self.process.returncode}:\n"
                                   + self.log_path.read_text())
            try:
                with self.client() as client:
                    if client.status().state == "ready":
                        return self
            except (DaemonUnavailable, SpecdError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"specd not ready in {timeout} s:\n" + self.log_path.read_text())

    def client(self, timeout: float = 60.0) -> Client:
        return Client(self.socket_path, timeout=timeout)

    @property
    def scheduler_pid(self) -> int:
        with self.client() as client:
            return int(client.status().provenance["scheduler"]["pid"])

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def stop(self) -> None:
        """Kill whatever is left (tests that expect an exit call `wait` first)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self._log.close()

    def records(self) -> list[dict[str, Any]]:
        """The JSON log records so far (other lines, e.g. a child's stderr, skipped)."""
        records = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        return records

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("event") == name]
