"""A removed socket file, as the operator sees it: the daemon's own is bound again within a
second or two (new clients connect, one `socket_recreated` record); systemd's (socket
activation) is reported (one `socket_missing` record, `/health` 503 `unreachable`, a
problem in status) instead of passing for a daemon that is not there."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from specd.client import Client
from specd.workers.config import FIXTURE_DIR
from tests.integration.daemon_harness import Daemon


def _wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.1)


def _health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_removed_socket_file_of_its_own_is_bound_again(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, "--speculative-algorithm", "none").wait_ready()
    try:
        with daemon.client() as before:
            daemon.socket_path.unlink()
            _wait_for(daemon.socket_path.exists)
            with daemon.client() as after:  # a new client reaches the daemon again
                assert after.status().state == "ready"
            assert before.status().state == "ready"  # and the old connection was kept
        (record,) = daemon.events("socket_recreated")
        assert record["level"] == "warning" and record["path"] == str(daemon.socket_path)
        assert not daemon.events("socket_missing")
    finally:
        daemon.stop()


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None,
                    reason="systemd-socket-activate not installed (Debian package: systemd)")
def test_a_removed_socket_file_of_systemds_is_an_error_and_fails_the_health_check(
        tmp_path: Path) -> None:
    listen = tmp_path / "activated.sock"
    log_path = tmp_path / "specd.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    command = ["systemd-socket-activate", "-l", str(listen), "--fdname", "specd",
               *(f"-E{k}={v}" for k, v in env.items() if k in ("PYTHONPATH", "HOME",
                                                               "SPECD_DEFAULT_MODEL")),
               sys.executable, "-P", "-m", "specd.daemon.main", "--log-format", "json",
               "--model", str(FIXTURE_DIR), "--speculative-algorithm", "none",
               "--http", "127.0.0.1:0"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_for(listen.exists)
        with Client(listen, timeout=240) as client:  # the connection starts specd
            _wait_for(lambda: client.status().state == "ready", timeout=240)
            records = [json.loads(x) for x in log_path.read_text().splitlines()
                       if x.startswith("{")]
            (http,) = [r for r in records if r.get("event") == "http_listening"]
            health = f"http://{http['host']}:{http['port']}/health"
            assert _health(health) == (200, '{"status":"ready"}')
            listen.unlink()
            _wait_for(lambda: _health(health)[0] == 503)
            assert _health(health) == (503, '{"status":"unreachable"}')
            status = client.status()  # the connection made before still works
            assert status.state == "unreachable"
            assert status.problems["socket_missing"].startswith(
                f"1 since start; last: the socket file {listen} was removed")
        assert not listen.exists()  # not re-created at a path systemd owns
        records = [json.loads(x) for x in log_path.read_text().splitlines()
                   if x.startswith("{")]
        (missing,) = [r for r in records if r.get("event") == "socket_missing"]
        assert missing["level"] == "error"
        assert "restart specd.socket and specd" in missing["msg"]
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
