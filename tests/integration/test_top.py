"""`specctl top` against the real daemon (fixture model unless $SPECD_TEST_MODEL), run under
a pseudo-terminal as a person would: it draws a frame with the batch, speculation, tokens/s
and KV-cache lines, keeps redrawing, and quits on q and on Ctrl-C with status 0."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specd.daemon.ctl.top import Snapshot, render
from specd.ipc import messages as m
from tests.integration.daemon_harness import Daemon

FRAME_END = b"q or Ctrl-C quits"
WAIT_S = 60.0  # a cold `python -m` start on two busy cores


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("top"), "--log-level", "warning").wait_ready()
    yield d
    d.stop()


def _spawn_top(socket_path: Path, sigint_ignored: bool = False) -> tuple[int, int]:
    """`specctl top` as the session leader of a new pseudo-terminal (its controlling terminal, so
    Ctrl-C typed into it raises SIGINT); returns (pid, master fd). sigint_ignored: start it
    with SIGINT ignored, as a background job of a script is (the ignore survives exec)."""
    pid, fd = pty.fork()
    if pid == 0:
        if sigint_ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.execv(sys.executable, [sys.executable, "-m", "specd.daemon.ctl",
                                  "--socket", str(socket_path), "top", "--interval", "0.2"])
    return pid, fd


def _read_until(fd: int, marker: bytes, count: int) -> bytes:
    """Terminal output until `marker` has appeared `count` times."""
    out = b""
    deadline = time.monotonic() + WAIT_S
    while out.count(marker) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"no {count} frames in {WAIT_S} s; got {out!r}")
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            out += os.read(fd, 65536)
    return out


def _exit_status(pid: int, fd: int) -> int:
    """Wait for top to exit, reading its terminal meanwhile as a terminal does (top's
    last frames and its restoring of the terminal mode, TCSADRAIN, go through it)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            with contextlib.suppress(OSError):  # EIO: its last process closed the terminal
                os.read(fd, 65536)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("top did not quit")


@pytest.mark.parametrize(("key", "sigint_ignored"),
                         [(b"q", False), (b"\x03", False), (b"\x03", True)],
                         ids=["q", "ctrl-c", "ctrl-c-with-sigint-ignored-at-start"])
def test_top_draws_frames_and_quits(daemon: Daemon, key: bytes, sigint_ignored: bool) -> None:
    pid, fd = _spawn_top(daemon.socket_path, sigint_ignored)
    try:
        out = _read_until(fd, FRAME_END, 2)  # a second frame: it refreshes
        os.write(fd, key)
        status = _exit_status(pid, fd)
    finally:
        os.close(fd)
    text = out.decode()
    assert "\x1b[H\x1b[2J" in text  # each frame redraws the screen
    for label in ("state ready", "running", "queued", "tok/s", "spec       mode",
                  "kv cache", "blocks"):
        assert label in text, label
    assert status == 0


def _status(engine: dict[str, object], uptime: float) -> m.StatusReply:
    return m.StatusReply(id=1, state="ready", protocol=1, version="0", uptime_s=uptime,
                         model="fixture", num_open_requests=3, num_connections=2, resolved={},
                         engine=engine, provenance={}, config={})


def test_rates_come_from_two_snapshots() -> None:
    engine = {"num_running": 2, "num_waiting": 1, "num_kv_blocks": 100,
              "num_free_kv_blocks": 75, "num_steps": 10, "num_generated_tokens": 100,
              "spec_mode": "auto", "spec_active": True, "num_drafted": 40,
              "num_accepted": 30, "num_preemptions": 0, "acceptance_length": 2.5}
    first = Snapshot(10.0, _status(engine, 1.0))
    later = Snapshot(12.0, _status(engine | {"num_steps": 30, "num_generated_tokens": 160}, 3.0))
    without_rates = "\n".join(render(first, None))
    assert "- tok/s" in without_rates
    frame = "\n".join(render(later, first))
    assert "30.0 tok/s" in frame and "10.0 steps/s" in frame
    assert "2 running   1 queued" in frame
    assert "accepted 30/40 drafts (75%)   2.50 tokens/pass" in frame
    assert "25/100 blocks" in frame
