"""Both clients survive the daemon's idle timeout: a connection the daemon closed while no
request was in flight is opened again for the next request, not reported as an error."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvloop

from specd.daemon.activation import bind_unix_socket
from specd.daemon.config import DaemonConfig
from specd.daemon.server import Connection, start_server
from specd.ipc import messages as m
from specd.ipc.async_client import AsyncClient
from specd.ipc.client import Client
from specd.ipc.framing import FrameCodec

IDLE_S = 0.1


class AckingHandler:
    """Ends every generate request with its connection's number as the text; `closed` is
    set when a connection closes."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def on_message(self, connection: Connection, message: m.ClientMessage) -> None:
        connection.send(m.Final(message.id, "stop", 1, 1, f"connection {connection.connection_id}"))

    def on_close(self, connection: Connection, reason: str) -> None:
        self.closed.set()

    def has_open_requests(self, connection: Connection) -> bool:
        return False

    def on_large_frame(self) -> None:
        pass

    def end_requests(self, connection: Connection, code: str, reason: str) -> None:
        pass  # it never holds a request open


@contextmanager
def idle_closing_server(path: Path) -> Iterator[AckingHandler]:
    """The front's connection code with a short idle timeout, on a thread of its own."""
    handler = AckingHandler()
    config = DaemonConfig(idle_timeout_s=IDLE_S)
    codec: FrameCodec[m.ClientMessage] = FrameCodec(m.ClientMessage)
    started, stop = threading.Event(), threading.Event()
    counters: Counter[str] = Counter()

    async def serve() -> None:
        number = 0

        async def on_connection(reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
            nonlocal number
            number += 1
            await Connection(number, reader, writer, codec, config, counters).serve(handler)

        async with await start_server(on_connection, bind_unix_socket(str(path)), config):
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.01)

    thread = threading.Thread(target=uvloop.run, args=(serve(),))
    thread.start()
    try:
        assert started.wait(10)
        yield handler
    finally:
        stop.set()
        thread.join(10)


def test_the_blocking_client_reconnects_after_an_idle_close(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    with idle_closing_server(path) as server, Client(path, timeout=10) as client:
        assert client.generate("x").text == "connection 1"
        assert server.closed.wait(10)  # idle: the server said so and closed
        assert client.generate("x").text == "connection 2"


def test_the_async_client_reconnects_after_an_idle_close(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"

    async def scenario(server: AckingHandler) -> list[str]:
        async with AsyncClient(path, timeout=10) as client:
            first = (await client.generate("x")).text
            assert await asyncio.to_thread(server.closed.wait, 10)
            async with asyncio.timeout(10):  # the client reads the close, on its own
                while client._read_task is not None and not client._read_task.done():
                    await asyncio.sleep(0.01)
            return [first, (await client.generate("x")).text]

    with idle_closing_server(path) as server:
        assert asyncio.run(scenario(server)) == ["connection 1", "connection 2"]
