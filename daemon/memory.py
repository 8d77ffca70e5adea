"""Giving freed memory back to the operating system after a large request.

glibc keeps memory that was freed for reuse, in the heap of whichever thread allocated it:
after a prompt of megabytes was read, decoded and tokenized (the `tokenizers` library
allocates several times the text's size), the front's resident memory stays hundreds of
MB above its need. `malloc_trim(0)` returns the free pages of every arena. It walks the
heap, so the front calls it only after large requests, and off its event loop.

Elsewhere than glibc (musl, say) there is no `malloc_trim`: `TRIM_AVAILABLE` is False and
`release_free_memory` does nothing; the front logs that once at start-up.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)  # CDLL releases the GIL around each call
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()
TRIM_AVAILABLE = _MALLOC_TRIM is not None


def release_free_memory() -> bool:
    """Return free heap memory to the OS (glibc `malloc_trim(0)`); True if any was."""
    if _MALLOC_TRIM is None:
        return False
    return bool(_MALLOC_TRIM(0))


def resident_bytes(pid: int | str = "self") -> int:
    """Resident set size of process `pid` (VmRSS in /proc), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/{pid}/status has no VmRSS line")
