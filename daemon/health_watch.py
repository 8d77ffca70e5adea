"""The front's watch over the scheduler: start-up progress, hangs, an idle scheduler that
stops answering, and an idle engine that holds open requests (`HealthWatch`, ticked by
`Front` every TICK_S).

Busy, a hang is no step output for the hang timeout; idle, no answer to the probes (an idle
scheduler blocks on its inbox, so only a question shows that it still could answer). The
probe is the reconciliation's question (daemon/reconcile.py), sent every probe interval,
busy or not; its answer counts as progress (the loop is alive between steps; an engine that
answers but does not step is the reconciliation's business: `stalled`). A hang asks for the
scheduler's stacks and fails the daemon with them (exit 75). While the scheduler owes an
answer the daemon reports `unresponsive`, while the last answer showed an idle engine
holding open requests `stalled`, and once new clients cannot reach its socket file
`unreachable` (status, /health, systemd's STATUS). No torch is imported here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sized
from typing import Protocol

from specd.daemon.config import DaemonConfig
from specd.daemon.front_status import FrontStatus, Spawn
from specd.daemon.lifecycle import STARTUP_EXTEND_S, Lifecycle, State
from specd.daemon.request_table import RequestTable
from specd.daemon.scheduler_handle import SchedulerHandle
from specd.exit_codes import EXIT_SCHEDULER_FAILED

STACK_DUMP_WAIT_S = 0.5  # a hung scheduler's faulthandler writes its stacks within this
PROBE_INTERVAL_S = 5.0  # an idle scheduler is asked for its figures this often (at most)
# Start-up stages that send heartbeats while they progress (workers/process/stage_watch.py): silence
# for the hang timeout there is a hang. Warm-up compiles and captures without them.
WATCHED_STAGES = ("load",)
PROBE_ANSWER_S = 1.0  # an idle scheduler answers in milliseconds; later is unresponsive


def probe_interval_s(config: DaemonConfig) -> float:
    """How often the scheduler is asked (a third of the hang timeout, at most
    PROBE_INTERVAL_S); also how long an engine holding requests may sit idle before the
    daemon says `stalled`."""
    return min(PROBE_INTERVAL_S, config.hang_timeout_s / 3)


class Fail(Protocol):
    """The front's end on a dead or useless scheduler (`Front.fail`): every open request
    gets an error frame, then the front exits with `code`."""

    def __call__(self, code: int, cause: str, traceback: str | None = None) -> None: ...


class HealthWatch:
    """Times of the scheduler's last progress, last message and last probe, and what they
    mean. `check(now)` runs every tick; `progressed()` and `heard()` are called by the front
    as messages arrive.

    Reads the front's `status`, its request `table` and `connections` (how many), and the
    `scheduler`'s process; tells systemd through `lifecycle`; asks the scheduler with
    `probe()`, learns from `stalled_ids()` which open requests an idle engine holds and
    from `unreachable()` why new clients cannot connect ("": they can; socket_watch.py). A
    start-up without Ready ends in `fail`, and so does a hang, after the dump of the
    scheduler's stacks (a task, run through `spawn`)."""

    def __init__(self, config: DaemonConfig, status: FrontStatus, table: RequestTable,
                 connections: Sized, lifecycle: Lifecycle, scheduler: SchedulerHandle, *,
                 probe: Callable[[], None], stalled_ids: Callable[[], list[str]],
                 unreachable: Callable[[], str], spawn: Spawn, fail: Fail) -> None:
        self.config = config
        self.status = status
        self.table = table
        self.connections = connections
        self.lifecycle = lifecycle
        self.scheduler = scheduler
        self.probe = probe
        self.stalled_ids = stalled_ids
        self.unreachable = unreachable
        self.spawn = spawn
        self.fail = fail
        now = time.monotonic()
        self.last_progress = now
        self.last_heard = now  # the scheduler's last message of any kind
        self.last_probe = 0.0
        self.was_degraded = False  # STATUS said unresponsive, stalled or unreachable
        self.last_watchdog = 0.0
        self.last_extend = now
        self.is_hung = False

    def progressed(self) -> None:
        """The scheduler moved (or had no work until now): the hang watchdog restarts."""
        self.last_progress = time.monotonic()

    def heard(self) -> None:
        """A message of any kind arrived from the scheduler."""
        self.last_heard = time.monotonic()

    def check(self, now: float) -> None:
        """Start-up: a watched stage without heartbeats, or no Ready in time, fails; else
        systemd hears that start-up goes on. Serving: a stall fails; the systemd watchdog
        is fed while there is none."""
        status = self.status
        if status.state is State.STARTING:
            self._check_startup(now)
            return
        if status.state is State.FAILED:
            return
        is_busy = self.table.num_submitted > 0
        stalled_s = now - (self.last_progress if is_busy else self.last_heard)
        is_stalled = stalled_s > self.config.hang_timeout_s
        if now - self.last_probe >= probe_interval_s(self.config):
            self.last_probe = now
            self.probe()
        self._report_responsiveness()
        if is_stalled and not self.is_hung:
            self.is_hung = True
            self.spawn(self._fail_hung(
                f"no progress for {stalled_s:.1f} s with {len(self.table)} open requests"
                if is_busy else f"no answer for {stalled_s:.1f} s while idle"))
        interval = self.lifecycle.watchdog_interval
        if interval is not None and now - self.last_watchdog >= interval:
            self.last_watchdog = now
            self.lifecycle.alive(not is_stalled, self.summary())

    def _check_startup(self, now: float) -> None:
        status = self.status
        elapsed = now - status.started
        stalled_s = now - self.last_progress
        if (status.scheduler_stage in WATCHED_STAGES and not self.is_hung
                and stalled_s > self.config.hang_timeout_s):
            self.is_hung = True
            self.spawn(self._fail_hung(f"no progress for {stalled_s:.1f} s in stage "
                                       f"{status.scheduler_stage}"))
        elif elapsed > self.config.startup_timeout_s:
            self.fail(EXIT_SCHEDULER_FAILED,
                      f"scheduler sent no Ready within {self.config.startup_timeout_s:g} s "
                      f"(stage {status.scheduler_stage})")
        elif now - self.last_extend > STARTUP_EXTEND_S / 3:
            self.last_extend = now
            self.lifecycle.still_starting(f"scheduler: {status.scheduler_stage}", elapsed)

    async def _fail_hung(self, what: str) -> None:
        """Dump the scheduler's stacks (faulthandler, SIGUSR1), then fail with them (75)."""
        scheduler = self.scheduler
        scheduler.request_stack_dump()
        await asyncio.sleep(STACK_DUMP_WAIT_S)
        stacks = scheduler.read_stack_dump() or "(no stack dump: the process did not answer)"
        self.fail(EXIT_SCHEDULER_FAILED,
                  f"scheduler hung: {what}; process {scheduler.pid} is "
                  f"{scheduler.process_state()}", traceback=stacks)

    def _report_responsiveness(self) -> None:
        """STATUS=unresponsive while the scheduler owes an answer, stalled while an idle
        engine holds open requests, unreachable once the socket file is gone, serving again
        after."""
        if self.status.state is not State.READY:
            return
        stalled = self.stalled_ids()
        if self.is_unresponsive:
            self.was_degraded = True
            self.lifecycle.unresponsive(f"the scheduler did not answer; process "
                                        f"{self.scheduler.pid} is "
                                        f"{self.scheduler.process_state()}")
        elif stalled:
            self.was_degraded = True
            self.lifecycle.stalled(f"the engine runs no step while it holds "
                                   f"{len(stalled)} open requests ({', '.join(stalled[:5])})")
        elif self.unreachable():
            self.was_degraded = True
            self.lifecycle.unreachable(self.unreachable())
        elif self.was_degraded:
            self.was_degraded = False
            self.lifecycle.serving(self.summary())

    def summary(self) -> str:
        """One line for systemd's STATUS: open requests and connections."""
        return f"{len(self.table)} open requests, {len(self.connections)} connections"

    @property
    def is_unresponsive(self) -> bool:
        """The scheduler owes an answer: idle, a probe went unanswered for PROBE_ANSWER_S
        (busy, a long step delays the answer: the hang watchdog judges that), or its
        process is stopped (SIGSTOP, a debugger)."""
        if self.status.state not in (State.READY, State.DRAINING):
            return False
        unanswered = (self.table.num_submitted == 0 and self.last_probe > self.last_heard
                      and time.monotonic() - self.last_probe > PROBE_ANSWER_S)
        return unanswered or self.scheduler.is_stopped

    @property
    def reported_state(self) -> str:
        """The state status and /health report: the lifecycle's; `unresponsive` while the
        scheduler owes an answer (the hang watchdog fails the daemon if it stays so);
        `stalled` while the last answer showed an idle engine holding open requests (they
        end after the hang timeout: daemon/reconcile.py); `unreachable` once the socket file
        clients connect to is gone and could not be re-created (socket_watch.py)."""
        if self.is_unresponsive:
            return "unresponsive"
        if self.status.state is State.READY and self.stalled_ids():
            return "stalled"
        if self.status.state is State.READY and self.unreachable():
            return "unreachable"
        return self.status.state.value
