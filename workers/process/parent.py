"""Dying with the parent: a child process (the scheduler, a tensor-parallel rank) that must
not outlive the process that started it asks the kernel to kill it when that one dies."""

from __future__ import annotations

import ctypes
import os
import signal

from specd.exit_codes import EXIT_SCHEDULER_FAILED

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the front dies (prctl(2)); exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died between fork and prctl: then we were re-parented already.
    if os.getppid() != parent_pid:
        os._exit(EXIT_SCHEDULER_FAILED)
