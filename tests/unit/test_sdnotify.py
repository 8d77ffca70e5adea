"""sd_notify: the datagrams a fake NOTIFY_SOCKET receives, address forms, watchdog interval."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from specd.daemon import sdnotify
from specd.daemon.sdnotify import Notifier, child_environ


class FakeNotifySocket:
    """A datagram socket standing in for systemd's notify socket; records what arrives."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(2.0)

    def receive(self) -> str:
        return self.sock.recv(4096).decode()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in sdnotify.SYSTEMD_SERVICE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def fake_socket(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> Iterator[FakeNotifySocket]:
    path = str(tmp_path / "notify")
    fake = FakeNotifySocket(path)
    clean_env.setenv("NOTIFY_SOCKET", path)
    yield fake
    fake.close()


def test_message_sequence_over_filesystem_socket(fake_socket: FakeNotifySocket) -> None:
    notifier = Notifier.from_env()
    assert notifier.enabled
    assert notifier.status("loading weights 3/40")
    assert notifier.extend_timeout(90)
    assert notifier.ready()
    assert notifier.watchdog()
    assert notifier.stopping()
    received = [fake_socket.receive() for _ in range(5)]
    assert received == [
        "STATUS=loading weights 3/40",
        "EXTEND_TIMEOUT_USEC=90000000",
        "READY=1",
        "WATCHDOG=1",
        "STOPPING=1",
    ]
    notifier.close()


def test_abstract_address(clean_env: pytest.MonkeyPatch) -> None:
    name = f"specd-test-notify-{os.getpid()}"
    fake = FakeNotifySocket(b"\0" + name.encode())
    clean_env.setenv("NOTIFY_SOCKET", "@" + name)
    notifier = Notifier.from_env()
    assert notifier.ready()
    assert fake.receive() == "READY=1"
    fake.close()
    notifier.close()


def test_status_is_one_line_and_fractional_extension_in_microseconds(
    fake_socket: FakeNotifySocket,
) -> None:
    notifier = Notifier.from_env()
    notifier.status("FAILED:\nscheduler died rc=-9")
    notifier.extend_timeout(0.25)
    assert fake_socket.receive() == "STATUS=FAILED: scheduler died rc=-9"
    assert fake_socket.receive() == "EXTEND_TIMEOUT_USEC=250000"
    with pytest.raises(ValueError, match="seconds must be > 0"):
        notifier.extend_timeout(0)


def test_no_op_without_notify_socket(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("WATCHDOG_USEC", "10000000")
    notifier = Notifier.from_env()
    assert not notifier.enabled
    assert notifier.watchdog_interval is None  # nothing to ping without a socket
    assert notifier.ready() is False
    assert notifier.watchdog() is False
    assert notifier.num_send_failures == 0


def test_watchdog_interval_is_half_of_watchdog_usec(
    fake_socket: FakeNotifySocket, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("WATCHDOG_USEC", "30000000")
    assert Notifier.from_env().watchdog_interval == 15.0
    clean_env.setenv("WATCHDOG_PID", str(os.getpid()))
    assert Notifier.from_env().watchdog_interval == 15.0
    # A watchdog meant for another process (we inherited the variables) is not ours to feed.
    clean_env.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert Notifier.from_env().watchdog_interval is None


def test_malformed_environment_is_logged_not_fatal(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clean_env.setenv("NOTIFY_SOCKET", "relative/path")
    clean_env.setenv("WATCHDOG_USEC", "soon")
    with caplog.at_level(logging.WARNING, logger="specd.daemon.sdnotify"):
        notifier = Notifier.from_env()
    assert not notifier.enabled
    assert notifier.watchdog_interval is None
    assert "NOTIFY_SOCKET='relative/path'" in caplog.text
    with pytest.raises(ValueError, match="WATCHDOG_USEC='soon'"):
        sdnotify.parse_watchdog_interval("soon", None, 1)


def test_send_failure_is_logged_once_and_counted(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clean_env.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    notifier = Notifier.from_env()
    with caplog.at_level(logging.DEBUG, logger="specd.daemon.sdnotify"):
        assert notifier.ready() is False
        assert notifier.watchdog() is False
    assert notifier.num_send_failures == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "READY=1" in warnings[0].getMessage()


def test_child_environ_drops_systemd_variables() -> None:
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "LISTEN_FDS": "1", "PATH": "/bin"}
    assert child_environ(env) == {"PATH": "/bin"}
