"""Rank 0's wait for its workers to start (WorkerGroup.wait_for): each way a worker can fail
to get there is an error naming the rank, its pid and device. The workers here are stand-ins
started as the real ranks are (launch.RankProcess: a fresh interpreter with an inherited
control pipe) that speak the start-up protocol of parallel/rank_spec.py."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator

import pytest

from specd.workers.parallel.driver import WorkerGroup
from specd.workers.parallel.launch import RankProcess, first_error_line

# The stand-in's control pipe, as rank_main.main opens it.
PIPE = ("import sys, time\n"
        "from multiprocessing.connection import Connection\n"
        "conn = Connection(int(sys.argv[sys.argv.index('--control-fd') + 1]))\n")

FAILS = PIPE + "conn.send(('failed', 'Traceback ...\\nValueError: no such tensor'))\n"
EXITS_SILENTLY = PIPE + "import os\nos._exit(3)\n"
RAISES_BEFORE_A_WORD = "import json\njson.loads('{')\n"
LOADS_SLOWLY = (PIPE + "from specd.workers.parallel.rank_spec import StatusPipe\n"
                "with StatusPipe(conn).beating():\n    time.sleep(2.5)\nconn.send(('ready', ''))\n"
                # It stays: an exited stand-in's pipe is at EOF, which poll() also reports.
                "time.sleep(60)\n")
NEVER_ANSWERS = PIPE + "time.sleep(60)\n"


@pytest.fixture()
def start() -> Iterator[Callable[[str], WorkerGroup]]:
    """A group of one stand-in worker running the given start-up (the real constructor
    starts model workers)."""
    groups: list[WorkerGroup] = []

    def make(code: str) -> WorkerGroup:
        group = WorkerGroup.__new__(WorkerGroup)
        group.processes = [RankProcess(1, "cuda:1", [sys.executable, "-c", code])]
        groups.append(group)
        return group

    yield make
    for group in groups:
        group.processes[0].kill()
        group.processes[0].join(10)
        group.processes[0].close()


def test_a_worker_that_fails_is_reported_with_its_traceback(
        start: Callable[[str], WorkerGroup]) -> None:
    group = start(FAILS)
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+ on cuda:1\) failed while starting:"
                                           r"\nTraceback ...\nValueError: no such tensor"):
        group.wait_for("ready", 10.0)


def test_a_worker_that_exits_without_a_word_is_named_with_its_exit_code(
        start: Callable[[str], WorkerGroup]) -> None:
    group = start(EXITS_SILENTLY)
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+ on cuda:1\) exited with code 3 "
                                           "before it was ready$"):
        group.wait_for("ready", 10.0)


def test_a_worker_that_raises_before_it_reports_is_named_with_its_error(
        start: Callable[[str], WorkerGroup]) -> None:
    """It never opened its pipe: the exception line of its traceback (its stderr) comes
    with the exit code."""
    group = start(RAISES_BEFORE_A_WORD)
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+ on cuda:1\) exited with code 1 "
                                           r"before it was joining: json.decoder."
                                           r"JSONDecodeError: Expecting property name"):
        group.wait_for("joining", 10.0)


def test_beats_are_read_until_the_worker_is_ready(
        start: Callable[[str], WorkerGroup]) -> None:
    group = start(LOADS_SLOWLY)
    group.wait_for("ready", 30.0)
    assert not group.processes[0].pipe.poll()  # every beat read


def test_a_silent_worker_times_out_naming_it(start: Callable[[str], WorkerGroup]) -> None:
    group = start(NEVER_ANSWERS)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+ on cuda:1\) not ready after 1 s"):
        group.wait_for("ready", 1.0)
    assert 1.0 <= time.monotonic() - started < 2.0


def test_the_first_traceback_names_the_error() -> None:
    """The root cause of a chained traceback, not the exception raised while handling it;
    without a traceback the last line said."""
    lines = ["some log line", "Traceback (most recent call last):", '  File "x.py", line 1',
             "    import torch", "ImportError: planted", "",
             "During handling of the above exception, another exception occurred:", "",
             "Traceback (most recent call last):", "RuntimeError: later"]
    assert first_error_line(lines) == "ImportError: planted"
    assert first_error_line(["starting", "Killed", ""]) == "Killed"
    assert first_error_line([]) == ""
