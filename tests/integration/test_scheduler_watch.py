"""A scheduler that stops answering while idle, as the operator sees it: `specctl status`
says `unresponsive` and names the stopped process, `specctl doctor` fails saying what to
do, and after the hang timeout the daemon exits 75 with one record naming the cause. A
model load that stops progressing fails the same way, its stacks in the record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from specd import provenance
from specd.daemon.ctl.common import EXIT_DOCTOR_PROBLEM
from specd.exit_codes import EXIT_SCHEDULER_FAILED
from tests.integration.daemon_harness import Daemon
from tests.integration.test_startup_faults import plant_in_scheduler

HANG_TIMEOUT_S = 4.0


def specctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specd.daemon.ctl", "--socket",
                           str(daemon.socket_path), *args],
                          capture_output=True, text=True, timeout=60)


def _health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.mark.slow  # idles past the hang timeout, then waits for it again (~30 s)
def test_an_idle_scheduler_that_stops_answering_is_named_then_fails_the_daemon(
        tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, "--hang-timeout-s", str(HANG_TIMEOUT_S),
                    "--http", "127.0.0.1:0").wait_ready()
    try:
        pid = daemon.scheduler_pid
        (listening,) = daemon.events("http_listening")
        health_url = f"http://{listening['host']}:{listening['port']}/health"
        # Idle past the hang timeout: the probes are answered, nothing fails.
        time.sleep(HANG_TIMEOUT_S + 1)
        healthy = specctl(daemon, "status")
        assert healthy.returncode == 0
        lines = healthy.stdout.splitlines()
        assert "state        ready" in lines and "fallbacks    none" in lines
        assert _health(health_url) == (200, '{"status":"ready"}')
        # Which code runs, from where, editable or not, at which commit (as the front
        # found them at start: others may edit this tree while the test runs).
        front = json.loads(specctl(daemon, "status", "--json").stdout)["provenance"]["front"]
        assert front["root"] == str(provenance.package_dirs()["specd"])
        assert (f"code         {front['code_version']} over {front['num_source_files']} "
                "files, scheduler the same") in lines
        commit = front["git"]["sha"][:12] if front["git"] else ""
        assert any(line.startswith("install      ") and front["root"] in line
                   and ("editable" if front["install"].get("editable") else "") in line
                   and commit in line for line in lines)

        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        status = specctl(daemon, "status")
        assert status.returncode == 0
        assert "state        unresponsive" in status.stdout.splitlines()
        (line,) = [x for x in status.stdout.splitlines() if x.startswith("scheduler    ")]
        assert "the scheduler did not answer" in line
        assert f"process {pid} is stopped (state T" in line
        assert "batch" not in status.stdout  # no `?` figures standing in for the cause

        assert _health(health_url) == (503, '{"status":"unresponsive"}')
        doctor = specctl(daemon, "doctor")
        assert doctor.returncode == EXIT_DOCTOR_PROBLEM
        assert "FAIL  daemon: state unresponsive" in doctor.stdout
        assert f"kill -CONT {pid}" in doctor.stdout
        assert "fallbacks:" not in doctor.stdout  # unknown while it does not answer

        assert daemon.wait(60) == EXIT_SCHEDULER_FAILED
        assert time.monotonic() - started < HANG_TIMEOUT_S + 10
        (record,) = daemon.events("scheduler_failed")
        assert "no answer" in record["msg"] and "while idle" in record["msg"]
        assert f"process {pid} is stopped" in record["msg"]
    finally:
        daemon.stop()


def test_a_load_that_stops_progressing_dumps_the_stacks_and_exits_75(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The load blocks on a lock nobody releases: no CPU, no reads, the same Python line.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""\
        import sys
        if "specd.workers.process.scheduler_process" in sys.orig_argv:
            import threading

            import specd.workers.engine.core as engine

            def planted_deadlock(self, config):
                lock = threading.Lock()
                lock.acquire()
                lock.acquire()

            engine.EngineCore.__init__ = planted_deadlock
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    daemon = Daemon(tmp_path, "--hang-timeout-s", "3")
    try:
        assert daemon.wait(120) == EXIT_SCHEDULER_FAILED
        (record,) = daemon.events("scheduler_failed")
        assert "no progress for" in record["msg"] and "in stage load" in record["msg"]
        assert "planted_deadlock" in record["scheduler_traceback"]  # faulthandler's dump
    finally:
        daemon.stop()


@pytest.mark.slow  # 5-15 s: in the second tier, to keep the README's command under 10 min
def test_a_load_that_spins_without_loading_is_a_hang_with_its_stacks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A busy loop: CPU time and Python lines move, but nothing is read or filled.
    plant_in_scheduler(tmp_path, monkeypatch, """
        import specd.workers.engine.core as engine

        def planted_spin(self, config):
            while True:
                sum(range(1000))

        engine.EngineCore.__init__ = planted_spin
    """)
    daemon = Daemon(tmp_path, "--hang-timeout-s", "3")
    try:
        assert daemon.wait(120) == EXIT_SCHEDULER_FAILED
        (record,) = daemon.events("scheduler_failed")
        assert "no progress for" in record["msg"] and "in stage load" in record["msg"]
        assert "process" in record["msg"] and "is running" in record["msg"]
        assert "planted_spin" in record["scheduler_traceback"]  # faulthandler's dump
    finally:
        daemon.stop()
