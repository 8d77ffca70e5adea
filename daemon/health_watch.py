"""The front's watch over the scheduler: start-up progress, hangs, and an idle scheduler
that stops answering (`HealthWatch`, ticked by `Front` every TICK_S).

Busy, a hang is no step output for the hang timeout; idle, no answer to the probes (an idle
scheduler blocks on its inbox, so only a question shows that it still could answer). A hang
asks for the scheduler's stacks and fails the daemon (exit 75, `Front.on_hang`). While the
scheduler owes an answer the daemon reports `unresponsive` (status, /health, systemd's
STATUS). No torch is imported here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from specd.daemon.lifecycle import STARTUP_EXTEND_S, State
from specd.exit_codes import EXIT_SCHEDULER_FAILED

if TYPE_CHECKING:
    from specd.daemon.front import Front

PROBE_INTERVAL_S = 5.0  # an idle scheduler is asked for its figures this often (at most)
# Start-up stages that send heartbeats while they progress (workers/process/stage_watch.py): silence
# for the hang timeout there is a hang. Warm-up compiles and captures without them.
WATCHED_STAGES = ("load",)
PROBE_ANSWER_S = 1.0  # an idle scheduler answers in milliseconds; later is unresponsive


class HealthWatch:
    """Times of the scheduler's last progress, last message and last probe, and what they
    mean. `check(now)` runs every tick; `progressed()` and `heard()` are called by the front
    as messages arrive."""

    def __init__(self, front: Front) -> None:
        self.front = front
        now = time.monotonic()
        self.last_progress = now
        self.last_heard = now  # the scheduler's last message of any kind
        self.last_probe = 0.0
        self.was_unresponsive = False  # STATUS said so (and must say serving again)
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
        front = self.front
        if front.state is State.STARTING:
            self._check_startup(now)
            return
        if front.state is State.FAILED:
            return
        is_busy = front.table.num_submitted > 0
        stalled_s = now - (self.last_progress if is_busy else self.last_heard)
        is_stalled = stalled_s > front.config.hang_timeout_s
        if not is_busy:
            self._probe_if_quiet(now)
        self._report_responsiveness()
        if is_stalled and not self.is_hung:
            self.is_hung = True
            front.spawn(front.on_hang(
                f"no progress for {stalled_s:.1f} s with {len(front.table)} open requests"
                if is_busy else f"no answer for {stalled_s:.1f} s while idle"))
        interval = front.lifecycle.watchdog_interval
        if interval is not None and now - self.last_watchdog >= interval:
            self.last_watchdog = now
            front.lifecycle.alive(not is_stalled, front.summary())

    def _check_startup(self, now: float) -> None:
        front = self.front
        elapsed = now - front.started
        stalled_s = now - self.last_progress
        if (front.scheduler_stage in WATCHED_STAGES and not self.is_hung
                and stalled_s > front.config.hang_timeout_s):
            self.is_hung = True
            front.spawn(front.on_hang(f"no progress for {stalled_s:.1f} s in stage "
                                      f"{front.scheduler_stage}"))
        elif elapsed > front.config.startup_timeout_s:
            front.fail(EXIT_SCHEDULER_FAILED,
                       f"scheduler sent no Ready within {front.config.startup_timeout_s:g} s "
                       f"(stage {front.scheduler_stage})")
        elif now - self.last_extend > STARTUP_EXTEND_S / 3:
            self.last_extend = now
            front.lifecycle.still_starting(f"scheduler: {front.scheduler_stage}", elapsed)

    def _probe_if_quiet(self, now: float) -> None:
        """Ask the idle scheduler for its figures when it has been quiet for a probe
        interval (a third of the hang timeout, at most PROBE_INTERVAL_S); its answer, like
        any message, moves `last_heard`."""
        interval = min(PROBE_INTERVAL_S, self.front.config.hang_timeout_s / 3)
        if now - max(self.last_heard, self.last_probe) >= interval:
            self.last_probe = now
            self.front.control.probe()

    def _report_responsiveness(self) -> None:
        """STATUS=unresponsive while the scheduler owes an answer, serving again after."""
        front = self.front
        if front.state is not State.READY:
            return
        if self.is_unresponsive:
            self.was_unresponsive = True
            front.lifecycle.unresponsive(f"the scheduler did not answer; process "
                                         f"{front.scheduler.pid} is "
                                         f"{front.scheduler.process_state()}")
        elif self.was_unresponsive:
            self.was_unresponsive = False
            front.lifecycle.serving(front.summary())

    @property
    def is_unresponsive(self) -> bool:
        """The scheduler owes an answer: a probe went unanswered for PROBE_ANSWER_S, or its
        process is stopped (SIGSTOP, a debugger)."""
        if self.front.state not in (State.READY, State.DRAINING):
            return False
        unanswered = (self.last_probe > self.last_heard
                      and time.monotonic() - self.last_probe > PROBE_ANSWER_S)
        return unanswered or self.front.scheduler.is_stopped
