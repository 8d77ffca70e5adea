"""The front's listening Unix socket: taken from systemd socket activation, or bound here.

Socket activation (sd_listen_fds(3)): systemd (or `systemd-socket-activate`) creates and listens
on the socket, then starts us with it as fd 3 and `LISTEN_FDS=1`, `LISTEN_PID=<our pid>`,
`LISTEN_FDNAMES=<name>`. Clients that connect before the model has loaded wait in the backlog
instead of failing, and the socket survives restarts of the service.

Without activation the daemon binds its own socket. A socket file left by a crashed daemon is
removed only after `connect()` to it is refused; when something answers, another daemon is
alive and we refuse to steal its address.

Both functions return a listening, blocking AF_UNIX stream socket, ready for
`asyncio.start_unix_server(handler, sock=sock)` (which makes it non-blocking).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat

logger = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3  # sd_listen_fds(3): passed descriptors start at fd 3
ACTIVATION_ENV_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
# How long a probe of an existing socket file waits for an answer. A live daemon's kernel
# backlog accepts a connect at once even while the daemon is busy loading.
PROBE_TIMEOUT_S = 1.0


class SocketInUseError(RuntimeError):
    """A live process answers on the socket path we were asked to bind."""


def listening_socket_from_env() -> socket.socket | None:
    """The socket systemd passed us, or None when we were not socket-activated.

    Not activated means `LISTEN_PID` is absent or names another process (we inherited the
    variables). When it names us, exactly one descriptor must be passed and it must be a
    listening AF_UNIX stream socket; otherwise ValueError says what was passed instead.
    The `LISTEN_*` variables are removed from os.environ either way, so that children we
    spawn do not think they were activated, and the descriptor is made non-inheritable.
    """
    listen_pid = os.environ.get("LISTEN_PID")
    listen_fds = os.environ.get("LISTEN_FDS")
    fd_names = os.environ.get("LISTEN_FDNAMES")
    for name in ACTIVATION_ENV_VARS:
        os.environ.pop(name, None)
    if not listen_pid or not listen_fds:
        return None
    if not listen_pid.isdigit() or int(listen_pid) != os.getpid():
        logger.info("LISTEN_PID=%s is not our pid %d; binding our own socket",
                    listen_pid, os.getpid())
        return None
    if listen_fds != "1":
        raise ValueError(
            f"LISTEN_FDS={listen_fds!r} (names {fd_names!r}): specd expects exactly one "
            "listening socket; give the .socket unit a single ListenStream="
        )
    fd = SD_LISTEN_FDS_START
    try:
        os.fstat(fd)
    except OSError as exc:
        raise ValueError(f"LISTEN_FDS=1 but fd {fd} is not open: {exc}") from exc
    os.set_inheritable(fd, False)
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:  # ENOTSOCK: a file or pipe sits at fd 3
        raise ValueError(f"socket-activated fd {fd} is not a socket: {exc}") from exc
    problem = _listening_unix_stream_problem(sock)
    if problem is not None:
        sock.detach()  # leave fd 3 to its owner; we only refused to use it
        raise ValueError(f"socket-activated fd {fd} (LISTEN_FDNAMES={fd_names!r}) {problem}")
    logger.info("using socket-activated listener fd %d (%s) at %r", fd, fd_names,
                sock.getsockname())
    return sock


def _listening_unix_stream_problem(sock: socket.socket) -> str | None:
    """What makes `sock` unusable as our listener, or None when it is fine."""
    if sock.family != socket.AF_UNIX:
        return f"is family {sock.family!r}, expected AF_UNIX (ListenStream=/path)"
    if sock.type != socket.SOCK_STREAM:
        return f"is type {sock.type!r}, expected SOCK_STREAM (ListenStream=, not ListenDatagram=)"
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        return "is not listening (Accept=no and ListenStream= in the .socket unit)"
    return None


def bind_unix_socket(
    path: str, mode: int = 0o660, backlog: int = socket.SOMAXCONN
) -> socket.socket:
    """Bind and listen on `path`, replacing a stale socket file left by a dead daemon.

    Raises SocketInUseError when a process answers on `path` (another daemon is alive), and
    FileExistsError when `path` exists but is not a socket (we never delete other files).
    `mode` is applied with chmod right after bind; until then the process umask applies, which
    under the unit's UMask=0077 is stricter, never looser.
    """
    _remove_if_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(path)
        os.chmod(path, mode)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    logger.info("listening on %s (mode %o)", path, mode)
    return sock


def _remove_if_stale(path: str) -> None:
    """Unlink `path` when it is a socket that nobody answers on; see bind_unix_socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a socket; not removing it", path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        logger.warning("removing stale socket %s: nothing answers on it", path)
        os.unlink(path)
        return
    except FileNotFoundError:
        return  # removed between lstat and connect
    except (TimeoutError, BlockingIOError) as exc:
        # A full backlog: someone is there, just slow to accept.
        raise SocketInUseError(f"{path}: a process is listening but not accepting ({exc}); "
                               "is another specd running?") from exc
    finally:
        probe.close()
    raise SocketInUseError(f"{path}: another process answers on this socket; is another specd "
                           "running? Stop it or choose another socket path.")
