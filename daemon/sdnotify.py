"""sd_notify(3) in pure Python: tell systemd about start-up, readiness, liveness and shutdown.

The protocol (declared stable by systemd): one datagram per message, sent to the AF_UNIX
datagram socket named by `$NOTIFY_SOCKET`, holding newline-separated `KEY=VALUE` lines. An
address starting with `/` is a filesystem socket; one starting with `@` lives in the abstract
namespace (the `@` stands for a leading NUL byte). Without `$NOTIFY_SOCKET` we are not running
under a `Type=notify` unit and every method is a no-op that returns False.

The watchdog interval comes from `$WATCHDOG_USEC`; `$WATCHDOG_PID`, when set, names the process
meant to ping, so a child that inherited the variables does not ping in its parent's name.
systemd kills the service when no `WATCHDOG=1` arrives within `WATCHDOG_USEC`; we ping at half
of it (sd_watchdog_enabled(3) recommends that margin).

Contract for callers (the front process):
* `status(text)` at every start-up stage, `extend_timeout(s)` periodically while loading and
  warming up, `ready()` only after the scheduler's warm-up succeeded, `watchdog()` every
  `watchdog_interval` seconds *only while the scheduler makes progress*, `stopping()` when a
  drain begins.
* Sends never raise: a failed send is logged as a warning the first time (with the address
  and the error) and counted in `num_send_failures`; later failures are logged at debug
  level. A lost `READY=1` or `WATCHDOG=1` shows up as a systemd timeout, whose journal entry
  sits next to that warning.
* Processes spawned by the front should get `child_environ()`, so that they neither inherit
  the notify socket nor the watchdog settings.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# Variables systemd hands a service that must not leak into the processes it spawns
# (sd_notify(3) unset_environment, sd_listen_fds(3)).
SYSTEMD_SERVICE_ENV_VARS = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
)

# A send blocks only when systemd's receive queue is full; systemd drains it promptly, so a
# short bound keeps the event loop from stalling while giving READY=1 every chance to arrive.
SEND_TIMEOUT_S = 1.0


def child_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `environ` (default: os.environ) without the systemd service variables."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if k not in SYSTEMD_SERVICE_ENV_VARS}


def parse_notify_address(value: str) -> str | bytes:
    """Turn a `$NOTIFY_SOCKET` value into an address for `socket.sendto`.

    Raises ValueError for anything but `/absolute/path` or `@abstract-name`; systemd's `vsock:`
    addresses (virtual machines) are not supported.
    """
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        # Linux abstract namespace: the name is the bytes after a leading NUL.
        return b"\0" + value[1:].encode()
    raise ValueError(
        f"NOTIFY_SOCKET={value!r}: expected an absolute path or an @abstract name"
    )


def parse_watchdog_interval(
    usec: str | None, watchdog_pid: str | None, own_pid: int
) -> float | None:
    """Seconds between pings (half of WATCHDOG_USEC), or None when the watchdog is not ours.

    Raises ValueError when WATCHDOG_USEC or WATCHDOG_PID is not a positive integer.
    """
    if not usec:
        return None
    if watchdog_pid:
        if not watchdog_pid.isdigit() or int(watchdog_pid) <= 0:
            raise ValueError(f"WATCHDOG_PID={watchdog_pid!r}: expected a positive integer")
        if int(watchdog_pid) != own_pid:
            return None
    if not usec.isdigit() or int(usec) <= 0:
        raise ValueError(f"WATCHDOG_USEC={usec!r}: expected a positive integer of microseconds")
    return int(usec) / 2 / 1_000_000


class Notifier:
    """Sends sd_notify messages to one address; a no-op when `address` is None."""

    def __init__(self, address: str | bytes | None, watchdog_interval: float | None) -> None:
        self.address = address
        self.enabled: bool = address is not None
        # Seconds between WATCHDOG=1 pings, or None when systemd runs no watchdog for us.
        self.watchdog_interval: float | None = watchdog_interval
        self.num_send_failures = 0
        self._socket: socket.socket | None = None
        if address is not None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.settimeout(SEND_TIMEOUT_S)

    @classmethod
    def from_env(cls) -> Notifier:
        """Build from `$NOTIFY_SOCKET`, `$WATCHDOG_USEC` and `$WATCHDOG_PID`.

        Malformed values are logged as warnings and treated as absent (the daemon then runs as
        if not under systemd, and systemd's own timeout reports the problem); they never raise.
        """
        address: str | bytes | None = None
        raw_address = os.environ.get("NOTIFY_SOCKET")
        if raw_address:
            try:
                address = parse_notify_address(raw_address)
            except ValueError as exc:
                logger.warning("sd_notify disabled: %s", exc)
        interval: float | None = None
        try:
            interval = parse_watchdog_interval(
                os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID"), os.getpid()
            )
        except ValueError as exc:
            logger.warning("systemd watchdog ignored: %s", exc)
        # Pings without a socket to send them to would be meaningless.
        return cls(address, interval if address is not None else None)

    def notify(self, *fields: str) -> bool:
        """Send `KEY=VALUE` fields as one datagram. True when it was sent."""
        if self._socket is None or self.address is None:
            return False
        payload = "\n".join(fields).encode()
        try:
            self._socket.sendto(payload, self.address)
        except OSError as exc:
            self._log_send_failure(fields, exc)
            return False
        return True

    def status(self, text: str) -> bool:
        """`STATUS=text`: the one line `systemctl status` shows. Newlines become spaces."""
        return self.notify("STATUS=" + " ".join(text.splitlines()))

    def ready(self) -> bool:
        """`READY=1`: start-up finished; send only after warm-up succeeded."""
        return self.notify("READY=1")

    def stopping(self) -> bool:
        """`STOPPING=1`: shutdown (drain) began."""
        return self.notify("STOPPING=1")

    def extend_timeout(self, seconds: float) -> bool:
        """`EXTEND_TIMEOUT_USEC`: the current start/stop timeout now ends `seconds` from now at
        the earliest; send again before that to keep extending. Raises ValueError if seconds <= 0.
        """
        if not seconds > 0:
            raise ValueError(f"extend_timeout: seconds must be > 0, got {seconds!r}")
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def watchdog(self) -> bool:
        """`WATCHDOG=1`: keep-alive; call every `watchdog_interval` while healthy."""
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        """Close the sending socket; later sends are no-ops."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _log_send_failure(self, fields: tuple[str, ...], exc: OSError) -> None:
        self.num_send_failures += 1
        if self.num_send_failures == 1:
            logger.warning(
                "sd_notify to %r failed (%s) sending %s; later failures are logged at debug level",
                self.address, exc, ", ".join(fields),
            )
        else:
            logger.debug("sd_notify failure %d: %s (%s)", self.num_send_failures, exc, fields)
