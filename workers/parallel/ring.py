"""The step ring: one writer, N readers on one host, through shared memory (after vLLM's
`shm_broadcast.MessageQueue`).

Rank 0 (or, on another node, its node agent) writes each call for the ranks once; every
local rank reads it. No pipe, no syscall on the way when the readers are awake, and no
copy per reader on the writer's side.

Layout, one memfd mapped by every process (the readers inherit its descriptor):

    header   magic, num_chunks, chunk_bytes, num_readers (u32 each), padded to 64 bytes
    flags    per chunk 1 + num_readers bytes: `written`, then each reader's `read`
    chunks   num_chunks x chunk_bytes; a chunk is [u32 length][u8 more][3 pad][payload]

Protocol per chunk (vLLM's): the writer may fill a chunk that is unwritten, or written and
read by every reader; it clears `written`, writes the payload, clears every reader's flag,
then sets `written`. A reader takes the chunk at its cursor once `written` is set and its
own flag is not, copies the payload out and sets its flag. Both walk the chunks in order.
A message longer than a chunk's payload spans consecutive chunks (`more` set on all but
the last), so a message of any size travels through the fixed ring. Between payload and
flags a fence (a lock's acquire and release: a full barrier, as vLLM uses) keeps weakly
ordered CPUs from showing a flag before the bytes it guards.

Waiting is a busy-wait with a bounded back-off: spin (`os.sched_yield`) for SPIN_S, long
enough to cover the gap between a GPU step's calls, then sleep from SLEEP_MIN_S, doubling
up to SLEEP_MAX_S, so an idle engine's readers wake at most 1 / SLEEP_MAX_S times a second
and the first call after idling waits at most SLEEP_MAX_S more. A writer that waits for
room, and a reader that waits for a call, run their `check` before every sleep (the
writer's raises when a reader has died: a full ring would otherwise wait for ever).
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable

MAGIC = 0x53504452  # "SPDR"
HEADER = struct.Struct("<IIII")
HEADER_BYTES = 64
PIECE = struct.Struct("<IB3x")  # payload length, more
NUM_CHUNKS = 16
CHUNK_BYTES = 256 * 1024
SPIN_S = 5e-3
SLEEP_MIN_S = 50e-6
SLEEP_MAX_S = 1e-3

Check = Callable[[], None]

_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier (the lock's atomic operations), as vLLM's `memory_fence`."""
    _FENCE.acquire()
    _FENCE.release()


def no_check() -> None:
    """The default `check`: nothing can fail while waiting."""


def wait_until(ready: Callable[[], bool], check: Check) -> None:
    """Return once `ready()`: spin for SPIN_S, then sleep with a back-off, running
    `check()` before every sleep (module docstring)."""
    if ready():
        return
    spin_until = time.monotonic() + SPIN_S
    while time.monotonic() < spin_until:
        os.sched_yield()
        if ready():
            return
    delay = SLEEP_MIN_S
    while True:
        check()
        time.sleep(delay)
        if ready():
            return
        delay = min(2 * delay, SLEEP_MAX_S)


class _Ring:
    """The mapping and its layout (shared by writer and reader); owns `fd` (closed on
    `close`, or when it is not a ring)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.map = mmap.mmap(fd, 0)
        magic, self.num_chunks, self.chunk_bytes, self.num_readers = HEADER.unpack_from(
            self.map, 0)
        if magic != MAGIC:
            self.map.close()
            os.close(fd)
            raise ValueError(f"descriptor {fd} is not a step ring (magic {magic:#x})")
        self.flags = HEADER_BYTES
        self.flag_bytes = 1 + self.num_readers
        self.chunks = HEADER_BYTES + self.num_chunks * self.flag_bytes
        self.payload_bytes = self.chunk_bytes - PIECE.size
        self.view = memoryview(self.map)  # slices of it are not copies
        self.cursor = 0

    def flag(self, chunk: int) -> int:
        """Offset of chunk `chunk`'s `written` flag (its readers' flags follow)."""
        return self.flags + chunk * self.flag_bytes

    def chunk(self, chunk: int) -> int:
        return self.chunks + chunk * self.chunk_bytes

    def close(self) -> None:
        self.view.release()
        self.map.close()
        os.close(self.fd)


class RingWriter:
    """The writing end; creates the ring. `fd` is what readers are given (inheritable)."""

    def __init__(self, num_readers: int, num_chunks: int = NUM_CHUNKS,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        if num_readers < 1 or chunk_bytes <= PIECE.size or num_chunks < 2:
            raise ValueError(f"a ring needs readers, chunks and room: {num_readers} readers, "
                             f"{num_chunks} chunks of {chunk_bytes} bytes")
        fd = os.memfd_create("specd-steps")
        size = HEADER_BYTES + num_chunks * (1 + num_readers + chunk_bytes)
        os.ftruncate(fd, size)  # zero-filled: every chunk unwritten
        with mmap.mmap(fd, size) as init:
            HEADER.pack_into(init, 0, MAGIC, num_chunks, chunk_bytes, num_readers)
        self._ring = _Ring(fd)
        self._all_read = b"\x01" * num_readers
        self._none_read = bytes(num_readers)

    @property
    def fd(self) -> int:
        return self._ring.fd

    def write(self, data: bytes | bytearray | memoryview, check: Check = no_check) -> None:
        """Publish `data` to every reader (in pieces when it is longer than a chunk),
        waiting for room as the module docstring says."""
        ring = self._ring
        view = memoryview(data)
        offset = 0
        while True:
            piece = view[offset: offset + ring.payload_bytes]
            offset += len(piece)
            more = offset < len(view)
            flag = ring.flag(ring.cursor)
            wait_until(functools.partial(self._free, flag), check)
            ring.map[flag] = 0
            start = ring.chunk(ring.cursor)
            PIECE.pack_into(ring.map, start, len(piece), more)
            ring.map[start + PIECE.size: start + PIECE.size + len(piece)] = piece
            fence()
            ring.map[flag + 1: flag + ring.flag_bytes] = self._none_read
            fence()
            ring.map[flag] = 1
            ring.cursor = (ring.cursor + 1) % ring.num_chunks
            if not more:
                return

    def _free(self, flag: int) -> bool:
        ring = self._ring
        return (ring.map[flag] == 0
                or ring.map[flag + 1: flag + ring.flag_bytes] == self._all_read)

    def close(self) -> None:
        self._ring.close()


class RingReader:
    """Reader `index` (0-based, < the ring's num_readers) of the ring behind `fd` (which
    it owns from now on)."""

    def __init__(self, fd: int, index: int) -> None:
        self._ring = _Ring(fd)
        if not 0 <= index < self._ring.num_readers:
            self._ring.close()
            raise ValueError(f"reader {index} of a ring with {self._ring.num_readers} readers")
        self.index = index

    def read(self, check: Check = no_check) -> bytearray:
        """The next message (waiting for it as the module docstring says)."""
        ring = self._ring
        parts: list[bytearray] = []
        while True:
            flag = ring.flag(ring.cursor)
            mine = flag + 1 + self.index
            wait_until(functools.partial(self._written, flag, mine), check)
            fence()
            start = ring.chunk(ring.cursor)
            length, more = PIECE.unpack_from(ring.map, start)
            part = bytearray(length)  # the one copy: the chunk is the writer's once read
            part[:] = ring.view[start + PIECE.size: start + PIECE.size + length]
            parts.append(part)
            fence()
            ring.map[mine] = 1
            ring.cursor = (ring.cursor + 1) % ring.num_chunks
            if not more:
                return parts[0] if len(parts) == 1 else bytearray().join(parts)

    def _written(self, flag: int, mine: int) -> bool:
        return self._ring.map[flag] == 1 and self._ring.map[mine] == 0

    def close(self) -> None:
        self._ring.close()
