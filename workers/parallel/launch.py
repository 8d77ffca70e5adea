"""A rank's process: a fresh interpreter, `python -P -m specd.workers.parallel.rank_main ...`.

Ranks are never `multiprocessing` children: its spawn start re-runs the parent's main
module, so a script that builds a tensor-parallel `specd.Engine` without an
`if __name__ == "__main__":` guard started its ranks from its ranks and failed in them. A
fresh interpreter runs only the rank's module (`-P`: nothing from the current directory or
the script's is imported in its place), as the scheduler process is started
(daemon/scheduler_handle.py).

The child inherits one end of a socketpair as its control pipe (`--control-fd`; a
`multiprocessing.connection.Connection` on both ends, which carries the start-up protocol
of rank_spec.py), the parent's environment and working directory, /dev/null as stdin. Its
stderr is a pipe that a thread of the parent copies line by line to the parent's stderr
(the rank's records reach the same journal) and whose last lines it keeps, so that a rank
that exits before it could report anything (an import that fails, an interpreter that
does not start) is named with the exception line of its own traceback. Its exit is seen
through a pidfd (`sentinel`), which `multiprocessing.connection.wait` waits on beside the
pipe.
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import IO

RANK_MODULE = "specd.workers.parallel.rank_main"
STDERR_FD = 2  # the parent's own stderr, whatever object sys.stderr is now
STDERR_LINES_KEPT = 200
# How long a rank seen exited may take to close its stderr (its last lines read).
STDERR_GRACE_S = 1.0
# How long a rank seen exited may take to be reaped (its exit code known); after a call
# raised, how long one may take to be seen exited (a broken collective is often noticed
# before the dead process is reaped).
EXIT_GRACE_S = 0.5


def module_command(module: str, args: Sequence[str]) -> list[str]:
    """`python -P -m module args...` with this interpreter."""
    return [sys.executable, "-P", "-m", module, *args]


class RankProcess:
    """One started rank: its process, control pipe and stderr (module docstring).

    command: the argv to run; `--control-fd N` is appended. rank, device: what `describe`
    names it by. pass_fds: further descriptors the child inherits (the step ring).
    """

    def __init__(self, rank: int, device: str, command: Sequence[str],
                 pass_fds: Sequence[int] = ()) -> None:
        self.rank = rank
        self.device = device
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [*command, "--control-fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(), *pass_fds), stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE, close_fds=True)
        finally:
            theirs.close()
        self.pipe = Connection(ours.detach())
        self._pidfd = os.pidfd_open(self.process.pid)
        self._stderr_lines: collections.deque[str] = collections.deque(
            maxlen=STDERR_LINES_KEPT)
        self._tee = threading.Thread(target=self._copy_stderr, args=(self.process.stderr,),
                                     name=f"rank{rank}-stderr", daemon=True)
        self._tee.start()

    @property
    def sentinel(self) -> int:
        """A pidfd: readable once the process has exited."""
        return self._pidfd

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        """The exit status (negative: killed by that signal), None while it runs."""
        return self.process.poll()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` s for the process to exit (and be reaped)."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()

    def describe(self) -> str:
        """"rank R (pid P on DEVICE)": how failures name a rank, so that a failure's log
        record alone says which process and device it was."""
        return f"rank {self.rank} (pid {self.pid} on {self.device})"

    def error_line(self, traceback_only: bool = False) -> str:
        """The exception line of the first traceback the rank wrote to stderr (else its
        last line, unless `traceback_only`; "" if none), once its stderr is closed or
        STDERR_GRACE_S passed."""
        self._tee.join(STDERR_GRACE_S)
        return first_error_line(list(self._stderr_lines), traceback_only)

    def exit_error(self, expected: str) -> str:
        """Why it is not `expected` ("joining", "ready"): it exited, with this code, after
        writing this error line."""
        self.join(EXIT_GRACE_S)  # its exit code, once reaped
        error = self.error_line()
        return (f"{self.describe()} exited with code {self.exitcode} before it was "
                f"{expected}" + (f": {error}" if error else ""))

    def close(self) -> None:
        """Release the pipe and the pidfd (the process must have exited or been killed);
        once."""
        if not self.pipe.closed:
            self.pipe.close()
            os.close(self._pidfd)

    def _copy_stderr(self, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        with stream:
            for line in iter(stream.readline, b""):
                _write_all(STDERR_FD, line)
                self._stderr_lines.append(line.decode(errors="replace").rstrip("\n"))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def first_error_line(lines: Sequence[str], traceback_only: bool = False) -> str:
    """The exception line of the first traceback in `lines` (its first unindented line
    after "Traceback (most recent call last):"), else the last non-empty line (unless
    `traceback_only`), else ""."""
    in_traceback = False
    for line in lines:
        if line.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and line and not line.startswith(" "):
            return line
    if traceback_only:
        return ""
    return next((line for line in reversed(lines) if line.strip()), "")
