"""Rank 0's wait for its workers to start (WorkerGroup.wait_for): each way a worker can fail
to get there is an error naming the rank, its pid and device. The workers here are forked
stand-ins that speak the start-up protocol of parallel/worker.py on a real pipe."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import pytest

from specd.workers.parallel.driver import WorkerGroup
from specd.workers.parallel.worker import heartbeats


def _fails(conn: Connection) -> None:
    conn.send(("failed", "Traceback ...\nValueError: no such tensor"))


def _exits_silently(conn: Connection) -> None:
    os._exit(3)


def _loads_slowly(conn: Connection) -> None:
    with heartbeats(conn):
        time.sleep(2.5)
    conn.send(("ready", ""))


def _never_answers(conn: Connection) -> None:
    time.sleep(60)


@pytest.fixture()
def start() -> Iterator[Callable[[Callable[[Connection], None]], WorkerGroup]]:
    """A group of one forked worker running the given start-up (the real constructor spawns
    model workers)."""
    groups: list[WorkerGroup] = []

    def make(target: Callable[[Connection], None]) -> WorkerGroup:
        ours, theirs = mp.get_context("fork").Pipe()
        process = mp.get_context("fork").Process(target=target, args=(theirs,), daemon=True)
        process.start()
        theirs.close()
        group = WorkerGroup.__new__(WorkerGroup)
        group.processes, group.pipes, group.devices = [process], [ours], ["cuda:1"]
        groups.append(group)
        return group

    yield make
    for group in groups:
        group.processes[0].kill()
        group.processes[0].join()


def test_a_worker_that_fails_is_reported_with_its_traceback(
        start: Callable[[Callable[[Connection], None]], WorkerGroup]) -> None:
    group = start(_fails)
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+ on cuda:1\) failed while starting:"
                                           r"\nTraceback ...\nValueError: no such tensor"):
        group.wait_for("ready", 10.0)


def test_a_worker_that_exits_without_a_word_is_named_with_its_exit_code(
        start: Callable[[Callable[[Connection], None]], WorkerGroup]) -> None:
    group = start(_exits_silently)
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+ on cuda:1\) exited with code 3 "
                                           "before it was ready"):
        group.wait_for("ready", 10.0)


def test_beats_are_read_until_the_worker_is_ready(
        start: Callable[[Callable[[Connection], None]], WorkerGroup]) -> None:
    group = start(_loads_slowly)
    group.wait_for("ready", 10.0)
    assert not group.pipes[0].poll()  # every beat read


def test_a_silent_worker_times_out_naming_it(
        start: Callable[[Callable[[Connection], None]], WorkerGroup]) -> None:
    group = start(_never_answers)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+ on cuda:1\) not ready after 1 s"):
        group.wait_for("ready", 1.0)
    assert 1.0 <= time.monotonic() - started < 2.0
