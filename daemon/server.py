"""Client connections on the Unix socket: read frames, decode them, write replies.

One `Connection` per client. Its read loop hands each decoded request to a `Handler`
(the front) and never raises: a framing error is answered `bad_frame` and closes the
connection (the stream is out of sync), a body that does not decode is answered
`bad_request` and the connection stays open. Writes never wait: frames go into the
transport's buffer, and a client whose unread output passes `write_buffer_bytes` is cut
off (`slow_reader`: its requests are aborted, the connection is closed), so one slow reader
costs nobody else anything.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import msgspec

from specd.daemon.config import DaemonConfig
from specd.daemon.logs import log_event
from specd.ipc import messages as m
from specd.ipc.framing import ConnectionClosed, FrameCodec, FrameError

log = logging.getLogger("specd.server")


class Handler(Protocol):
    def on_message(self, connection: Connection, message: m.ClientMessage) -> None: ...

    def on_close(self, connection: Connection, reason: str) -> None: ...


class _IdOnly(msgspec.Struct):
    """Salvages the request id of a frame that failed typed decoding, for the error reply."""

    id: int | None = None


class Connection:
    """One client. `send` queues a frame; the read loop runs in `serve`."""

    def __init__(self, connection_id: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, codec: FrameCodec[m.ClientMessage],
                 config: DaemonConfig) -> None:
        self.connection_id = connection_id
        self._reader = reader
        self._writer = writer
        self._codec = codec
        self._config = config
        self._id_decoder = msgspec.msgpack.Decoder(_IdOnly)
        self._loop = asyncio.get_running_loop()
        # Frames queued in this event-loop iteration, written together (one syscall for all
        # the deltas a scheduler step produced for this client).
        self._pending: list[bytes] = []
        self._is_flush_scheduled = False
        self.is_closed = False
        self.close_reason = ""

    def send(self, message: m.ServerMessage) -> None:
        """Queue one frame; never blocks. Cuts off a client that does not read."""
        if self.is_closed:
            return
        self._pending.append(self._codec.encode(message))
        if not self._is_flush_scheduled:
            self._is_flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._is_flush_scheduled = False
        if self.is_closed or not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        self._writer.write(data)
        if self._writer.transport.get_write_buffer_size() > self._config.write_buffer_bytes:
            log_event(log, logging.WARNING, "slow_reader",
                      "client does not read its output; closing the connection",
                      connection=self.connection_id)
            self.close("slow_reader", abort=True)

    def close(self, reason: str, abort: bool = False) -> None:
        """Close once; `abort` drops unsent output (a slow reader's)."""
        if self.is_closed:
            return
        if not abort:
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
        reason = "closed by client"
        try:
            while not self.is_closed:
                body = await self._codec.read_body(
                    self._reader, self._config.idle_timeout_s, self._config.frame_timeout_s)
                self._dispatch(handler, body)
        except ConnectionClosed:
            pass
        except TimeoutError:
            reason = "idle timeout"
            self.send(m.Error(None, "bad_frame", f"no request for {self._config.idle_timeout_s} s"))
        except FrameError as exc:
            reason = f"bad frame: {exc}"
            self.send(m.Error(None, "bad_frame", str(exc)))
        except (ConnectionResetError, BrokenPipeError) as exc:
            reason = f"connection lost: {exc!r}"
        finally:
            reason = self.close_reason or reason
            self.close(reason)
            handler.on_close(self, reason)

    def _dispatch(self, handler: Handler, body: bytes) -> None:
        try:
            message = self._codec.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError included
            self.send(m.Error(self._salvage_id(body), "bad_request", str(exc)))
            return
        handler.on_message(self, message)

    def _salvage_id(self, body: bytes) -> int | None:
        try:
            return self._id_decoder.decode(body).id
        except (msgspec.DecodeError, RecursionError):
            return None  # no usable id: the error belongs to the connection
