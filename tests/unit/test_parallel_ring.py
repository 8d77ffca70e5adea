"""The step ring (workers/parallel/ring.py): one writer, readers in other processes (fresh
interpreters given the ring's descriptor, as ranks are), every message whole and in order
whatever its size (empty, one chunk exactly, spanning chunks, longer than the whole ring);
a writer whose readers do not read waits once the ring is full and runs its check."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading

import pytest

from specd.workers.parallel.ring import RingReader, RingWriter

READER = """\
import hashlib, sys
from specd.workers.parallel.ring import RingReader
reader = RingReader(int(sys.argv[1]), int(sys.argv[2]))
for _ in range(int(sys.argv[3])):
    data = reader.read()
    print(len(data), hashlib.sha256(data).hexdigest(), flush=True)
"""


def _messages(payload: int, num_chunks: int) -> list[bytes]:
    sizes = [0, 1, 100, payload, payload + 1, 3 * payload + 7, (num_chunks + 3) * payload]
    return [os.urandom(n) for n in sizes] + [b"last"]


def test_every_reader_gets_every_message_whole_and_in_order() -> None:
    writer = RingWriter(num_readers=3, num_chunks=4, chunk_bytes=4096)
    messages = _messages(4096 - 8, 4)
    readers = [subprocess.Popen([sys.executable, "-c", READER, str(writer.fd), str(i),
                                 str(len(messages))], pass_fds=(writer.fd,),
                                stdout=subprocess.PIPE, text=True) for i in range(3)]
    try:
        for data in messages:
            writer.write(data)
        outputs = [r.communicate(timeout=60)[0] for r in readers]
    finally:
        for r in readers:
            r.kill()
        writer.close()
    expected = "".join(f"{len(m)} {hashlib.sha256(m).hexdigest()}\n" for m in messages)
    assert outputs == [expected] * 3
    assert all(r.returncode == 0 for r in readers)


def test_a_writer_whose_readers_do_not_read_waits_and_runs_its_check() -> None:
    writer = RingWriter(num_readers=2, num_chunks=3, chunk_bytes=1024)
    for i in range(3):  # one chunk each: the ring is full
        writer.write(bytes([i]) * 10)
    checks = []

    def check() -> None:
        checks.append(1)
        if len(checks) == 3:
            raise RuntimeError("rank 2 (pid 1 on cpu) exited with code -9")

    try:
        with pytest.raises(RuntimeError, match="exited with code -9"):
            writer.write(b"fourth", check)
    finally:
        writer.close()


def test_a_reader_frees_room_for_a_waiting_writer() -> None:
    """Readers in this process (threads, each on its own descriptor) drain the ring while
    the writer waits for room."""
    writer = RingWriter(num_readers=2, num_chunks=2, chunk_bytes=64)
    messages = [bytes([i]) * (i * 37) for i in range(20)]
    got: list[list[bytes]] = [[], []]

    def read(index: int) -> None:
        reader = RingReader(os.dup(writer.fd), index)
        for _ in messages:
            got[index].append(bytes(reader.read()))
        reader.close()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for data in messages:
        writer.write(data)
    for t in threads:
        t.join(30)
    writer.close()
    assert got == [messages, messages]


def test_a_reader_must_be_one_the_ring_has_and_the_descriptor_a_ring() -> None:
    writer = RingWriter(num_readers=1)
    try:
        with pytest.raises(ValueError, match="reader 1 of a ring with 1 readers"):
            RingReader(os.dup(writer.fd), 1)
    finally:
        writer.close()
    fd = os.memfd_create("not-a-ring")
    os.ftruncate(fd, 4096)
    with pytest.raises(ValueError, match="is not a step ring"):
        RingReader(fd, 0)  # closes it
