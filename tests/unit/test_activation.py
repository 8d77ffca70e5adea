"""Listening socket: from LISTEN_FDS in a real child process, or bound with stale-file rules."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from specd.daemon.activation import SocketInUseError, bind_unix_socket, listening_socket_from_env

# Runs in a child: move the inherited descriptor to fd 3, set LISTEN_PID to the child's own
# pid (as systemd does after fork), take the socket, report, and serve one connection.
CHILD = r"""
import json, os, socket, sys
from specd.daemon.activation import listening_socket_from_env
os.dup2(int(sys.argv[1]), 3)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="specd.socket")
try:
    sock = listening_socket_from_env()
except ValueError as exc:
    print(json.dumps({"error": str(exc)}), flush=True)
    sys.exit(78)
print(json.dumps({
    "fd": sock.fileno(),
    "inheritable": os.get_inheritable(3),
    "env_left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
}), flush=True)
conn, _ = sock.accept()
conn.sendall(b"hello from " + conn.recv(16))
conn.close()
"""


def run_child(sock: socket.socket) -> subprocess.Popen[str]:
    fd = sock.fileno()
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(fd)], pass_fds=(fd,), stdout=subprocess.PIPE, text=True
    )


def test_child_takes_passed_listening_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "specd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    child = run_child(listener)
    listener.close()  # only the child holds it now
    assert child.stdout is not None
    report = json.loads(child.stdout.readline())
    assert report == {"fd": 3, "inheritable": False, "env_left": []}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect(path)
        client.sendall(b"test")
        assert client.recv(64) == b"hello from test"
    assert child.wait(timeout=10) == 0


def test_child_refuses_a_socket_that_is_not_listening(tmp_path: Path) -> None:
    not_listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    not_listening.bind(str(tmp_path / "idle.sock"))
    child = run_child(not_listening)
    not_listening.close()
    assert child.stdout is not None
    report = json.loads(child.stdout.readline())
    assert "is not listening" in report["error"]
    assert child.wait(timeout=10) == 78


def test_no_activation_without_env_or_for_another_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LISTEN_PID", raising=False)
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    assert listening_socket_from_env() is None
    # Variables inherited from a parent that was activated: not ours, and cleared.
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    monkeypatch.setenv("LISTEN_FDS", "1")
    monkeypatch.setenv("LISTEN_FDNAMES", "specd.socket")
    assert listening_socket_from_env() is None
    assert not any(k.startswith("LISTEN_") for k in os.environ)


def test_more_than_one_descriptor_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
    monkeypatch.setenv("LISTEN_FDS", "2")
    with pytest.raises(ValueError, match="expects exactly one listening socket"):
        listening_socket_from_env()


def test_bind_sets_mode_and_listens(tmp_path: Path) -> None:
    path = str(tmp_path / "specd.sock")
    sock = bind_unix_socket(path, mode=0o660)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    sock.close()


def test_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = str(tmp_path / "specd.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens: connect is refused
    sock = bind_unix_socket(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(path)
    sock.close()


def test_live_socket_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = str(tmp_path / "specd.sock")
    live = bind_unix_socket(path)
    inode = os.stat(path).st_ino
    with pytest.raises(SocketInUseError, match="another process answers"):
        bind_unix_socket(path)
    assert os.stat(path).st_ino == inode
    live.close()


def test_non_socket_file_is_never_removed(tmp_path: Path) -> None:
    path = tmp_path / "specd.sock"
    path.write_text("not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        bind_unix_socket(str(path))
    assert path.read_text() == "not a socket"
