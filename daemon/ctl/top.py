"""`specctl top`: a live view of a running daemon, redrawn every second from `status`.

Shows state and model, open requests, running and queued sequences (the batch), the
speculation mode and its acceptance, tokens/s and steps/s (differences of the engine's
counters between two frames) and KV-cache use. Plain ANSI escapes; q or Ctrl-C quits.
`render` is a pure function of two snapshots, so the layout is testable without a terminal.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import click

from specd.daemon.ctl.common import Settings, run_client_call
from specd.ipc import messages as m
from specd.ipc.client import Client

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen
BAR_WIDTH = 30


@dataclass(frozen=True)
class Snapshot:
    """One status reply and when it was taken (time.monotonic())."""

    taken_at: float
    status: m.StatusReply

    @property
    def engine(self) -> dict[str, Any]:
        return self.status.engine


def _rate(now: Snapshot, before: Snapshot | None, key: str) -> float | None:
    if before is None or key not in now.engine or key not in before.engine:
        return None
    elapsed = now.taken_at - before.taken_at
    return (now.engine[key] - before.engine[key]) / elapsed if elapsed > 0 else None


def _bar(fraction: float) -> str:
    filled = round(BAR_WIDTH * min(max(fraction, 0.0), 1.0))
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"


def render(now: Snapshot, before: Snapshot | None) -> list[str]:
    """The lines of one frame; rates need the previous snapshot (shown as '-' without)."""
    status, engine = now.status, now.engine
    tokens_per_s = _rate(now, before, "num_generated_tokens")
    steps_per_s = _rate(now, before, "num_steps")
    total = int(engine.get("num_kv_blocks", 0))
    used = total - int(engine.get("num_free_kv_blocks", 0))
    drafted, accepted = int(engine.get("num_drafted", 0)), int(engine.get("num_accepted", 0))
    lines = [
        f"specd {status.version}  state {status.state}  model {status.model}  "
        f"up {status.uptime_s:.0f} s",
        f"requests   {status.num_open_requests} open   {status.num_connections} connections",
        f"batch      {engine.get('num_running', '-')} running   "
        f"{engine.get('num_waiting', '-')} queued   "
        f"{engine.get('num_preemptions', 0)} preemptions",
        f"throughput {_fmt(tokens_per_s, 'tok/s')}   {_fmt(steps_per_s, 'steps/s')}",
        f"spec       mode {engine.get('spec_mode', '-')}   "
        f"{'active' if engine.get('spec_active') else 'inactive'}   "
        f"accepted {accepted}/{drafted} drafts"
        + (f" ({accepted / drafted:.0%})" if drafted else "")
        + (f"   {engine['acceptance_length']:.2f} tokens/pass"
           if engine.get("acceptance_length") else ""),
        f"kv cache   {_bar(used / total if total else 0.0)} {used}/{total} blocks",
    ]
    if "error" in engine:
        lines.append(f"engine     {engine['error']}")
    lines.append("q or Ctrl-C quits")
    return lines


def _fmt(value: float | None, unit: str) -> str:
    return f"- {unit}" if value is None else f"{value:.1f} {unit}"


@contextlib.contextmanager
def _keys(stream: TextIO) -> Iterator[bool]:
    """cbreak mode on a terminal (single keys, no echo), restored on exit; yields whether
    keys can be read."""
    if not stream.isatty():
        yield False
        return
    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _ctrl_c_quits() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt while top runs, even where SIGINT was ignored when
    the process started (a background job of a script, some supervisors: Python then
    leaves it ignored, and Ctrl-C would do nothing); the previous handler is restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait_for_quit(stream: TextIO, seconds: float) -> bool:
    """Wait up to `seconds` for a key; True when it was q."""
    ready, _, _ = select.select([stream], [], [], seconds)
    if not ready:
        return False
    return os.read(stream.fileno(), 1) in (b"q", b"Q")


def run_top(socket_path: Path | None, timeout: float, interval: float,
            num_frames: int | None, out: TextIO = sys.stdout, keys: TextIO = sys.stdin) -> None:
    """Redraw every `interval` seconds until q, Ctrl-C or `num_frames` frames. Client
    errors (daemon gone) propagate to the caller."""
    before: Snapshot | None = None
    count = 0
    clear = CLEAR if out.isatty() else "\n"  # piped: frames one after another
    with Client(socket_path, timeout=timeout) as client, _keys(keys) as can_read_keys, \
            _ctrl_c_quits():
        try:
            while num_frames is None or count < num_frames:
                now = Snapshot(time.monotonic(), client.status())
                out.write(clear + "\n".join(render(now, before)) + "\n")
                out.flush()
                before, count = now, count + 1
                if num_frames is not None and count >= num_frames:
                    break
                if can_read_keys:
                    if _wait_for_quit(keys, interval):
                        break
                else:
                    time.sleep(interval)
        except KeyboardInterrupt:
            pass  # Ctrl-C is the documented way out, like q


@click.command()
@click.option("--interval", type=float, default=1.0, show_default=True,
              help="seconds between frames")
@click.option("--frames", type=int, default=None,
              help="stop after this many frames [default: until q or Ctrl-C]")
@click.pass_context
def top(ctx: click.Context, interval: float, frames: int | None) -> None:
    """Live view: running and queued requests, batch, speculation, tokens/s, KV use.
    q or Ctrl-C quits."""
    if not interval > 0:
        raise click.UsageError(f"--interval must be > 0, got {interval}")
    settings: Settings = ctx.obj
    run_client_call(lambda: run_top(settings.socket_path, settings.timeout, interval,
                                    frames))
