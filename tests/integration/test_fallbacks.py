"""Documented fallbacks (a graph capture or a CPU compilation that failed: that part runs
eagerly) are named in the engine's status with their reason, logged once with their
traceback, and make `specctl doctor` fail. Failures are planted by patching the capture or
the compiler, in-process or (for the daemon) in the scheduler process."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specd.daemon.ctl.common import EXIT_DOCTOR_PROBLEM
from specd.ipc.sampling import SamplingParams
from specd.logs import TextFormatter
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.runner import graphs
from tests.integration.daemon_harness import Daemon


class _Records(logging.Handler):
    """ERROR records of specd's loggers, and their text as a terminal shows them."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self.text = io.StringIO()
        self.setFormatter(TextFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.text.write(self.format(record) + "\n")


@pytest.fixture
def errors() -> Iterator[_Records]:
    handler = _Records()
    logger = logging.getLogger("specd")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _generate(core: EngineCore) -> list[int]:
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    tokens: list[int] = []
    while core.has_unfinished():
        for delta in core.step():
            tokens += delta.new_token_ids
    return tokens


def _assert_logged_once_each(errors: _Records, names: set[str]) -> None:
    assert len(errors.records) == len(names)
    for record in errors.records:
        assert record.exc_info is not None and "planted" in str(record.exc_info[1])
    # One traceback per record on a terminal (not one more from a field beside it).
    assert errors.text.getvalue().count("Traceback (most recent call last)") == len(names)


def test_a_failed_graph_capture_is_a_named_fallback_logged_once(
        monkeypatch: pytest.MonkeyPatch, errors: _Records) -> None:
    def capture(self: Any, forward: Any) -> None:
        raise RuntimeError("planted capture failure")

    monkeypatch.setattr(graphs.EagerGraph, "__init__", capture)
    core = EngineCore(EngineConfig(cuda_graphs=True, dtype="float32", spec_mode="on",
                                   max_num_seqs=4))
    core.warmup()
    fallbacks = core.stats().fallbacks
    assert set(fallbacks) == {"cuda_graphs", "cuda_graphs_draft_loop"}
    assert "target's forwards run eagerly" in fallbacks["cuda_graphs"]
    assert "draft loop runs eagerly" in fallbacks["cuda_graphs_draft_loop"]
    assert all("RuntimeError: planted capture failure" in r for r in fallbacks.values())
    assert len(_generate(core)) == 6  # serving goes on, eagerly
    _assert_logged_once_each(errors, set(fallbacks))


@pytest.mark.slow  # warm-up runs every step kind --cpu-compile would compile (~50 s here)
def test_a_failed_cpu_compilation_is_a_named_fallback_logged_once(
        monkeypatch: pytest.MonkeyPatch, errors: _Records) -> None:
    def compile(fn: Any, **options: Any) -> Any:
        def compiled(*args: Any) -> Any:
            raise RuntimeError("planted inductor failure")
        return compiled

    monkeypatch.setattr(torch, "compile", compile)
    core = EngineCore(EngineConfig(cpu_compile=True, dtype="float32", spec_mode="on",
                                   max_num_seqs=4))
    assert core.stats().fallbacks == {}  # nothing has failed before the first compile
    core.warmup()
    fallbacks = core.stats().fallbacks
    assert set(fallbacks) == {"cpu_compile_decode", "cpu_compile_draft_loop"}
    assert all("planted inductor failure" in r for r in fallbacks.values())
    _assert_logged_once_each(errors, set(fallbacks))


def test_the_operator_sees_a_fallback_in_status_and_doctor_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""\
        import sys
        if "specd.workers.process.scheduler_process" in sys.orig_argv:
            from specd.workers.runner import graphs

            def capture(self, forward):
                raise RuntimeError("planted capture failure")

            graphs.EagerGraph.__init__ = capture
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    daemon = Daemon(tmp_path, "--cuda-graphs", "--max-num-seqs", "4").wait_ready()
    try:
        def specctl(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "specd.daemon.ctl", "--socket",
                                   str(daemon.socket_path), *args],
                                  capture_output=True, text=True, timeout=120)

        status = specctl("status")
        assert status.returncode == 0
        shown = [x for x in status.stdout.splitlines() if x.startswith("fallback     ")]
        assert len(shown) == 2
        assert shown[0].startswith("fallback     cuda_graphs: the target's forwards run "
                                   "eagerly: capture of ")
        assert all("RuntimeError: planted capture failure" in x for x in shown)
        doctor = specctl("doctor")
        assert doctor.returncode == EXIT_DOCTOR_PROBLEM
        assert "FAIL  fallbacks: degraded: cuda_graphs: " in doctor.stdout
        records = daemon.events("graph_capture_failed")
        assert len(records) == 2  # the target's capture and the draft loop's, once each
        assert all("planted capture failure" in r["traceback"] for r in records)
    finally:
        daemon.stop()
