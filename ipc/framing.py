"""Length-prefixed msgpack frames for the client socket.

A frame is a 4-byte big-endian unsigned length N followed by N bytes of msgpack. The
length is checked against a cap *before* the body is read, so a hostile length costs no
memory; a zero length is an error too. Bodies are decoded with a typed msgspec decoder
(strict: nothing is coerced but an integer where a float is expected, which msgspec always
accepts; unknown fields rejected where the Struct says so). A codec made with
`nil_is_default` (the front's, for client requests) reads a nil value as "absent, use the
default": for any key of the body's top-level map and of the maps directly inside it
(`sampling`, `chat_template_kwargs`), whatever the key's type.

Two kinds of failure, handled differently by the server:
* `FrameError`: the byte stream is out of sync (bad length, EOF inside a frame, a body that
  does not arrive in time). No reply can be trusted to land on a frame boundary: send
  `bad_frame` and close.
* `msgspec.DecodeError` (and its subclass `ValidationError`) from `FrameCodec.decode`: the
  frame boundary is intact but the body is not a valid message: reply `bad_request`, keep
  the connection. A body nested deeper than the decoder's recursion bound is one of these
  too (`NestingTooDeep`), never a RecursionError escaping to the caller.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any, Generic, TypeVar

import msgspec

HEADER = struct.Struct(">I")
NIL = b"\xc0"  # msgpack's nil: a body without this byte holds no nil value
HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME_BYTES = 4 * 2**20

T = TypeVar("T")


class FrameError(Exception):
    """The frame layer is broken: bad length, truncated frame or a body that timed out."""


class NestingTooDeep(msgspec.DecodeError):
    """The body nests arrays or maps deeper than the decoder's recursion bound.

    msgspec decodes nested values recursively, bounded by the interpreter's recursion limit
    (1,000 frames by default); typed decoding only goes that deep while it skips values
    (e.g. the keys before a tagged union's tag), since no valid message nests more than a
    few levels. `FrameCodec.decode` turns the RecursionError into this DecodeError, so a
    hostile body costs one `bad_request`, like any other undecodable body.
    """


class ConnectionClosed(Exception):
    """The peer closed the connection cleanly between two frames."""


def check_length(length: int, max_frame_bytes: int) -> None:
    if length == 0:
        raise FrameError("frame length is 0; a frame holds at least one msgpack byte")
    if length > max_frame_bytes:
        raise FrameError(f"frame length {length} exceeds the cap of {max_frame_bytes} bytes")


class FrameCodec(Generic[T]):
    """Encodes any message into a frame and decodes frame bodies into `T` (a tagged union)."""

    def __init__(self, decode_type: Any, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 nil_is_default: bool = False) -> None:
        if max_frame_bytes < 1 or max_frame_bytes >= 2**32:
            raise ValueError(f"max_frame_bytes must be in [1, 2**32), got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self.nil_is_default = nil_is_default
        self._decode_type = decode_type
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(decode_type)
        self._raw_decoder = msgspec.msgpack.Decoder()

    def encode(self, message: Any) -> bytes:
        """Header + body. Raises FrameError when the body exceeds the cap."""
        buffer = bytearray(HEADER_SIZE)
        self._encoder.encode_into(message, buffer, HEADER_SIZE)
        length = len(buffer) - HEADER_SIZE
        check_length(length, self.max_frame_bytes)
        HEADER.pack_into(buffer, 0, length)
        return bytes(buffer)

    def decode(self, body: bytes) -> T:
        """Typed decode of one body. Raises msgspec.DecodeError / ValidationError
        (NestingTooDeep for a body nested past the decoder's recursion bound)."""
        try:
            if self.nil_is_default and NIL in body:
                # The slow path (a raw decode, then a typed conversion with the same
                # checks) only for bodies that may hold a nil.
                raw = drop_nil_values(self._raw_decoder.decode(body))
                converted: T = msgspec.convert(raw, self._decode_type, strict=True)
                return converted
            return self._decoder.decode(body)
        except RecursionError as exc:
            raise NestingTooDeep(
                "msgpack body nested too deeply to decode (no valid message nests more "
                "than a few levels)") from exc

    def split(self, data: bytes) -> tuple[list[bytes], bytes]:
        """Bodies of the complete frames at the start of `data`, and the remaining bytes."""
        bodies: list[bytes] = []
        view = memoryview(data)
        offset = 0
        while len(view) - offset >= HEADER_SIZE:
            (length,) = HEADER.unpack_from(view, offset)
            check_length(length, self.max_frame_bytes)
            end = offset + HEADER_SIZE + length
            if end > len(view):
                break
            bodies.append(bytes(view[offset + HEADER_SIZE:end]))
            offset = end
        return bodies, bytes(view[offset:])

    async def read_body(
        self,
        reader: asyncio.StreamReader,
        idle_timeout: float | None,
        frame_timeout: float,
    ) -> bytes:
        """Read one frame body. Waits up to `idle_timeout` (None: forever) for the frame to
        start, then up to `frame_timeout` for the rest of it.

        Raises ConnectionClosed on EOF before the first byte, TimeoutError when idle too long,
        FrameError on a bad length, EOF inside the frame or a frame that does not complete.
        """
        try:
            first = await asyncio.wait_for(reader.readexactly(1), idle_timeout)
        except asyncio.IncompleteReadError as exc:
            raise ConnectionClosed() from exc
        try:
            async with asyncio.timeout(frame_timeout):
                rest = await reader.readexactly(HEADER_SIZE - 1)
                (length,) = HEADER.unpack(first + rest)
                check_length(length, self.max_frame_bytes)
                return await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise FrameError(
                f"connection closed inside a frame ({len(exc.partial)} bytes of "
                f"{exc.expected} read)") from exc
        except TimeoutError as exc:
            raise FrameError(f"frame not complete within {frame_timeout:g} s") from exc


def drop_nil_values(body: Any) -> Any:
    """`body` with the keys whose value is nil removed from its top-level map and from the
    maps directly inside it (anything else is returned as it is)."""
    if not isinstance(body, dict):
        return body
    return {key: {k: v for k, v in value.items() if v is not None}
            if isinstance(value, dict) else value
            for key, value in body.items() if value is not None}


def recv_exactly(sock: socket.socket, num_bytes: int) -> bytes:
    """Blocking read of exactly `num_bytes` (the socket's timeout applies to each recv).

    Raises ConnectionClosed on EOF before any byte, FrameError on EOF part-way.
    """
    chunks = bytearray()
    while len(chunks) < num_bytes:
        chunk = sock.recv(num_bytes - len(chunks))
        if not chunk:
            if not chunks:
                raise ConnectionClosed()
            raise FrameError(f"connection closed inside a frame ({len(chunks)}/{num_bytes} bytes)")
        chunks += chunk
    return bytes(chunks)


def recv_body(sock: socket.socket, max_frame_bytes: int) -> bytes:
    """Blocking read of one frame body from `sock`."""
    (length,) = HEADER.unpack(recv_exactly(sock, HEADER_SIZE))
    check_length(length, max_frame_bytes)
    try:
        return recv_exactly(sock, length)
    except ConnectionClosed as exc:
        raise FrameError("connection closed after a frame header") from exc
