"""A client connection's limits, on a real Unix socket under uvloop (as the front runs):
idle connections close and busy ones do not, every rejected frame is counted, a deeply
nested body costs one bad_request, a stalled reader is cut off but a large reply to a
reader is not, and a burst of max_connections connects waits in the listen backlog."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
import uvloop

from specd.daemon.activation import bind_unix_socket
from specd.daemon.config import DaemonConfig
from specd.daemon.server import Connection, start_server
from specd.ipc import messages as m
from specd.ipc.framing import FrameCodec

CLIENT_CODEC: FrameCodec[m.ServerMessage] = FrameCodec(m.ServerMessage, 2**24)
SERVER_CODEC: FrameCodec[m.ClientMessage] = FrameCodec(m.ClientMessage)


class Handler:
    """The front's side, reduced to what a connection asks of it."""

    def __init__(self) -> None:
        self.messages: list[m.ClientMessage] = []
        self.close_reasons: list[str] = []
        self.has_open = False
        self.connection: Connection | None = None
        self.ended: list[tuple[str, str]] = []  # end_requests calls: (code, reason)

    def on_message(self, connection: Connection, message: m.ClientMessage) -> None:
        self.messages.append(message)

    def on_close(self, connection: Connection, reason: str) -> None:
        self.close_reasons.append(reason)

    def has_open_requests(self, connection: Connection) -> bool:
        return self.has_open

    def on_large_frame(self) -> None:
        pass

    def end_requests(self, connection: Connection, code: str, reason: str) -> None:
        self.ended.append((code, reason))


Client = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def serve(tmp_path: Path, config: DaemonConfig,
          scenario: Callable[[Handler, Counter[str], Client], Awaitable[None]],
          client_buffer: int = 2**24) -> None:
    """Run `scenario` against one served connection, within 20 s. The client's transport
    stops reading from the socket once `client_buffer` bytes wait unread."""
    path = str(tmp_path / "s.sock")
    handler = Handler()
    counters: Counter[str] = Counter()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler.connection = Connection(1, reader, writer, SERVER_CODEC, config, counters)
        await handler.connection.serve(handler)

    async def main() -> None:
        server = await start_server(on_connection, bind_unix_socket(path), config)
        async with server, asyncio.timeout(20):
            client = await asyncio.open_unix_connection(path, limit=client_buffer // 2)
            await scenario(handler, counters, client)
            client[1].close()

    uvloop.run(main())


async def read_reply(reader: asyncio.StreamReader) -> m.ServerMessage | None:
    """The next frame, or None at EOF."""
    try:
        (length,) = struct.unpack(">I", await reader.readexactly(4))
    except asyncio.IncompleteReadError:
        return None
    return CLIENT_CODEC.decode(await reader.readexactly(length))


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_an_idle_connection_is_closed_and_the_close_is_counted(tmp_path: Path) -> None:
    async def scenario(handler: Handler, counters: Counter[str], client: Client) -> None:
        reply = await read_reply(client[0])
        assert isinstance(reply, m.Error) and reply.code == "bad_frame" and reply.id is None
        assert "idle" in reply.message
        assert await read_reply(client[0]) is None
        assert counters["error_bad_frame"] == 1

    serve(tmp_path, DaemonConfig(idle_timeout_s=0.2), scenario)


def test_a_connection_with_requests_running_is_not_idle(tmp_path: Path) -> None:
    async def scenario(handler: Handler, counters: Counter[str], client: Client) -> None:
        handler.has_open = True  # a non-streamed request running for 5 idle timeouts
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client[0].read(1), 1.0)
        assert handler.connection is not None
        handler.connection.send(m.Ack(7, "the request's last frame"))
        handler.has_open = False
        ended = asyncio.get_running_loop().time()
        assert isinstance(await read_reply(client[0]), m.Ack)
        reply = await read_reply(client[0])
        # Idle counts from the last frame, not from the start of a watch period.
        assert asyncio.get_running_loop().time() - ended >= 0.15
        assert isinstance(reply, m.Error) and "idle" in reply.message

    serve(tmp_path, DaemonConfig(idle_timeout_s=0.2), scenario)


def deeply_nested(depth: int) -> bytes:
    deep = b"\x91" * depth + b"\xc0"
    return (b"\x83" + msgspec.msgpack.encode("prompt") + deep + msgspec.msgpack.encode("id")
            + b"\x01" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("generate"))


def test_every_rejected_frame_is_counted_and_the_connection_lives_on(tmp_path: Path) -> None:
    async def scenario(handler: Handler, counters: Counter[str], client: Client) -> None:
        reader, writer = client
        bad = [b"\xc1\xc1", deeply_nested(50_000), msgspec.msgpack.encode({"type": "x"}),
               msgspec.msgpack.encode({"type": "status", "id": -1})] * 25
        writer.write(b"".join(frame(body) for body in bad))
        for _ in bad:
            reply = await read_reply(reader)
            assert isinstance(reply, m.Error) and reply.code == "bad_request"
        writer.write(frame(msgspec.msgpack.encode({"type": "status", "id": 5})))
        while not handler.messages:
            await asyncio.sleep(0.01)
        assert handler.messages == [m.StatusQuery(id=5)]
        assert counters == {"error_bad_request": len(bad)}
        writer.write(struct.pack(">I", 0))  # a broken frame: the connection's end
        reply = await read_reply(reader)
        assert isinstance(reply, m.Error) and reply.code == "bad_frame"
        assert await read_reply(reader) is None
        assert counters == {"error_bad_request": len(bad), "error_bad_frame": 1}

    serve(tmp_path, DaemonConfig(), scenario)


def test_a_large_reply_to_a_reading_client_is_not_cut_off(tmp_path: Path) -> None:
    async def scenario(handler: Handler, counters: Counter[str], client: Client) -> None:
        await asyncio.sleep(0.05)
        assert handler.connection is not None
        handler.connection.send(m.Ack(1, "x" * 2**20))  # 16 times the limit, in one frame
        reply = await read_reply(client[0])
        assert isinstance(reply, m.Ack) and len(reply.message) == 2**20
        assert not counters

    serve(tmp_path, DaemonConfig(write_buffer_bytes=2**16), scenario)


def test_a_client_that_never_reads_is_cut_off_and_counted(tmp_path: Path) -> None:
    async def scenario(handler: Handler, counters: Counter[str], client: Client) -> None:
        await asyncio.sleep(0.05)
        connection = handler.connection
        assert connection is not None
        for i in range(200):  # 4 MB of output, one frame per loop turn, never read
            connection.send(m.Ack(i, "x" * 20_000))
            await asyncio.sleep(0)
            if connection.is_closed:
                break
        assert connection.is_closed and connection.close_reason == "slow_reader"
        assert counters == {"error_slow_reader": 1}

    serve(tmp_path, DaemonConfig(write_buffer_bytes=2**16), scenario, client_buffer=2048)


def test_the_connection_knows_its_peer_uid(tmp_path: Path) -> None:
    async def scenario(handler: Handler, counters: Counter[str], client: Client) -> None:
        await asyncio.sleep(0.05)
        assert handler.connection is not None
        assert handler.connection.peer_uid == os.geteuid()

    serve(tmp_path, DaemonConfig(), scenario)


def test_a_burst_of_max_connections_connects_waits_in_the_backlog(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    config = DaemonConfig(max_connections=300)

    async def main() -> int:
        accepted = 0

        async def on_connection(reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            writer.close()

        server = await start_server(on_connection, bind_unix_socket(path, backlog=1), config)
        clients = []
        try:
            # No await in this loop: nothing is accepted until the burst is over, so every
            # connect must fit in the kernel's queue (a full one refuses with EAGAIN).
            for _ in range(config.max_connections):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                clients.append(sock)
                sock.setblocking(False)
                sock.connect(path)
            while accepted < config.max_connections:
                await asyncio.sleep(0.01)
        finally:
            for sock in clients:
                sock.close()
            server.close()
        return accepted

    assert uvloop.run(asyncio.wait_for(main(), 20)) == config.max_connections
