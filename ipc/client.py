"""specd's client library: `Client` (blocking) and `AsyncClient` (asyncio).

    from specd.client import Client
    with Client() as client:                      # default socket path, see DaemonConfig
        print(client.generate("def fib(n):", max_tokens=32).text)
        for delta in client.stream("import os", max_tokens=32):
            print(delta.text, end="", flush=True)

Every error frame raises the `SpecdError` subclass for its code (`Overloaded`,
`PromptTooLong`, ...); a daemon that cannot be reached raises `DaemonUnavailable`, one
that does not answer within `timeout` seconds raises `ClientTimeout`. `Client` runs one
request at a time; `AsyncClient` multiplexes any number over one connection. Leaving a
`stream()` early aborts the request in the daemon. A connection the daemon closed while
no request was in flight (its idle timeout) is opened again for the next request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import select
import socket
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from specd.ipc import messages as m
from specd.ipc.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameCodec,
    FrameError,
)
from specd.ipc.sampling import SamplingParams

DEFAULT_TIMEOUT_S = 60.0
RECV_CHUNK_BYTES = 2**16


def default_socket_path() -> Path:
    """$SPECD_SOCKET, else the daemon's default (DaemonConfig.socket_path)."""
    env = os.environ.get("SPECD_SOCKET")
    if env:
        return Path(env)
    from specd.daemon.config import default_socket_path as daemon_default

    return daemon_default()


# ---- errors ------------------------------------------------------------------------------


class SpecdError(Exception):
    """An error frame from the daemon (or a client-side failure with its own code)."""

    code = "error"

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class BadFrame(SpecdError):
    """The daemon could not parse the frame; it closed."""

    code = "bad_frame"


class BadRequest(SpecdError):
    """The request was invalid (the message says why)."""

    code = "bad_request"


class PromptTooLong(SpecdError):
    """The prompt is longer than the model allows."""

    code = "prompt_too_long"


class Overloaded(SpecdError):
    """The daemon's queue is full; retry later."""

    code = "overloaded"


class Starting(SpecdError):
    """The daemon is still loading the model."""

    code = "starting"


class ShuttingDown(SpecdError):
    """The daemon is draining."""

    code = "shutting_down"


class SchedulerUnavailable(SpecdError):
    """The scheduler died or hung."""

    code = "scheduler_unavailable"


class DeadlineExceeded(SpecdError):
    """The request's deadline passed."""

    code = "deadline_exceeded"


class Drained(SpecdError):
    """The drain timeout ended the request."""

    code = "drained"


class SlowReader(SpecdError):
    """The client did not read its output in time."""

    code = "slow_reader"


class DuplicateId(SpecdError):
    """A request with this id is already in flight."""

    code = "duplicate_id"


class NotFound(SpecdError):
    """No such request in flight."""

    code = "not_found"


class Forbidden(SpecdError):
    """A control request (drain, stop, spec) from a user who is not an operator."""

    code = "forbidden"


class InternalError(SpecdError):
    """A bug in the daemon; see its log."""

    code = "internal_error"


ERRORS: dict[str, type[SpecdError]] = {
    cls.code: cls for cls in (BadFrame, BadRequest, PromptTooLong, Overloaded, Starting,
                              ShuttingDown, SchedulerUnavailable, DeadlineExceeded, Drained,
                              SlowReader, DuplicateId, NotFound, Forbidden, InternalError)}


class DaemonUnavailable(SpecdError):
    """The socket could not be reached, or the daemon closed the connection."""

    code = "unavailable"


class ClientTimeout(SpecdError, TimeoutError):
    """No answer within the client's timeout."""

    code = "timeout"


class ProtocolError(SpecdError):
    """The daemon sent something this client does not understand."""

    code = "protocol_error"


def error_from_frame(error: m.Error) -> SpecdError:
    cls = ERRORS.get(error.code, SpecdError)
    exc = cls(error.message, error.id)
    if cls is SpecdError:
        exc.code = error.code
    return exc


# ---- results -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamDelta:
    text: str
    token_ids: list[int]
    logprobs: list[m.Logprob] = field(default_factory=list)


@dataclass(frozen=True)
class GenerateResult:
    """The whole output of a request (for `stream`, what all deltas and the final held)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_drafted: int
    num_accepted: int
    acceptance_length: float
    stop_string: str | None
    logprobs: list[m.Logprob]


class _Collector:
    """Accumulates deltas and the final frame of one request into a GenerateResult."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[m.Logprob] = []

    def add(self, delta: m.Delta) -> StreamDelta:
        self.texts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        return StreamDelta(delta.text, delta.token_ids, delta.logprobs)

    def result(self, final: m.Final) -> GenerateResult:
        return GenerateResult(
            text="".join(self.texts) + final.text,
            token_ids=self.token_ids + final.token_ids,
            finish_reason=final.finish_reason,
            num_prompt_tokens=final.num_prompt_tokens,
            num_output_tokens=final.num_output_tokens,
            num_cached_tokens=final.num_cached_tokens,
            num_drafted=final.num_drafted,
            num_accepted=final.num_accepted,
            acceptance_length=final.acceptance_length,
            stop_string=final.stop_string,
            logprobs=self.logprobs + final.logprobs,
        )


def make_generate(request_id: int, prompt: str | None, messages: list[dict[str, str]] | None,
                  prompt_token_ids: list[int] | None, sampling: SamplingParams | None,
                  stream: bool, deadline_s: float | None,
                  sampling_options: dict[str, Any]) -> m.Generate:
    """Build a Generate request; `sampling_options` are SamplingParams fields."""
    if sampling is None:
        sampling = SamplingParams(**sampling_options)
    elif sampling_options:
        raise TypeError("pass either sampling= or sampling keyword options, not both")
    return m.Generate(
        id=request_id, prompt=prompt,
        messages=None if messages is None else [m.ChatMessage(**x) for x in messages],
        prompt_token_ids=prompt_token_ids, sampling=sampling, stream=stream,
        deadline_s=deadline_s)


# ---- blocking client ---------------------------------------------------------------------


class Client:
    """A blocking connection to the daemon; one request at a time. Not thread-safe."""

    def __init__(self, socket_path: str | Path | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT_S,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.timeout = timeout
        self._codec: FrameCodec[m.ServerMessage] = FrameCodec(m.ServerMessage, max_frame_bytes)
        self._ids = itertools.count(1)
        self._received: collections.deque[bytes] = collections.deque()  # complete bodies
        self._partial = b""  # bytes of a frame not yet complete
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(self.socket_path))
        except OSError as exc:
            self._sock.close()
            raise DaemonUnavailable(f"cannot connect to {self.socket_path}: {exc}") from exc

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def next_id(self) -> int:
        return next(self._ids)

    def _send_request(self, message: Any) -> None:
        """Send a new request, on a new connection if the daemon closed an idle one."""
        if self._was_closed_while_idle():
            self._sock.close()
            self._received.clear()
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            self._sock.settimeout(self.timeout)
            try:
                self._sock.connect(str(self.socket_path))
            except OSError as exc:
                raise DaemonUnavailable(f"cannot reconnect to {self.socket_path}: {exc}") from exc
        self.send(message)

    def _was_closed_while_idle(self) -> bool:
        """Whether all that waits on the socket is its end, after connection errors only."""
        if self._received or self._partial:
            return False
        readable, _, _ = select.select([self._sock], [], [], 0)
        if not readable:
            return False  # nothing waiting: the connection is open
        try:
            data = self._sock.recv(RECV_CHUNK_BYTES, socket.MSG_PEEK)
        except OSError:
            return True
        try:
            bodies, rest = self._codec.split(data)
            replies = [self._codec.decode(body) for body in bodies]
        except (FrameError, msgspec.DecodeError):
            return False  # not the daemon's farewell: `receive` reports it
        return not rest and all(isinstance(r, m.Error) and r.id is None for r in replies)

    def send(self, message: Any) -> None:
        try:
            self._sock.sendall(self._codec.encode(message))
        except OSError as exc:
            raise DaemonUnavailable(f"send failed: {exc}") from exc

    def receive(self) -> m.ServerMessage:
        """The next frame from the daemon."""
        try:
            while not self._received:
                data = self._sock.recv(RECV_CHUNK_BYTES)
                if not data:
                    raise DaemonUnavailable("the daemon closed the connection")
                bodies, self._partial = self._codec.split(self._partial + data)
                self._received.extend(bodies)
            return self._codec.decode(self._received.popleft())
        except TimeoutError as exc:
            raise ClientTimeout(f"no answer within {self.timeout} s") from exc
        except (OSError, FrameError) as exc:
            raise DaemonUnavailable(f"connection lost: {exc!r}") from exc
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"undecodable frame: {exc}") from exc

    def _call(self, message: Any) -> m.ServerMessage:
        self._send_request(message)
        reply = self.receive()
        if isinstance(reply, m.Error):
            raise error_from_frame(reply)
        return reply

    def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                 prompt_token_ids: list[int] | None = None,
                 sampling: SamplingParams | None = None, deadline_s: float | None = None,
                 **sampling_options: Any) -> GenerateResult:
        """Generate to the end and return the whole result (one Final frame)."""
        request = make_generate(next(self._ids), prompt, messages, prompt_token_ids, sampling,
                                False, deadline_s, sampling_options)
        self._send_request(request)
        collector = _Collector()
        while True:
            reply = self.receive()
            if isinstance(reply, m.Final) and reply.id == request.id:
                return collector.result(reply)
            if isinstance(reply, m.Error):
                raise error_from_frame(reply)
            if isinstance(reply, m.Delta):
                collector.add(reply)

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               prompt_token_ids: list[int] | None = None,
               sampling: SamplingParams | None = None, deadline_s: float | None = None,
               **sampling_options: Any) -> Stream:
        """Start a streaming request; iterate the returned `Stream` for deltas."""
        request = make_generate(next(self._ids), prompt, messages, prompt_token_ids, sampling,
                                True, deadline_s, sampling_options)
        self._send_request(request)
        return Stream(self, request.id)

    def status(self) -> m.StatusReply:
        reply = self._call(m.StatusQuery(next(self._ids)))
        if not isinstance(reply, m.StatusReply):
            raise ProtocolError(f"expected a status reply, got {type(reply).__name__}")
        return reply

    def stats(self) -> dict[str, Any]:
        reply = self._call(m.StatsQuery(next(self._ids)))
        if not isinstance(reply, m.StatsReply):
            raise ProtocolError(f"expected a stats reply, got {type(reply).__name__}")
        return reply.stats

    def set_spec(self, mode: str, threshold: int | None = None) -> str:
        return self._ack(m.SetSpec(next(self._ids), mode, threshold))

    def drain(self, timeout_s: float | None = None) -> str:
        return self._ack(m.Drain(next(self._ids), timeout_s))

    def stop(self) -> str:
        return self._ack(m.Stop(next(self._ids)))

    def _ack(self, message: Any) -> str:
        reply = self._call(message)
        if not isinstance(reply, m.Ack):
            raise ProtocolError(f"expected an ack, got {type(reply).__name__}")
        return reply.message


class Stream:
    """Iterator over one streaming request's deltas; `result` is set once it ends.
    Closing it (or leaving a `with` block) before the end aborts the request."""

    def __init__(self, client: Client, request_id: int) -> None:
        self._client = client
        self.request_id = request_id
        self._collector = _Collector()
        self.result: GenerateResult | None = None
        self._is_open = True

    def __iter__(self) -> Iterator[StreamDelta]:
        while self._is_open:
            reply = self._client.receive()
            if isinstance(reply, m.Delta) and reply.id == self.request_id:
                yield self._collector.add(reply)
            elif isinstance(reply, m.Final) and reply.id == self.request_id:
                self._is_open = False
                self.result = self._collector.result(reply)
                if reply.text:
                    yield StreamDelta(reply.text, [], [])
            elif isinstance(reply, m.Error):
                self._is_open = False
                raise error_from_frame(reply)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Abort the request if it is still running (and read up to its end)."""
        if not self._is_open:
            return
        self._client.send(m.Abort(self._client.next_id(), self.request_id))
        with contextlib.suppress(SpecdError):  # the request ends in Final or Error either way
            for _ in self:
                pass
        self._client.receive()  # the Ack (or not_found) of the Abort


# ---- asyncio client ----------------------------------------------------------------------


class AsyncClient:
    """An asyncio connection; any number of concurrent requests. Use `await
    AsyncClient.connect(...)` or `async with AsyncClient(...) as client`."""

    def __init__(self, socket_path: str | Path | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT_S,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.timeout = timeout
        self._codec: FrameCodec[m.ServerMessage] = FrameCodec(m.ServerMessage, max_frame_bytes)
        self._ids = itertools.count(1)
        self._inboxes: dict[int, asyncio.Queue[m.ServerMessage | SpecdError]] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._read_task: asyncio.Task[None] | None = None

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
                        failure = error_from_frame(message)
        except (OSError, FrameError) as exc:
            failure = DaemonUnavailable(f"connection lost: {exc!r}")
        except msgspec.DecodeError as exc:
            failure = ProtocolError(f"undecodable frame: {exc}")
        for inbox in self._inboxes.values():
            inbox.put_nowait(failure)

    async def _send(self, message: Any) -> asyncio.Queue[m.ServerMessage | SpecdError]:
        if self._writer is None:
            raise DaemonUnavailable("not connected; use `async with` or await open()")
        if self._read_task is not None and self._read_task.done() and not self._inboxes:
            # The daemon closed the connection with nothing in flight (its idle timeout).
            await self.close()
            await self.open()
        inbox: asyncio.Queue[m.ServerMessage | SpecdError] = asyncio.Queue()
        self._inboxes[message.id] = inbox
        self._writer.write(self._codec.encode(message))
        await self._writer.drain()
        return inbox

    async def _next(self, inbox: asyncio.Queue[m.ServerMessage | SpecdError]
                    ) -> m.ServerMessage:
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
            raise error_from_frame(item)
        return item

    async def generate(self, prompt: str | None = None, *,
                       messages: list[dict[str, str]] | None = None,
                       prompt_token_ids: list[int] | None = None,
                       sampling: SamplingParams | None = None, deadline_s: float | None = None,
                       **sampling_options: Any) -> GenerateResult:
        request = make_generate(next(self._ids), prompt, messages, prompt_token_ids, sampling,
                                False, deadline_s, sampling_options)
        inbox = await self._send(request)
        collector = _Collector()
        try:
            while True:
                reply = await self._next(inbox)
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

    async def stats(self) -> dict[str, Any]:
        reply = await self._query(m.StatsQuery(next(self._ids)))
        if not isinstance(reply, m.StatsReply):
            raise ProtocolError(f"expected a stats reply, got {type(reply).__name__}")
        return reply.stats
