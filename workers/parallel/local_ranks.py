"""The ranks a process starts on its own host: ranks 1..L-1 of node 0 (rank 0 starts them),
or all L ranks of another node (its node agent, node_agent.py).

`WorkerGroup` starts each rank as a fresh interpreter (launch.py) given the step ring's
descriptor (ring.py: the group writes, every rank reads), waits for them to start
(`wait_for`, over their control pipes), tells when one has exited (`first_exited`, one poll
of their pidfds), writes calls into the ring (`write`, which waits for room only as long
as every reader lives) and stops them. `wait_for` also waits for another node's agent as
node 0 sees it (nodes.py): anything with a pipe of start-up statuses is a `Starting`.
"""

from __future__ import annotations

import logging
import os
import select
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Protocol

import torch

from specd.workers.config import EngineConfig
from specd.workers.parallel.context import rank_device
from specd.workers.parallel.launch import EXIT_GRACE_S, RANK_MODULE, RankProcess, module_command
from specd.workers.parallel.peers import RankFailed
from specd.workers.parallel.rank_spec import RankSpec
from specd.workers.parallel.ring import RingWriter

log = logging.getLogger("specd.parallel")

STOP_TIMEOUT_S = 10.0


class Starting(Protocol):
    """What `wait_for` waits on: a pipe of (status, detail) start-up messages ("loading"
    beats, then "joining", "ready" or "failed"), and a descriptor readable once it is gone
    (a pidfd; None when the pipe's end says so)."""

    pipe: Connection

    @property
    def sentinel(self) -> int | None: ...

    def describe(self) -> str: ...

    def exit_error(self, expected: str) -> str: ...


def wait_for(members: Sequence[Starting], expected: str, timeout_s: float,
             on_beat: Callable[[], None] | None = None) -> None:
    """Until every member reports `expected` ("joining": about to join the group, "ready":
    loaded), reading their `loading` beats meanwhile (`on_beat` after each); RuntimeError
    with the traceback of one that failed, or naming one that exited or did not get there
    in `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for member in members:
        status, detail = "loading", ""
        while status == "loading":
            # One blocking wait for a message, the exit or the deadline: between beats this
            # thread does not move, so the stage watch sees the beats and only them (a
            # stopped worker is silence).
            waitables: list[Connection | int] = [member.pipe]
            if member.sentinel is not None:
                waitables.append(member.sentinel)
            ready = wait(waitables, max(0.0, deadline - time.monotonic()))
            if not member.pipe.poll():  # what it sent before it exited is read first
                if member.sentinel is not None and member.sentinel in ready:
                    raise RuntimeError(member.exit_error(expected))
                raise RuntimeError(f"{member.describe()} not {expected} after "
                                   f"{timeout_s:.0f} s")
            try:
                status, detail = member.pipe.recv()
            except EOFError as e:  # it exited without a word (a signal, os._exit)
                raise RuntimeError(member.exit_error(expected)) from e
            if status == "loading" and on_beat is not None:
                on_beat()
        if status != expected:
            raise RuntimeError(f"{member.describe()} failed while starting:\n{detail}")


class _NoRing:
    """The ring of a group without ranks: nothing reads, nothing is written."""

    fd = -1

    def write(self, data: bytes | bytearray | memoryview,
              check: Callable[[], None] = lambda: None) -> None:
        del data, check

    def close(self) -> None:
        """Nothing to release."""


class WorkerGroup:
    """Ranks `ranks` of `config`'s group on this host, started now (module docstring):
    `store_addr` is the group's TCP store (HOST:PORT)."""

    def __init__(self, config: EngineConfig, ranks: Sequence[int], store_addr: str) -> None:
        self.ring: RingWriter | _NoRing = RingWriter(len(ranks)) if ranks else _NoRing()
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        per_node = config.ranks_per_node
        self.processes: list[RankProcess] = []
        try:
            for reader, rank in enumerate(ranks):
                spec = RankSpec(rank, rank % per_node, store_addr, self.ring.fd, reader,
                                config, torch.get_num_threads(), level, os.getpid())
                self.processes.append(RankProcess(
                    rank, str(rank_device(config.device, rank % per_node)),
                    module_command(RANK_MODULE, spec.arguments()), pass_fds=(self.ring.fd,)))
        except BaseException:
            self.abort()
            raise
        self._exits = select.poll()
        for process in self.processes:
            self._exits.register(process.sentinel, select.POLLIN)

    def wait_for(self, expected: str, timeout_s: float,
                 on_beat: Callable[[], None] | None = None) -> None:
        """`wait_for` over these ranks."""
        wait_for(self.processes, expected, timeout_s, on_beat)

    def first_exited(self) -> RankProcess | None:
        """A rank that has exited (one poll of every pidfd), or None while all run."""
        if not self.processes:
            return None
        ready = {fd for fd, _ in self._exits.poll(0)}
        return next((p for p in self.processes if p.sentinel in ready), None)

    def check_alive(self, grace_s: float = 0.0) -> None:
        """RankFailed naming the first rank that has exited (with the exception line of its
        stderr, if it raised), waiting up to `grace_s` for each to be seen exited."""
        if grace_s:
            for process in self.processes:
                process.join(grace_s)
        gone = self.first_exited()
        if gone is not None:
            gone.join(EXIT_GRACE_S)  # reaped: its exit code
            error = gone.error_line(traceback_only=True)
            raise RankFailed(f"{gone.describe()} exited with code {gone.exitcode}"
                             + (f": {error}" if error else ""))

    def write(self, frame: bytes | bytearray | memoryview) -> None:
        """One call into the ring for every rank; RankFailed if one exits while the ring is
        full."""
        self.ring.write(frame, self.check_alive)

    def kill(self) -> None:
        """SIGKILL every rank (their node lost its head: nothing to wait for)."""
        for process in self.processes:
            process.kill()

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for each rank to exit, then SIGTERM (and wait as long
        again for) the ones left, and release them."""
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                log.warning("%s did not stop; terminated", process.describe(),
                            extra={"event": "rank_terminated", "rank": process.rank})
                process.terminate()
                process.join(timeout_s)
        self._release()

    def abort(self) -> None:
        """After a failed start: SIGTERM the ranks at once (one may be waiting to join the
        group, where it reads no call) and release them."""
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
        self._release()

    def _release(self) -> None:
        for process in self.processes:
            process.close()
        self.ring.close()
