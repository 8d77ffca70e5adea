"""Freed host memory kept for reuse (workers/process/host_memory.py): glibc takes both
thresholds and the process logs it once; a C library without mallopt changes nothing and
says so as a WARNING."""

from __future__ import annotations

import ctypes.util
import logging

import pytest

from specd.workers.process import host_memory


def test_glibc_takes_both_thresholds_and_it_is_logged(caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    with caplog.at_level(logging.INFO, logger="specd.host_memory"):
        assert host_memory.keep_freed_host_memory()
    (record,) = [r for r in caplog.records if vars(r).get("event") == "host_memory"]
    assert record.levelno == logging.INFO and vars(record)["applied"] is True
    assert vars(record)["mmap_threshold_bytes"] == 32 * 2**20


def test_without_mallopt_nothing_changes_and_a_warning_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    with caplog.at_level(logging.INFO, logger="specd.host_memory"):
        assert not host_memory.keep_freed_host_memory()
    (record,) = [r for r in caplog.records if vars(r).get("event") == "host_memory"]
    assert record.levelno == logging.WARNING and vars(record)["applied"] is False
