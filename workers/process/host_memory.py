"""Freed host memory kept for reuse in the processes that compute (the scheduler, each rank).

A step allocates and frees the same large host tensors every time (a verify step's gathered
K/V histories: about 1.5 MB a layer at batch 8 on the fixture). glibc's malloc serves
blocks over its mmap threshold (128 KiB, raised dynamically only up to the size of blocks
freed so far) with fresh mmap(2) pages and returns heap tops over its trim threshold to
the kernel, so each such tensor faults its pages in again, zero-filled, at every step. On
the 2-vCPU VM that was 8.4 ms of a 36 ms speculative step at batch 8 (fixture, float32,
compiled), 1.9 ms with the thresholds below, where the blocks are reused from the heap.
Plain steps at batch 1 and 8 did not change: their temporaries are small.

The cost is that memory freed after a peak (a long prefill) stays in the process, reused
by the next steps, instead of going back to the kernel: the resident size holds at its
peak. Applied once per process by `keep_freed_host_memory`; on a C library without glibc's
mallopt(3) nothing changes, which is logged as a WARNING (it is not an error: only speed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("specd.host_memory")

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at half its heap size: 32 MiB on 64-bit. Blocks above it
# (the KV cache, weights) still come from mmap, as they should.
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2**30


def keep_freed_host_memory() -> bool:
    """Set the thresholds (module docstring); True if the C library took both. Logs one
    record either way (event `host_memory`)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        log.warning("host memory: no mallopt in the C library (%s); freed blocks go back to "
                    "the kernel and are faulted in again", name,
                    extra={"event": "host_memory", "applied": False, "libc": name})
        return False
    taken = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
             and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if taken:
        log.info("host memory: blocks up to %d MiB come from the heap and freed memory is "
                 "kept for reuse", MMAP_THRESHOLD_BYTES // 2**20,
                 extra={"event": "host_memory", "applied": True,
                        "mmap_threshold_bytes": MMAP_THRESHOLD_BYTES,
                        "trim_threshold_bytes": TRIM_THRESHOLD_BYTES})
    else:
        log.warning("host memory: mallopt refused the thresholds; freed blocks go back to "
                    "the kernel", extra={"event": "host_memory", "applied": False,
                                         "libc": name})
    return taken
