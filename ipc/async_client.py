"""The asyncio client: `AsyncClient` multiplexes any number of requests over one
connection (errors, results and the socket path as for the blocking `Client`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import msgspec

from specd.ipc import messages as m
from specd.ipc.client import DEFAULT_TIMEOUT_S, RECV_CHUNK_BYTES
from specd.ipc.errors import (
    ClientTimeout,
    DaemonUnavailable,
    ProtocolError,
    SpecdError,
    error_from_frame,
)
from specd.ipc.framing import DEFAULT_MAX_FRAME_BYTES, FrameCodec, FrameError
from specd.ipc.generation import (
    Collector,
    GenerateResult,
    StreamDelta,
    make_generate,
    make_tokenize,
)
from specd.ipc.paths import client_socket_path
from specd.ipc.sampling import SamplingParams


class AsyncClient:
    """An asyncio connection; any number of concurrent requests. Use `await
    AsyncClient.connect(...)` or `async with AsyncClient(...) as client`."""

    def __init__(self, socket_path: str | Path | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT_S,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.socket_path = Path(socket_path) if socket_path else client_socket_path()
        self.timeout = timeout
        self._codec: FrameCodec[m.ServerMessage] = FrameCodec(m.ServerMessage, max_frame_bytes)
        self._ids = itertools.count(1)
        self._inboxes: dict[int, asyncio.Queue[m.ServerMessage | SpecdError]] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._read_task: asyncio.Task[None] | None = None
        self._failure: SpecdError | None = None  # why the last connection ended

    async def __aenter__(self) -> AsyncClient:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def open(self) -> None:
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(
                str(self.socket_path), limit=self._codec.max_frame_bytes + 8)
        except OSError as exc:
            raise DaemonUnavailable(f"cannot connect to {self.socket_path}: {exc}") from exc
        self._read_task = asyncio.create_task(self._read_loop())

    async def close(self) -> None:
        if self._read_task is not None:
            self._read_task.cancel()
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()

    async def _read_loop(self) -> None:
        assert self._reader is not None  # set by open(), which starts this task
        failure: SpecdError = DaemonUnavailable("the daemon closed the connection")
        farewell: SpecdError | None = None  # the daemon's reason, when it gave one
        partial = b""
        try:
            while data := await self._reader.read(RECV_CHUNK_BYTES):
                bodies, partial = self._codec.split(partial + data)
                for body in bodies:
                    message = self._codec.decode(body)
                    target = self._inboxes.get(message.id) if message.id is not None else None
                    if target is not None:
                        target.put_nowait(message)
                    elif isinstance(message, m.Error) and message.id is None:  # the connection's
                        farewell = error_from_frame(message)
        except (OSError, FrameError) as exc:
            # A daemon that refused the connection closes it with our request unread: the
            # reset comes after its reason, which is the answer.
            failure = DaemonUnavailable(f"connection lost: {exc!r}")
        except msgspec.DecodeError as exc:
            failure = ProtocolError(f"undecodable frame: {exc}")
        failure = farewell or failure
        self._failure = failure
        for inbox in self._inboxes.values():
            inbox.put_nowait(failure)

    async def _send(self, message: Any) -> asyncio.Queue[m.ServerMessage | SpecdError]:
        if self._writer is None:
            raise DaemonUnavailable("not connected; use `async with` or await open()")
        if self._read_task is not None and self._read_task.done():
            if self._inboxes:  # lost with requests in flight: they have its error already
                raise self._failure or DaemonUnavailable("the daemon closed the connection")
            # The daemon closed the connection with nothing in flight (its idle timeout).
            await self.close()
            await self.open()
        inbox: asyncio.Queue[m.ServerMessage | SpecdError] = asyncio.Queue()
        self._inboxes[message.id] = inbox
        try:
            self._writer.write(self._codec.encode(message))
            await self._writer.drain()
        except OSError as exc:
            # A daemon that refused the connection (draining, too many connections) said
            # why before closing; the read loop delivers that error to the inbox.
            self._inboxes.pop(message.id, None)
            if self._read_task is not None:
                await asyncio.wait({self._read_task}, timeout=1.0)
            raise self._failure or DaemonUnavailable(f"send failed: {exc}") from exc
        return inbox

    async def _next(self, inbox: asyncio.Queue[m.ServerMessage | SpecdError],
                    collector: Collector | None = None) -> m.ServerMessage:
        """The request's next frame; an error frame raises (with what `collector` holds as
        the request's partial output)."""
        if not inbox.empty():  # the common case while streaming: no timer needed
            item = inbox.get_nowait()
        else:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a
                # cancellation that arrives as the answer does (gh-86296), and a caller
                # that cancels a query (the benchmark's stats sampler) would run on.
                async with asyncio.timeout(self.timeout):
                    item = await inbox.get()
            except TimeoutError as exc:
                raise ClientTimeout(f"no answer within {self.timeout} s") from exc
        if isinstance(item, SpecdError):
            raise item
        if isinstance(item, m.Error):
            raise error_from_frame(item, collector.partial() if collector else None)
        return item

    async def generate(self, prompt: str | None = None, *,
                       messages: list[dict[str, str]] | None = None,
                       prompt_token_ids: list[int] | None = None,
                       sampling: SamplingParams | None = None, deadline_s: float | None = None,
                       **sampling_options: Any) -> GenerateResult:
        request = make_generate(next(self._ids), prompt, messages, prompt_token_ids, sampling,
                                False, deadline_s, sampling_options)
        inbox = await self._send(request)
        collector = Collector()
        try:
            while True:
                reply = await self._next(inbox, collector)
                if isinstance(reply, m.Final):
                    return collector.result(reply)
                if isinstance(reply, m.Delta):
                    collector.add(reply)
        finally:
            self._inboxes.pop(request.id, None)

    async def stream(self, prompt: str | None = None, *,
                     messages: list[dict[str, str]] | None = None,
                     prompt_token_ids: list[int] | None = None,
                     sampling: SamplingParams | None = None, deadline_s: float | None = None,
                     **sampling_options: Any) -> AsyncGenerator[StreamDelta, None]:
        """Yield deltas; the Final's remaining text comes as a last delta. Leaving early
        (break, cancellation) aborts the request."""
        request = make_generate(next(self._ids), prompt, messages, prompt_token_ids, sampling,
                                True, deadline_s, sampling_options)
        inbox = await self._send(request)
        finished = False
        try:
            while True:
                reply = await self._next(inbox)
                if isinstance(reply, m.Delta):
                    yield StreamDelta(reply.text, reply.token_ids, reply.logprobs)
                elif isinstance(reply, m.Final):
                    finished = True
                    if reply.text:
                        yield StreamDelta(reply.text, [], [])
                    return
        except SpecdError:
            finished = True
            raise
        finally:
            self._inboxes.pop(request.id, None)
            if not finished and self._writer is not None and not self._writer.is_closing():
                self._writer.write(self._codec.encode(m.Abort(next(self._ids), request.id)))

    async def _query(self, message: Any) -> m.ServerMessage:
        inbox = await self._send(message)
        try:
            return await self._next(inbox)
        finally:
            self._inboxes.pop(message.id, None)

    async def status(self) -> m.StatusReply:
        reply = await self._query(m.StatusQuery(next(self._ids)))
        if not isinstance(reply, m.StatusReply):
            raise ProtocolError(f"expected a status reply, got {type(reply).__name__}")
        return reply

    async def tokenize(self, prompt: str | None = None, *,
                       messages: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt token ids a generate with this `prompt` or `messages` would have."""
        reply = await self._query(make_tokenize(next(self._ids), prompt, messages))
        if not isinstance(reply, m.Tokens):
            raise ProtocolError(f"expected a tokens reply, got {type(reply).__name__}")
        return reply.token_ids

    async def stats(self) -> dict[str, Any]:
        reply = await self._query(m.StatsQuery(next(self._ids)))
        if not isinstance(reply, m.StatsReply):
            raise ProtocolError(f"expected a stats reply, got {type(reply).__name__}")
        return reply.stats
