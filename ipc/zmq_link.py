"""The front <-> scheduler link: two ZeroMQ PUSH/PULL pairs over ipc:// in a private directory.

`LinkPaths` defines every address once. Each front makes its own directory,
`link-<front pid>-<random>`, so that one whose front was killed (`kill -9` runs no cleanup)
can be told from a live daemon's and removed at the next start (`remove_stale_links`).
`TypedSocket` is the one typed wrapper: msgspec encode on send, typed decode on receive,
for any socket kind and either side.

Why PUSH/PULL: each direction has exactly one writer and one reader, and messages must
arrive in order. The front binds both sockets (it owns the runtime directory and starts
first); the scheduler connects. ZeroMQ never reports a dead peer, so liveness comes from
the process sentinel and the progress watchdog, not from here. `LINGER=0`: closing never
waits for undelivered messages (a dead peer must not block shutdown). A bounded send
high-water mark with non-blocking sends turns a scheduler that stops reading into
`overloaded` instead of a blocked event loop.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")

SEND_HIGH_WATER_MARK = 100_000  # messages queued towards a peer before sends fail
LINK_DIR_PREFIX = "link-"


@dataclass(frozen=True)
class LinkPaths:
    """All filesystem paths of one front/scheduler pair, under a private (0700) directory."""

    runtime_dir: Path

    @classmethod
    def create(cls, base_dir: Path) -> LinkPaths:
        """A fresh 0700 directory `link-<this pid>-<random>` under `base_dir`."""
        prefix = f"{LINK_DIR_PREFIX}{os.getpid()}-"
        return cls(Path(tempfile.mkdtemp(prefix=prefix, dir=base_dir)))

    @property
    def owner_pid(self) -> int | None:
        """The pid of the front that made this directory (None: not named by `create`)."""
        pid, sep, _ = self.runtime_dir.name.removeprefix(LINK_DIR_PREFIX).partition("-")
        is_ours = self.runtime_dir.name.startswith(LINK_DIR_PREFIX) and sep and pid.isdigit()
        return int(pid) if is_ours else None

    @property
    def to_scheduler(self) -> str:
        return f"ipc://{self.runtime_dir / 'to-scheduler.sock'}"

    @property
    def from_scheduler(self) -> str:
        return f"ipc://{self.runtime_dir / 'from-scheduler.sock'}"

    @property
    def stack_dump_file(self) -> Path:
        """Where the scheduler's faulthandler writes all thread stacks on SIGUSR1."""
        return self.runtime_dir / "scheduler-stacks.txt"


def remove_stale_links(base_dir: Path) -> tuple[list[Path], list[tuple[Path, OSError]]]:
    """Remove the link directories under `base_dir` whose front process is gone.

    Returns (removed, failed with the error). A directory whose owner pid is alive (a
    running daemon, or a process that reused the pid) or whose name carries no pid is
    left alone: a live daemon's link is never touched.
    """
    removed: list[Path] = []
    failed: list[tuple[Path, OSError]] = []
    for path in sorted(base_dir.glob(f"{LINK_DIR_PREFIX}*")):
        pid = LinkPaths(path).owner_pid
        if pid is None or not path.is_dir() or path.is_symlink() or _is_alive(pid):
            continue
        try:
            shutil.rmtree(path)
        except OSError as exc:
            failed.append((path, exc))
        else:
            removed.append(path)
    return removed, failed


def _is_alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie or another user's process counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LinkSendError(Exception):
    """A non-blocking send found the peer's queue full (or the socket closed)."""


class TypedSocket(Generic[T]):
    """A ZeroMQ socket that sends msgspec Structs and receives the tagged union `recv_type`.

    Works for plain sockets (blocking `recv`) and zmq.asyncio sockets (`recv_async`).
    Not thread-safe, like the ZeroMQ socket it wraps: one thread uses it.
    """

    def __init__(self, socket: zmq.Socket[Any], recv_type: Any) -> None:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        self.socket = socket
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(recv_type)

    @classmethod
    def bind(cls, context: zmq.Context[Any], kind: int, address: str,
             recv_type: Any = None) -> TypedSocket[T]:
        sock = cls(context.socket(kind), recv_type)
        sock.socket.bind(address)
        return sock

    @classmethod
    def connect(cls, context: zmq.Context[Any], kind: int, address: str,
                recv_type: Any = None) -> TypedSocket[T]:
        sock = cls(context.socket(kind), recv_type)
        sock.socket.connect(address)
        return sock

    def send(self, message: Any, block: bool = True) -> None:
        """Encode and send. With block=False raises LinkSendError instead of waiting."""
        data = self._encoder.encode(message)
        try:
            self.socket.send(data, 0 if block else zmq.NOBLOCK, copy=False)
        except zmq.Again as exc:
            raise LinkSendError("the peer's queue is full") from exc

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Blocking receive and decode; None when nothing came within `timeout_ms`."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms, zmq.POLLIN):
            return None
        return self._decoder.decode(self.socket.recv(copy=True))

    async def recv_async(self) -> T:
        """Receive and decode on an asyncio socket."""
        data = await self.socket.recv()  # type: ignore[misc]  # zmq.asyncio returns a Future
        return self._decoder.decode(data)

    def close(self) -> None:
        self.socket.close(linger=0)


def async_context() -> zmq.asyncio.Context:
    """A fresh context for the front's asyncio sockets (never shared across processes)."""
    return zmq.asyncio.Context()
