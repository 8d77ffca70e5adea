"""Log records as journald needs them: priorities when stderr is the journal, one line each."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from specd.logs import log_event, one_line, setup_logging


@pytest.fixture
def stderr_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[IO[str]]:
    """A temp file to use as sys.stderr; the root logger's handlers and level restored
    afterwards. Each test installs it itself (`use_as_stderr`): pytest's own capture
    puts its sys.stderr back between the set-up and the call phases."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    with open(tmp_path / "stderr", "w+") as stream:
        yield stream
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def use_as_stderr(stream: IO[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr", stream)


def journal_stream_of(stream: IO[str]) -> str:
    stat = os.fstat(stream.fileno())
    return f"{stat.st_dev}:{stat.st_ino}"


def emit_all_levels() -> None:
    log = logging.getLogger("specd.test")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    log.critical("c")
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError as exc:
        log_event(log, logging.ERROR, "failed", "it failed", exc_info=exc, code=7)


def written_lines(stream: IO[str]) -> list[str]:
    for handler in logging.getLogger().handlers:
        handler.flush()
    stream.seek(0)
    return stream.read().splitlines()


def test_text_records_under_journald_carry_priorities_and_stay_one_line(
        stderr_file: IO[str], monkeypatch: pytest.MonkeyPatch) -> None:
    use_as_stderr(stderr_file, monkeypatch)
    monkeypatch.setenv("JOURNAL_STREAM", journal_stream_of(stderr_file))
    setup_logging("text", "debug")
    emit_all_levels()
    lines = written_lines(stderr_file)
    assert [line[:3] for line in lines] == ["<7>", "<6>", "<4>", "<3>", "<3>", "<3>"]
    assert [line.split(": ", 1)[1] for line in lines[:5]] == ["d", "i", "w", "e", "c"]
    traceback = lines[5]
    assert "specd.test: it failed  [event=failed code=7]\\nTraceback" in traceback
    assert "\\nTraceback (most recent call last):\\n" in traceback
    assert traceback.endswith("RuntimeError: boom\\nsecond line")


def test_json_records_under_journald_carry_priorities_and_stay_one_line(
        stderr_file: IO[str], monkeypatch: pytest.MonkeyPatch) -> None:
    use_as_stderr(stderr_file, monkeypatch)
    monkeypatch.setenv("JOURNAL_STREAM", journal_stream_of(stderr_file))
    setup_logging("json", "info")
    emit_all_levels()
    lines = written_lines(stderr_file)
    assert [line[:3] for line in lines] == ["<6>", "<4>", "<3>", "<3>", "<3>"]
    records = [json.loads(line[3:]) for line in lines]
    assert [r["msg"] for r in records] == ["i", "w", "e", "c", "it failed"]
    assert records[4]["event"] == "failed" and records[4]["code"] == 7
    assert records[4]["traceback"].startswith("Traceback (most recent call last):\n")
    assert records[4]["traceback"].endswith("RuntimeError: boom\nsecond line")


def test_no_priorities_when_journal_stream_names_another_file(
        stderr_file: IO[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # systemd set JOURNAL_STREAM, but stderr was redirected elsewhere (a terminal, a file).
    other = tmp_path / "other"
    other.write_text("")
    stat = os.stat(other)
    use_as_stderr(stderr_file, monkeypatch)
    monkeypatch.setenv("JOURNAL_STREAM", f"{stat.st_dev}:{stat.st_ino}")
    setup_logging("text", "info")
    emit_all_levels()
    lines = written_lines(stderr_file)
    assert not any(line.startswith("<") for line in lines)
    # For people at a terminal the traceback keeps its own lines.
    assert "Traceback (most recent call last):" in lines
    assert lines[-1] == "second line"


def test_a_status_reason_is_one_line_cut_at_a_word() -> None:
    message = ("compilation failed: BackendCompilerFailed: backend='inductor' raised:\n"
               + "CppCompileError: C++ compile error " * 20)
    line = one_line(message, limit=120)
    assert "\n" not in line and len(line) <= 120 and line.endswith(" ...")
    kept = line.removesuffix(" ...")
    assert " ".join(message.split()).startswith(kept)
    assert " ".join(message.split())[len(kept)] == " "  # the cut falls between words
    assert one_line("short\n  reason") == "short reason"
    assert one_line("x" * 300 + " tail", limit=100) == "x" * 300 + " ..."  # a word stays whole


def test_a_failed_compilation_reports_its_reason_whole_words(
        caplog: pytest.LogCaptureFixture) -> None:
    from specd.workers.runner.cpu_decode import report_compile_failure

    try:
        raise RuntimeError("inductor could not compile the decode step because " * 10)
    except RuntimeError as exc:
        reason = report_compile_failure(logging.getLogger("specd.test"), "failed", exc)
    assert reason.startswith("compilation failed: RuntimeError: inductor could not")
    assert reason.endswith(" ...") and len(reason) <= 200
    assert reason.removesuffix(" ...").endswith(("because", "inductor", "could", "not",
                                                 "compile", "the", "decode", "step"))
