"""What the client library makes of a request's error and of a refused connection, against
a scripted daemon on a real Unix socket: the output a request produced before its error
comes with the exception (`partial`), and a connection the daemon refused (draining, too
many connections) raises the daemon's reason, not a broken pipe."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from specd.client import AsyncClient, Client
from specd.ipc import errors
from specd.ipc import messages as m
from specd.ipc.framing import FrameCodec, recv_body

SERVER = FrameCodec(m.ServerMessage)
REQUESTS: FrameCodec[m.ClientMessage] = FrameCodec(m.ClientMessage)
Script = Callable[[socket.socket], None]


@contextmanager
def scripted_daemon(path: Path, script: Script) -> Iterator[None]:
    """Accept connections on `path` and run `script` on each, until the test ends."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                script(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def answer_with_partial_output_then_deadline(conn: socket.socket) -> None:
    request = REQUESTS.decode(recv_body(conn, 2**20))
    conn.sendall(SERVER.encode(m.Delta(request.id, "def", [5, 6]))
                 + SERVER.encode(m.Delta(request.id, " f", [7]))
                 + SERVER.encode(m.Error(request.id, "deadline_exceeded", "not within 1 s")))


def refuse_and_close(conn: socket.socket) -> None:
    """A daemon that closes at once, perhaps with the client's request unread."""
    conn.sendall(SERVER.encode(m.Error(None, "shutting_down", "the daemon is draining")))


def refuse_and_linger(conn: socket.socket) -> None:
    """What the front does (Connection.refuse): the reason, its side shut, then the
    client's bytes read and dropped until it closes."""
    refuse_and_close(conn)
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(2)
    try:
        while conn.recv(2**16):
            pass
    except ConnectionResetError:
        pass  # the client closed with the reason unread (it reconnects to send again)


@pytest.mark.parametrize("stream", [False, True])
def test_the_error_of_a_request_carries_its_partial_output(tmp_path: Path,
                                                           stream: bool) -> None:
    path = tmp_path / "d.sock"
    with scripted_daemon(path, answer_with_partial_output_then_deadline), \
            Client(path, timeout=5) as client, pytest.raises(errors.DeadlineExceeded) as caught:
        if stream:
            list(client.stream("x", deadline_s=1.0))
        else:
            client.generate("x", deadline_s=1.0)
    partial = caught.value.partial
    assert partial is not None
    assert (partial.text, partial.token_ids) == ("def f", [5, 6, 7])


def test_the_async_client_attaches_the_partial_output_too(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"

    async def run() -> errors.SpecdError:
        async with AsyncClient(path, timeout=5) as client:
            with pytest.raises(errors.DeadlineExceeded) as caught:
                await client.generate("x", deadline_s=1.0)
            return caught.value

    with scripted_daemon(path, answer_with_partial_output_then_deadline):
        error = asyncio.run(run())
    assert error.partial is not None and error.partial.token_ids == [5, 6, 7]


def test_an_error_before_any_output_has_no_partial(tmp_path: Path) -> None:
    def overloaded(conn: socket.socket) -> None:
        request = REQUESTS.decode(recv_body(conn, 2**20))
        conn.sendall(SERVER.encode(m.Error(request.id, "overloaded", "full")))

    with scripted_daemon(tmp_path / "d.sock", overloaded), \
            Client(tmp_path / "d.sock", timeout=5) as client, \
            pytest.raises(errors.Overloaded) as caught:
        client.generate("x")
    assert caught.value.partial is None


@pytest.mark.parametrize("script", [refuse_and_close, refuse_and_linger])
def test_the_blocking_client_raises_the_reason_of_a_refused_connection(
        tmp_path: Path, script: Script) -> None:
    path = tmp_path / "d.sock"
    with scripted_daemon(path, script):
        for _ in range(3):  # the refusal may land before or after the request is sent
            with Client(path, timeout=5) as client, pytest.raises(errors.ShuttingDown):
                client.generate("x")


def test_the_async_client_raises_the_reason_of_a_refused_connection(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"

    async def run() -> None:
        async with AsyncClient(path, timeout=5) as client:
            with pytest.raises(errors.ShuttingDown):
                await client.generate("x")

    with scripted_daemon(path, refuse_and_linger):
        for _ in range(3):
            asyncio.run(run())
