"""The socket file clients connect to: a removed one that the daemon bound is bound again,
one that systemd owns (or a file put in its place) is reported once, and at exit only the
daemon's own file is removed."""

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path

from specd.daemon.activation import bind_unix_socket
from specd.daemon.incidents import Incidents
from specd.daemon.socket_watch import CHECK_S, SocketWatch


def _watch(path: Path, is_owned: bool) -> tuple[socket.socket, SocketWatch, Incidents]:
    listener = bind_unix_socket(str(path), 0o600, backlog=4)
    return listener, SocketWatch(listener, is_owned, 0o600, 4), Incidents(Counter())


def test_a_removed_socket_of_ours_is_bound_again_and_reachable(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    listener, watch, problems = _watch(path, is_owned=True)
    assert watch.check(CHECK_S, problems) is None  # unchanged
    path.unlink()
    assert watch.check(CHECK_S / 2, problems) is None  # checked at most every CHECK_S
    rebound = watch.check(3 * CHECK_S, problems)
    assert rebound is not None and path.exists() and not watch.lost
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(str(path))  # the new listener's backlog takes it
    assert not problems.last
    watch.remove_if_ours()
    assert not path.exists()
    rebound.close()
    listener.close()


def test_a_removed_socket_of_systemds_is_reported_once(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    listener, watch, problems = _watch(path, is_owned=False)
    path.unlink()
    assert watch.check(CHECK_S, problems) is None and not path.exists()
    assert watch.lost.startswith(f"the socket file {path} was removed: new clients cannot "
                                 "connect")
    assert watch.check(3 * CHECK_S, problems) is None
    assert problems.counters["socket_missing"] == 1
    listener.close()


def test_a_file_in_its_place_is_left_alone_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    listener, watch, problems = _watch(path, is_owned=True)
    path.unlink()
    path.write_text("someone else's")
    assert watch.check(CHECK_S, problems) is None
    assert "was replaced by another file" in watch.lost
    watch.remove_if_ours()
    assert path.read_text() == "someone else's"
    listener.close()
