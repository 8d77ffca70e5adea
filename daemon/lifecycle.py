"""The front's states, and every sd_notify call it makes, in one place (the service
manager's view of us).

States: starting (scheduler loading; generate answers `starting`) -> ready -> draining
(no new requests; `shutting_down`) -> exit 0, or -> failed (scheduler died, hung, raised,
or was built from other code) -> exit 75 / 78 after every open request got an error frame.

Sequence under `Type=notify`: STATUS at each start-up stage with EXTEND_TIMEOUT while the
scheduler loads and warms up; READY=1 once, after Ready arrived and was accepted; WATCHDOG=1
at the watchdog interval only while the scheduler makes progress (or is idle); STOPPING=1
when a drain begins; a last STATUS naming the failure before a failing exit. While the
scheduler does not answer, STATUS says `unresponsive: ...` until it does (or the hang
timeout fails the daemon); while an idle engine holds open requests, `stalled: ...`.
"""

from __future__ import annotations

import enum

from specd.daemon.sdnotify import Notifier

STARTUP_EXTEND_S = 60.0  # each extension covers this much; sent every STARTUP_EXTEND_S / 3


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class Lifecycle:
    """Wraps a `Notifier` with the front's events."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.is_ready = False
        self.is_draining = False
        self._last_status = ""

    @property
    def watchdog_interval(self) -> float | None:
        return self.notifier.watchdog_interval

    def starting(self, stage: str) -> None:
        """A start-up stage began (front or scheduler); keeps the start timeout open."""
        self.notifier.status(f"starting: {stage}")
        self.notifier.extend_timeout(STARTUP_EXTEND_S)

    def still_starting(self, stage: str, elapsed_s: float) -> None:
        """Periodic, while the scheduler loads or warms up."""
        self.notifier.status(f"starting: {stage} ({elapsed_s:.0f} s)")
        self.notifier.extend_timeout(STARTUP_EXTEND_S)

    def ready(self, summary: str) -> None:
        self.is_ready = True
        self._status(f"serving: {summary}")
        self.notifier.ready()

    def alive(self, is_making_progress: bool, summary: str) -> None:
        """Called every watchdog tick; pings only while the scheduler makes progress.
        STATUS is sent only when the summary changed."""
        if is_making_progress:
            self.notifier.watchdog()
            self.serving(summary)

    def serving(self, summary: str) -> None:
        """STATUS back to serving (not while draining); sent only when it changed."""
        if not self.is_draining:
            self._status(f"serving: {summary}")

    def unresponsive(self, detail: str) -> None:
        """The scheduler owes an answer (status `unresponsive`); STATUS says so at once,
        WATCHDOG=1 stops only at the hang timeout (`alive`)."""
        self._status(f"unresponsive: {detail}")

    def stalled(self, detail: str) -> None:
        """An idle engine holds open requests (status `stalled`); STATUS says so at once,
        the reconciliation ends those requests after the hang timeout."""
        self._status(f"stalled: {detail}")

    def unreachable(self, detail: str) -> None:
        """New clients cannot connect: the socket file is gone (status `unreachable`)."""
        self._status(f"unreachable: {detail}")

    def draining(self, num_open: int, timeout_s: float) -> None:
        self.is_draining = True
        self.notifier.stopping()
        self._status(f"draining: {num_open} requests in flight")
        self.notifier.extend_timeout(timeout_s + STARTUP_EXTEND_S)

    def failed(self, cause: str) -> None:
        self._status(f"FAILED: {cause}")

    def _status(self, text: str) -> None:
        if text != self._last_status:
            self._last_status = text
            self.notifier.status(text)
