"""The compile thread of `--cpu-compile-background` (workers/runner/cpu_compile_thread.py):
jobs run once each, in submission order, off the caller's thread and under inference mode;
what is pending is named until it is done; a job that raises goes to its submitter's
handler and the next job still runs; every compiled kind is one logged event; the
interpreter's switch interval is short while anything is pending."""

from __future__ import annotations

import logging
import sys
import threading

import pytest
import torch

from specd.workers.runner.cpu_compile_thread import SWITCH_INTERVAL_S, BackgroundCompiles


def test_jobs_run_once_in_order_off_the_callers_thread_under_inference_mode(
        caplog: pytest.LogCaptureFixture) -> None:
    compiles = BackgroundCompiles()
    release = threading.Event()
    ran: list[tuple[str, bool, bool]] = []

    def job(name: str) -> None:
        if name == "first":
            release.wait(10)  # held, so that both are seen pending
        ran.append((name, threading.current_thread() is threading.main_thread(),
                    torch.is_inference_mode_enabled()))

    def unexpected(exc: Exception) -> None:
        raise AssertionError(exc)

    with caplog.at_level(logging.INFO, logger="specd.cpu_compile"):
        compiles.submit("first", lambda: job("first"), unexpected)
        compiles.submit("second", lambda: job("second"), unexpected)
        compiles.submit("first", lambda: job("again"), unexpected)  # a name runs once
        assert compiles.pending() == ["first", "second"]
        assert compiles.is_submitted("second") and not compiles.is_ready("second")
        assert not compiles.wait(0.1)
        release.set()
        assert compiles.wait(10)
    assert ran == [("first", False, True), ("second", False, True)]
    assert compiles.is_ready("first") and compiles.is_ready("second")
    assert compiles.pending() == []
    events = [(vars(r)["kind"], vars(r)["event"]) for r in caplog.records
              if hasattr(r, "kind")]
    assert events == [("first", "cpu_compiled"), ("second", "cpu_compiled")]


def test_a_job_that_raises_goes_to_its_handler_and_the_next_job_runs(
        caplog: pytest.LogCaptureFixture) -> None:
    compiles = BackgroundCompiles()
    handled: list[Exception] = []
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("C++ compile error")

    with caplog.at_level(logging.INFO, logger="specd.cpu_compile"):
        compiles.submit("broken", broken, handled.append)
        compiles.submit("fine", lambda: ran.append("fine"), handled.append)
        assert compiles.wait(10)
    assert [str(e) for e in handled] == ["C++ compile error"]
    assert ran == ["fine"]
    # Done either way (the handler decided what follows); only the success is an event.
    assert compiles.is_ready("broken") and compiles.is_ready("fine")
    assert [r.kind for r in caplog.records if hasattr(r, "kind")] == ["fine"]


def test_the_switch_interval_is_short_while_anything_is_pending() -> None:
    # The serving thread's ops release the GIL to the compile thread; a short switch
    # interval hands it back within 0.1 ms instead of CPython's 5 ms (module docstring).
    before = sys.getswitchinterval()
    compiles = BackgroundCompiles()
    release = threading.Event()
    seen: list[float] = []

    def unexpected(exc: Exception) -> None:
        raise AssertionError(exc)

    compiles.submit("held", lambda: release.wait(10), unexpected)
    compiles.submit("next", lambda: seen.append(sys.getswitchinterval()), unexpected)
    # (CPython keeps the interval in whole microseconds)
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S) and before > 1e-3
    release.set()
    assert compiles.wait(10)
    assert seen == [pytest.approx(SWITCH_INTERVAL_S)]  # still short for the last job
    assert sys.getswitchinterval() == before  # restored once nothing is pending
