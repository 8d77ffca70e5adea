"""Client connections on the Unix socket: read frames, decode them, write replies.

One `Connection` per client. Its read loop hands each decoded request to a `Handler`
(the front) and never raises: a framing error is answered `bad_frame` and closes the
connection (the stream is out of sync; each generate still open on it ends with its own
`bad_frame` error frame first), a body that does not decode (nested too deeply
included) is answered `bad_request` and the connection stays open. Every error frame goes
out through `reject`, which counts it (`error_<code>` in `specctl stats`).

Writes never wait: frames go into the transport's buffer, and a client that leaves more
than `write_buffer_bytes` unsent when new output comes is cut off (`slow_reader`: its
requests are aborted, the connection is closed), so one slow reader costs nobody else
anything. A connection that has no open request and on which nothing moved either way
for `idle_timeout_s` is closed; one whose requests are still running is never idle.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec

from specd.daemon.config import DaemonConfig
from specd.ipc import messages as m
from specd.ipc.framing import ConnectionClosed, FrameCodec, FrameError
from specd.logs import log_event

log = logging.getLogger("specd.server")

# After a frame this large the front gives freed memory back to the OS (daemon/memory.py).
LARGE_FRAME_BYTES = 2**20
# A refused connection is read (and its bytes dropped) this long at most after its error
# frame, so that a request the client already sent cannot reset it before the client
# reads why (closing a socket with unread input resets it).
REFUSE_LINGER_S = 1.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Handler(Protocol):
    def on_message(self, connection: Connection, message: m.ClientMessage) -> None: ...

    def on_close(self, connection: Connection, reason: str) -> None: ...

    def has_open_requests(self, connection: Connection) -> bool: ...

    def on_large_frame(self) -> None: ...

    def end_requests(self, connection: Connection, code: str, reason: str) -> None: ...


async def start_server(on_connection: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                               Awaitable[None]],
                       listener: socket.socket, config: DaemonConfig) -> asyncio.Server:
    """Accept clients on `listener` with a listen backlog of `max_connections`.

    asyncio listens with a backlog of 100 unless told otherwise (and listens again on a
    socket systemd passed), so a burst of a few hundred connects would be refused while
    the front is busy; the kernel caps the backlog at net.core.somaxconn.
    """
    return await asyncio.start_unix_server(on_connection, sock=listener,
                                           backlog=config.max_connections)


def peer_uid(writer: asyncio.StreamWriter) -> int:
    """The uid of the process that connected (SO_PEERCRED, taken at connect time)."""
    sock = writer.get_extra_info("socket")
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                 _PEERCRED.size))
    return int(uid)


class _IdOnly(msgspec.Struct):
    """Salvages the request id of a frame that failed typed decoding, for the error reply;
    only an id a request may carry (an out-of-range one is not echoed: the reply has nil)."""

    id: m.ClientId | None = None


class Connection:
    """One client. `send` queues a frame, `reject` an error frame (counted in `counters`);
    the read loop runs in `serve`. `peer_uid`: who connected (SO_PEERCRED)."""

    def __init__(self, connection_id: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, codec: FrameCodec[m.ClientMessage],
                 config: DaemonConfig, counters: Counter[str]) -> None:
        self.connection_id = connection_id
        self.peer_uid = peer_uid(writer)
        self._reader = reader
        self._writer = writer
        self._codec = codec
        self._config = config
        self._counters = counters
        self._id_decoder = msgspec.msgpack.Decoder(_IdOnly)
        self._loop = asyncio.get_running_loop()
        self._last_activity = self._loop.time()  # a frame received or sent
        # Frames queued in this event-loop iteration, written together (one syscall for all
        # the deltas a scheduler step produced for this client).
        self._pending: list[bytes] = []
        self._is_flush_scheduled = False
        self.is_closed = False
        self.close_reason = ""
        self._handler: Handler | None = None  # set by serve

    def send(self, message: m.ServerMessage) -> None:
        """Queue one frame; never blocks. Cuts off a client that does not read."""
        if self.is_closed:
            return
        self._pending.append(self._codec.encode(message))
        self._last_activity = self._loop.time()
        if not self._is_flush_scheduled:
            self._is_flush_scheduled = True
            self._loop.call_soon(self._flush)

    def reject(self, client_id: int | None, code: str, message: str) -> None:
        """Send an error frame (`client_id` None: the connection's) and count it."""
        self._counters[f"error_{code}"] += 1
        self.send(m.Error(client_id, code, message))

    async def refuse(self, code: str, message: str) -> None:
        """Turn away a connection that is not admitted: its error frame (id nil), then our
        side shut; what the client sends meanwhile is read and dropped until it closes (at
        most REFUSE_LINGER_S), so the frame reaches it, then the connection is closed."""
        self.reject(None, code, message)
        self._flush()
        if self._writer.can_write_eof():
            self._writer.write_eof()
        try:
            async with asyncio.timeout(REFUSE_LINGER_S):
                while await self._reader.read(2**16):
                    pass
        except (TimeoutError, ConnectionError):
            pass  # the client lingers or left: either way the frame had its chance
        self.close(f"refused: {code}")

    def _flush(self) -> None:
        self._is_flush_scheduled = False
        if self.is_closed or not self._pending:
            return
        # Checked before writing: output of any size may go to a client that reads, but
        # one that left more than the limit unread since the last write is not reading.
        unsent = self._writer.transport.get_write_buffer_size()
        if unsent > self._config.write_buffer_bytes:
            self._counters["error_slow_reader"] += 1
            log_event(log, logging.WARNING, "slow_reader",
                      "client does not read its output; closing the connection",
                      connection=self.connection_id, unsent_bytes=unsent)
            self.close("slow_reader", abort=True)
            return
        data = b"".join(self._pending)
        self._pending.clear()
        self._writer.write(data)

    def close(self, reason: str, abort: bool = False, error_code: str | None = None) -> None:
        """Close once; `abort` drops unsent output (a slow reader's). `error_code`: the
        daemon closes a connection the client still reads, so each of its open generates
        first ends with an error frame of this code (None: nothing more to tell)."""
        if self.is_closed:
            return
        if error_code is not None and not abort and self._handler is not None:
            self._handler.end_requests(self, error_code, reason)
        if abort:
            self._pending.clear()
        else:
            self._flush()
            if self.is_closed:  # the flush found a slow reader and cut it off
                return
        self.is_closed = True
        self.close_reason = reason
        if abort:
            self._writer.transport.abort()
        else:
            self._writer.close()

    async def serve(self, handler: Handler) -> None:
        """Read and dispatch frames until the client leaves or breaks the protocol."""
        self._handler = handler
        reason = "closed by client"
        error_code: str | None = None  # the code open generates end with (None: none left)
        try:
            await self._read_loop(handler)
        except ConnectionClosed:
            pass
        except TimeoutError:
            reason = "idle timeout"
            self.reject(None, "bad_frame", f"idle: no request open and nothing sent or "
                        f"received for {self._config.idle_timeout_s:g} s")
        except FrameError as exc:
            reason = f"bad frame: {exc}"
            error_code = "bad_frame"
            self.reject(None, "bad_frame", str(exc))
        except (ConnectionResetError, BrokenPipeError) as exc:
            reason = f"connection lost: {exc!r}"
        except Exception:  # noqa: BLE001 - a bug here must cost this connection only
            log.exception("internal error reading from a client",
                          extra={"event": "internal_error", "connection": self.connection_id})
            reason = "internal error"
            error_code = "internal_error"
            self.reject(None, "internal_error", "internal error; see the log")
        finally:
            reason = self.close_reason or reason
            self.close(reason, error_code=error_code)
            handler.on_close(self, reason)

    async def _read_loop(self, handler: Handler) -> None:
        while not self.is_closed:
            try:
                body = await self._codec.read_body(
                    self._reader, self._idle_wait(), self._config.frame_timeout_s)
            except TimeoutError:
                if handler.has_open_requests(self):
                    self._last_activity = self._loop.time()  # waiting on output is not idle
                    continue
                if self._idle_wait() == 0.0:
                    raise
                continue  # output went out meanwhile: idle since then
            self._last_activity = self._loop.time()
            self._dispatch(handler, body)
            if len(body) >= LARGE_FRAME_BYTES:
                handler.on_large_frame()

    def _idle_wait(self) -> float | None:
        """Seconds until this connection counts as idle (None: never)."""
        if self._config.idle_timeout_s is None:
            return None
        return max(0.0, self._last_activity + self._config.idle_timeout_s - self._loop.time())

    def _dispatch(self, handler: Handler, body: bytes) -> None:
        try:
            message = self._codec.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError and NestingTooDeep included
            self.reject(self._salvage_id(body), "bad_request", str(exc))
            return
        handler.on_message(self, message)

    def _salvage_id(self, body: bytes) -> int | None:
        try:
            return self._id_decoder.decode(body).id
        except (msgspec.DecodeError, RecursionError):
            return None  # no usable id: the error belongs to the connection
