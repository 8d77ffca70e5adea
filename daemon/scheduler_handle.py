"""The front's side of the scheduler: the child process and the link to it.

Constructing a `SchedulerHandle` removes the link directories of fronts that died without
cleaning up (`kill -9`), makes its own private link directory (0700), binds both
ZeroMQ sockets and starts `python -P -m specd.workers.process.scheduler_process`. The child gets
the front's environment minus systemd's service variables, and dies with the front
(PR_SET_PDEATHSIG, armed in the child). Its exit is seen at once through a pidfd on the
event loop (SIGKILL, segfault and the OOM killer included), not by polling.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from specd.daemon.sdnotify import child_environ
from specd.ipc.messages import FromScheduler, ToScheduler
from specd.ipc.zmq_link import LinkPaths, TypedSocket, remove_stale_links
from specd.logs import log_event
from specd.workers.config import EngineConfig

log = logging.getLogger("specd.front")

# /proc/PID/stat's state letter (proc(5)), in the words status and the hang record use.
PROCESS_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible sleep (state D: waiting on the kernel or a device)",
    "T": "stopped (state T: SIGSTOP or SIGTSTP; SIGCONT resumes it)",
    "t": "stopped by a debugger (state t)",
    "Z": "a zombie (state Z: exited, not reaped yet)",
    "X": "dead (state X)",
}


def process_state(pid: int) -> str:
    """What the kernel says process `pid` is doing (/proc/PID/stat), in words: "running",
    "stopped (state T: SIGSTOP or SIGTSTP)", ... or "gone" when there is no such process
    (here: it exited, or lives in another PID namespace)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    code = stat[stat.rindex(")") + 2]  # the field after the command name, which may hold ")"
    return PROCESS_STATES.get(code, f"in state {code}")


class SchedulerHandle:
    """A running scheduler process and the two sockets that reach it."""

    def __init__(self, engine: EngineConfig, runtime_base_dir: Path, log_format: str,
                 log_level: str) -> None:
        runtime_base_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_links(runtime_base_dir)
        self.paths = LinkPaths.create(runtime_base_dir)
        self._context = zmq.asyncio.Context()
        # Sends are non-blocking on a plain socket; receives are awaited on an asyncio one.
        self._sync_context: zmq.Context[Any] = zmq.Context.shadow(self._context.underlying)
        self._sender: TypedSocket[Any] = TypedSocket.bind(
            self._sync_context, zmq.PUSH, self.paths.to_scheduler)
        self._receiver: TypedSocket[FromScheduler] = TypedSocket.bind(
            self._context, zmq.PULL, self.paths.from_scheduler, FromScheduler)
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", "specd.workers.process.scheduler_process",
             "--link-dir", str(self.paths.runtime_dir), "--parent-pid", str(os.getpid()),
             "--engine-config", msgspec.json.encode(engine).decode(),
             "--log-format", log_format, "--log-level", log_level],
            env=child_environ(), stdin=subprocess.DEVNULL, close_fds=True)
        self.pid = self.process.pid
        self._pidfd = os.pidfd_open(self.pid)
        self._watching = False

    def send(self, message: ToScheduler) -> None:
        """Non-blocking send; raises LinkSendError when the scheduler's queue is full."""
        self._sender.send(message, block=False)

    async def receive(self) -> FromScheduler:
        return await self._receiver.recv_async()

    def watch_exit(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the event loop as soon as the process exits."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self._pidfd, callback)
        self._watching = True

    def stop_watching(self) -> None:
        if self._watching:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            self._watching = False

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal), None while running."""
        return self.process.poll()

    def process_state(self) -> str:
        """What the kernel says the process is doing (/proc/PID/stat), in words: "running",
        "stopped (state T: SIGSTOP or SIGTSTP)", ... or "gone" once it exited."""
        return process_state(self.pid)

    @property
    def is_stopped(self) -> bool:
        """Stopped by a signal or a debugger: it cannot answer until continued."""
        return self.process_state().startswith("stopped")

    def request_stack_dump(self) -> None:
        """Ask the scheduler's faulthandler to write every thread's stack (SIGUSR1)."""
        if self.returncode is None:
            os.kill(self.pid, signal.SIGUSR1)

    def read_stack_dump(self) -> str:
        path = self.paths.stack_dump_file
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)

    async def wait_exit(self, timeout: float) -> int | None:
        """Wait up to `timeout` s for the process to exit; its return code or None."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.returncode is None and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return self.returncode

    def close(self) -> None:
        """Kill the process if it still runs, close the sockets, remove the link directory."""
        self.kill()
        self.process.wait()
        self.stop_watching()
        os.close(self._pidfd)
        self._sender.close()
        self._receiver.close()
        self._context.term()
        shutil.rmtree(self.paths.runtime_dir, ignore_errors=True)


def _remove_stale_links(base_dir: Path) -> None:
    """Remove dead fronts' link directories; one that cannot be removed is logged, and
    does not keep this daemon from starting."""
    removed, failed = remove_stale_links(base_dir)
    for path in removed:
        log_event(log, logging.INFO, "stale_link_removed",
                  f"removed {path}: its front process is gone", path=str(path))
    for path, exc in failed:
        log_event(log, logging.WARNING, "stale_link_kept",
                  f"cannot remove {path}, whose front process is gone: {exc}", path=str(path))
