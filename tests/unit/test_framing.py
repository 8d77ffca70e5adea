"""Frames: 4-byte big-endian length + msgpack; cap checked before the body; typed decoding."""

from __future__ import annotations

import asyncio
import socket
import struct

import msgspec
import pytest

from specd.ipc import messages as m
from specd.ipc.framing import ConnectionClosed, FrameCodec, FrameError, NestingTooDeep, recv_body

CODEC: FrameCodec[m.ClientMessage] = FrameCodec(m.ClientMessage, max_frame_bytes=1024)


def test_frame_is_length_then_msgpack_body() -> None:
    frame = CODEC.encode(m.StatusQuery(id=3))
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert msgspec.msgpack.decode(frame[4:]) == {"type": "status", "id": 3}
    assert CODEC.decode(frame[4:]) == m.StatusQuery(id=3)


def test_encoding_a_message_over_the_cap_raises() -> None:
    with pytest.raises(FrameError, match="exceeds the cap of 1024"):
        CODEC.encode(m.Generate(id=1, prompt="x" * 2000))


def test_split_returns_complete_frames_and_keeps_the_rest() -> None:
    a, b = CODEC.encode(m.StatusQuery(id=1)), CODEC.encode(m.StatsQuery(id=2))
    bodies, rest = CODEC.split(a + b[:5])
    assert [CODEC.decode(x) for x in bodies] == [m.StatusQuery(id=1)]
    assert rest == b[:5]


@pytest.mark.parametrize("header", [struct.pack(">I", 0), struct.pack(">I", 1025),
                                    struct.pack(">I", 2**32 - 1)])
def test_split_rejects_a_bad_length_before_any_body(header: bytes) -> None:
    with pytest.raises(FrameError):
        CODEC.split(header)


def _read(data: bytes, eof: bool = True, idle: float | None = 1.0, frame: float = 0.2) -> bytes:
    async def run() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return await CODEC.read_body(reader, idle_timeout=idle, frame_timeout=frame)
    return asyncio.run(run())


def test_async_read_returns_one_body() -> None:
    frame = CODEC.encode(m.StatsQuery(id=9))
    assert CODEC.decode(_read(frame + frame)) == m.StatsQuery(id=9)


def test_async_read_oversized_length_fails_without_reading_the_body() -> None:
    with pytest.raises(FrameError, match="exceeds the cap"):
        _read(struct.pack(">I", 10**9), eof=False)


def test_async_read_eof_between_frames_is_a_clean_close() -> None:
    with pytest.raises(ConnectionClosed):
        _read(b"")


def test_async_read_eof_inside_a_frame_is_a_frame_error() -> None:
    frame = CODEC.encode(m.StatsQuery(id=9))
    with pytest.raises(FrameError, match="closed inside a frame"):
        _read(frame[:-1])


def test_async_read_half_a_frame_then_silence_times_out() -> None:
    frame = CODEC.encode(m.StatsQuery(id=9))
    with pytest.raises(FrameError, match="not complete within"):
        _read(frame[:3], eof=False, frame=0.05)


def test_async_read_idle_connection_times_out() -> None:
    with pytest.raises(TimeoutError):
        _read(b"", eof=False, idle=0.05)


def test_garbage_body_is_a_decode_error_not_a_frame_error() -> None:
    with pytest.raises(msgspec.DecodeError):
        CODEC.decode(b"\xc1\xc1\xc1")


def deeply_nested_generate(depth: int) -> bytes:
    """A generate map whose first value nests `depth` arrays, before the `type` tag: the
    decoder must skip it to find the tag."""
    deep = b"\x91" * depth + b"\xc0"
    return (b"\x83" + msgspec.msgpack.encode("prompt") + deep + msgspec.msgpack.encode("id")
            + b"\x01" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("generate"))


@pytest.mark.parametrize("depth", [2_000, 50_000])
def test_a_body_nested_too_deeply_is_a_decode_error(depth: int) -> None:
    codec: FrameCodec[m.ClientMessage] = FrameCodec(m.ClientMessage)
    with pytest.raises(NestingTooDeep, match="nested too deeply") as caught:
        codec.decode(deeply_nested_generate(depth))
    assert isinstance(caught.value, msgspec.DecodeError)  # what the server answers bad_request
    assert codec.decode(CODEC.encode(m.StatusQuery(id=2))[4:]) == m.StatusQuery(id=2)


def test_blocking_recv_body() -> None:
    left, right = socket.socketpair()
    with left, right:
        frame = CODEC.encode(m.StatusQuery(id=1))
        left.sendall(frame + frame[:6])
        left.shutdown(socket.SHUT_WR)
        assert CODEC.decode(recv_body(right, 1024)) == m.StatusQuery(id=1)
        with pytest.raises(FrameError):
            recv_body(right, 1024)
