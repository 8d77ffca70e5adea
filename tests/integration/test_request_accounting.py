"""Every open request is accounted for, as the operator sees it: a request the scheduler
loses (a swallowed exception in `Scheduler.update` drops it) ends with an error frame
naming it, one `request_lost` record, a counter, a problem in `specctl status` and a
failing `specctl doctor`; one the engine holds but never steps makes the daemon `stalled`,
then ends the same way after the hang timeout. Neither stops the daemon, nor holds up a
drain.

The faults are planted in the scheduler process only (a sitecustomize on PYTHONPATH), for
requests the front sent (ids `r<N>`), after warm-up."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specd.client import SpecdError
from specd.daemon.ctl.common import EXIT_DOCTOR_PROBLEM
from specd.exit_codes import EXIT_OK
from tests.integration.daemon_harness import Daemon
from tests.integration.test_startup_faults import plant_in_scheduler

TOKENS_BEFORE_FAULT = 8


def specctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specd.daemon.ctl", "--socket",
                           str(daemon.socket_path), *args],
                          capture_output=True, text=True, timeout=60)


def _stream_until_error(daemon: Daemon) -> tuple[int, SpecdError, float]:
    """Stream a 100-token request: (tokens received, the error that ended it, when)."""
    num_tokens = 0
    with daemon.client() as client:
        stream = client.stream("def main():\n", max_tokens=100, ignore_eos=True)
        with pytest.raises(SpecdError) as raised:
            for delta in stream:
                num_tokens += len(delta.token_ids)
    return num_tokens, raised.value, time.monotonic()


@pytest.mark.slow  # a daemon start, a lost request and doctor (~25 s on two cores)
def test_a_request_the_scheduler_drops_ends_with_an_error_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plant_in_scheduler(tmp_path, monkeypatch, f"""
        import specd.workers.engine.scheduler as scheduler_module

        update = scheduler_module.Scheduler.update

        def planted_update(self, batch, output):
            try:
                changed = update(self, batch, output)
                for seq in changed:
                    if (seq.request_id.startswith("r") and not seq.is_finished
                            and seq.num_output_tokens >= {TOKENS_BEFORE_FAULT}):
                        self._remove(seq)
                        self._release(seq)
                        raise RuntimeError("planted")
                return changed
            except RuntimeError:
                return []  # the planted fault: swallowed, the sequence gone

        scheduler_module.Scheduler.update = planted_update
    """)
    daemon = Daemon(tmp_path, "--hang-timeout-s", "10").wait_ready()
    try:
        num_tokens, error, _ = _stream_until_error(daemon)
        assert num_tokens < 100
        assert error.code == "internal_error"
        assert "request r1 was lost: the scheduler no longer holds it" in error.message
        (record,) = daemon.events("request_lost")
        assert record["level"] == "error" and record["request_id"] == "r1"
        assert record["engine_holds"] == 0

        status = specctl(daemon, "status")
        lines = status.stdout.splitlines()
        assert "state        ready" in lines
        (problem,) = [x for x in lines if x.startswith("problem")]
        assert problem.startswith("problem      requests_lost: 1 since start; last: request "
                                  "r1 was lost")
        assert "requests     0 open" in status.stdout
        doctor = specctl(daemon, "doctor")
        assert doctor.returncode == EXIT_DOCTOR_PROBLEM
        assert "FAIL  problems: requests_lost: 1 since start" in doctor.stdout
        with daemon.client() as client:
            front = client.stats()["front"]
        assert front["requests_lost"] == 1 and front["error_internal_error"] == 1
        assert not daemon.events("scheduler_failed")  # the daemon serves on

        daemon.signal(signal.SIGTERM)  # nothing left open: the drain ends at once
        assert daemon.wait(20) == EXIT_OK
    finally:
        daemon.stop()


@pytest.mark.slow  # a daemon start and a stall past the hang timeout (~30 s on two cores)
def test_a_request_the_engine_holds_but_never_steps_is_stalled_then_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plant_in_scheduler(tmp_path, monkeypatch, f"""
        import specd.workers.engine.sequence as sequence_module

        awaits = sequence_module.Sequence.awaits_its_last_sample

        def planted_awaits(self, max_model_len):
            if (self.request_id.startswith("r")
                    and self.num_output_tokens >= {TOKENS_BEFORE_FAULT}):
                return True  # the planted fault: never scheduled again
            return awaits(self, max_model_len)

        sequence_module.Sequence.awaits_its_last_sample = planted_awaits
    """)
    hang_timeout_s = 10.0
    daemon = Daemon(tmp_path, "--hang-timeout-s", str(hang_timeout_s)).wait_ready()
    try:
        with daemon.client() as client:
            stream = client.stream("def main():\n", max_tokens=100, ignore_eos=True)
            num_tokens = len(next(iter(stream)).token_ids)
            # The request stops moving; the engine, holding it, sits idle: a named state.
            deadline = time.monotonic() + hang_timeout_s
            state = ""
            while time.monotonic() < deadline and state != "stalled":
                status = specctl(daemon, "status")
                state = status.stdout.splitlines()[0]
                state = state.removeprefix("state").strip()
            assert state == "stalled", status.stdout
            doctor = specctl(daemon, "doctor")
            assert doctor.returncode == EXIT_DOCTOR_PROBLEM
            assert "FAIL  daemon: state stalled" in doctor.stdout
            with pytest.raises(SpecdError) as raised:
                for delta in stream:
                    num_tokens += len(delta.token_ids)
        assert TOKENS_BEFORE_FAULT <= num_tokens < 100  # a verify may accept several
        assert raised.value.code == "internal_error"
        assert "request r1 stalled: the scheduler holds it but ran no step" in \
            raised.value.message
        (record,) = daemon.events("request_stalled")
        assert record["request_id"] == "r1" and record["engine_holds"] == 1

        status = specctl(daemon, "status")
        assert status.stdout.splitlines()[0] == "state        ready"
        assert any(x.startswith("problem      requests_stalled: 1 since start; last: "
                                "request r1 stalled") for x in status.stdout.splitlines())
        assert "batch        0 running, 0 waiting" in status.stdout  # aborted in the engine
        doctor = specctl(daemon, "doctor")
        assert doctor.returncode == EXIT_DOCTOR_PROBLEM
        assert "FAIL  problems: requests_stalled" in doctor.stdout
        assert not daemon.events("scheduler_failed")
    finally:
        daemon.stop()
