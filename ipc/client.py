"""specd's client library, blocking: `Client` (the asyncio `AsyncClient` is in
async_client.py, the errors in errors.py; `specd.client` exports them all).

    from specd.client import Client
    with Client() as client:                      # $SPECD_SOCKET or the default (paths.py)
        print(client.generate("def fib(n):", max_tokens=32).text)
        for delta in client.stream("import os", max_tokens=32):
            print(delta.text, end="", flush=True)

Every error frame raises the `SpecdError` subclass for its code (`Overloaded`,
`PromptTooLong`, ...), with the output the request produced before it (`partial`: a
`deadline_exceeded` or `drained` request keeps what it generated); a daemon that cannot
be reached raises `DaemonUnavailable`, one that does not answer within `timeout` seconds
raises `ClientTimeout`. `Client` runs one request at a time; `AsyncClient` multiplexes
any number over one connection. Leaving a `stream()` early aborts the request in the
daemon. A connection the daemon closed while
no request was in flight (its idle timeout) is opened again for the next request.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import select
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from specd.ipc import messages as m
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

DEFAULT_TIMEOUT_S = 60.0
RECV_CHUNK_BYTES = 2**16


class Client:
    """A blocking connection to the daemon; one request at a time. Not thread-safe."""

    def __init__(self, socket_path: str | Path | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT_S,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.socket_path = Path(socket_path) if socket_path else client_socket_path()
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
            # A daemon that refused the connection (draining, too many connections) told
            # why before it closed: that error, not the broken pipe, is the answer.
            farewell = self._farewell()
            if farewell is not None:
                raise farewell from exc
            raise DaemonUnavailable(f"send failed: {exc}") from exc

    def _farewell(self) -> SpecdError | None:
        """The connection's error frame (id nil) waiting to be read, if any."""
        try:
            while True:
                readable, _, _ = select.select([self._sock], [], [], 0)
                if not readable:
                    break
                data = self._sock.recv(RECV_CHUNK_BYTES)
                if not data:
                    break
                bodies, self._partial = self._codec.split(self._partial + data)
                self._received.extend(bodies)
            replies = [self._codec.decode(body) for body in self._received]
        except (OSError, FrameError, msgspec.DecodeError):
            return None
        errors = [r for r in replies if isinstance(r, m.Error) and r.id is None]
        return error_from_frame(errors[-1]) if errors else None

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
        collector = Collector()
        while True:
            reply = self.receive()
            if isinstance(reply, m.Final) and reply.id == request.id:
                return collector.result(reply)
            if isinstance(reply, m.Error):
                raise error_from_frame(reply, collector.partial())
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

    def tokenize(self, prompt: str | None = None, *,
                 messages: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt token ids a generate with this `prompt` or `messages` would have."""
        reply = self._call(make_tokenize(next(self._ids), prompt, messages))
        if not isinstance(reply, m.Tokens):
            raise ProtocolError(f"expected a tokens reply, got {type(reply).__name__}")
        return reply.token_ids

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
        self._collector = Collector()
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
                raise error_from_frame(reply, self._collector.partial())

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
