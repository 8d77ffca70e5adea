"""Whether clients can still reach the daemon: its socket file, checked every second.

A listening Unix socket keeps working after its file is removed (`rm`, a tmpfiles
clean-up of `$XDG_RUNTIME_DIR`, systemd removing a runtime directory): old connections
are served, but a new client gets ENOENT, as if no daemon ran. `SocketWatch` remembers the
file it listens on (device and inode) and compares every CHECK_S:

* removed, and bound by this daemon: a fresh listening socket is bound at the path (the
  front serves it beside the old one); one WARNING record `socket_recreated`;
* removed, and systemd's (socket activation: a socket bound here would be gone at the next
  start, while systemd's listens on at a path no one can open): not re-created; one
  ERROR record `socket_missing`, the problem `socket_missing`, and the daemon reports
  itself `unreachable` (`/health` 503, systemd's STATUS) until it exits;
* replaced by another file (another daemon's socket): left alone, reported the same way.

At exit the file is removed only when it is still the one this daemon bound. No torch is
imported here.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from specd.daemon.activation import bind_unix_socket
from specd.daemon.incidents import Incidents
from specd.logs import log_event

log = logging.getLogger("specd.front")

CHECK_S = 1.0


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, None when there is none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class SocketWatch:
    """The socket file at `path` that `listener` listens on; `is_owned`: bound by this
    daemon (not systemd's). `mode` and `backlog`: what a re-created socket gets."""

    def __init__(self, listener: socket.socket, is_owned: bool, mode: int, backlog: int
                 ) -> None:
        name = listener.getsockname()
        # An abstract or unnamed socket has no file to lose ("" or a name led by NUL).
        self.path = Path(name) if isinstance(name, str) and name[:1] not in ("", "\0") \
            else None
        self.is_owned = is_owned
        self.mode = mode
        self.backlog = backlog
        self.identity = None if self.path is None else _identity(self.path)
        self.last_check = 0.0
        self.lost = ""  # why clients cannot reach the daemon ("": they can)

    def check(self, now: float, problems: Incidents) -> socket.socket | None:
        """Compare the file with the one bound (every CHECK_S); returns a socket bound anew
        for the front to serve when the file was removed and it was ours. A loss is logged
        and recorded in `problems` once."""
        if (self.path is None or self.identity is None or self.lost
                or now - self.last_check < CHECK_S):
            return None
        self.last_check = now
        current = _identity(self.path)
        if current == self.identity:
            return None
        if current is None and self.is_owned:
            return self._recreate(self.path, problems)
        what = ("was removed" if current is None
                else "was replaced by another file (not this daemon's socket)")
        self._lose(f"the socket file {self.path} {what}: new clients cannot connect; "
                   "restart specd.socket and specd", problems)
        return None

    def _recreate(self, path: Path, problems: Incidents) -> socket.socket | None:
        try:
            listener = bind_unix_socket(str(path), self.mode, self.backlog)
        except (OSError, RuntimeError) as exc:  # RuntimeError: SocketInUseError
            self._lose(f"the socket file {path} was removed and cannot be re-created "
                       f"({exc!r}): new clients cannot connect; restart specd", problems)
            return None
        self.identity = _identity(path)
        log_event(log, logging.WARNING, "socket_recreated", f"the socket file {path} was "
                  "removed; bound it again (connections open meanwhile were kept)",
                  path=str(path))
        return listener

    def _lose(self, why: str, problems: Incidents) -> None:
        self.lost = why
        log_event(log, logging.ERROR, "socket_missing", why, path=str(self.path))
        problems.record("socket_missing", why)

    def remove_if_ours(self) -> None:
        """At exit: unlink the file if this daemon bound it and it is still that file."""
        if (self.is_owned and self.path is not None and self.identity is not None
                and _identity(self.path) == self.identity):
            self.path.unlink(missing_ok=True)
