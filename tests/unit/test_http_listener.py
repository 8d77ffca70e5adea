"""The HTTP options (`--http`, `--api-key-file`), the bound port and its keys
(daemon/http/listener.py), and the count of scheduler restarts kept in the state
directory."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specd.daemon import main as daemon_main
from specd.daemon.config import DaemonConfig
from specd.daemon.http.listener import HttpListener, load_api_keys, open_http_listener
from specd.exit_codes import EXIT_CONFIG


@pytest.mark.parametrize("text, address", [
    ("8000", ("127.0.0.1", 8000)),
    (":8000", ("127.0.0.1", 8000)),
    ("0.0.0.0:80", ("0.0.0.0", 80)),
    ("[::1]:0", ("::1", 0)),
    ("example.internal:443", ("example.internal", 443)),
])
def test_http_addresses(text: str, address: tuple[str, int]) -> None:
    assert DaemonConfig(http=text).http_address == address


@pytest.mark.parametrize("text", ["", "x", "host:", "host:65536", "::1:80", "1.2.3.4:-1"])
def test_bad_http_addresses_name_the_option(text: str) -> None:
    with pytest.raises(ValueError, match="http"):
        DaemonConfig(http=text)


def test_http_is_off_by_default_and_keys_need_it() -> None:
    assert DaemonConfig().http_address is None
    assert open_http_listener(DaemonConfig()) is None
    with pytest.raises(ValueError, match="api_key_file needs http"):
        DaemonConfig(api_key_file=Path("/etc/specd/keys"))


def test_api_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# operators\nsk-one\n\n  sk-two  \n")
    assert load_api_keys(path) == (b"sk-one", b"sk-two")
    path.write_text("# nothing here\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(path)
    with pytest.raises(OSError):
        load_api_keys(tmp_path / "missing")


def test_bearer_keys() -> None:
    with socket.socket() as sock:
        guarded = HttpListener(sock, (b"sk-one", b"sk-two"))
        assert guarded.is_authorized("Bearer sk-two")
        assert guarded.is_authorized("bearer sk-one")
        for header in (None, "", "Bearer", "Bearer sk-on", "Bearer sk-one2", "Basic sk-one",
                       "sk-one"):
            assert not guarded.is_authorized(header), header
        assert HttpListener(sock, ()).is_authorized(None)  # no keys: open


def test_the_listener_binds_loopback_by_default(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-1\n")
    listener = open_http_listener(DaemonConfig(http="0", api_key_file=keys))
    assert listener is not None
    with listener.sock:
        host, port = listener.address
        assert host == "127.0.0.1" and port > 0 and listener.api_keys == (b"sk-1",)
        # A second daemon on the same port: OSError, which main reports as exit 78.
        with pytest.raises(OSError):
            open_http_listener(DaemonConfig(http=f"127.0.0.1:{port}"))


def test_an_unusable_http_setup_exits_78_before_the_scheduler(tmp_path: Path) -> None:
    for args, named in ((["--http", "nope"], "http expects HOST:PORT"),
                        (["--http", "0", "--api-key-file", str(tmp_path / "missing")],
                         "cannot serve HTTP")):
        result = subprocess.run(
            [sys.executable, "-m", "specd.daemon.main", "--socket", str(tmp_path / "s.sock"),
             "--log-format", "json", *args], capture_output=True, text=True, timeout=120)
        assert result.returncode == EXIT_CONFIG, result.stderr
        assert named in result.stderr + result.stdout
        assert "scheduler_spawned" not in result.stdout + result.stderr


def test_scheduler_restarts_are_counted_in_the_state_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    assert DaemonConfig().restart_count_path is None  # nothing restarts us: nothing kept
    assert daemon_main._read_restart_count(None) == 0
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}:/elsewhere")
    path = DaemonConfig().restart_count_path
    assert path == tmp_path / "scheduler_restarts"
    assert daemon_main._read_restart_count(path) == 0
    daemon_main._write_restart_count(path, 3)
    assert daemon_main._read_restart_count(path) == 3
    path.write_text("garbage")
    assert daemon_main._read_restart_count(path) == 0  # logged, counted from 0 again
