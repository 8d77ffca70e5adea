"""Link directories name their front's pid, so that a dead front's (kill -9 runs no cleanup)
is removed at the next start and a live daemon's never is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specd.ipc.zmq_link import LinkPaths, remove_stale_links


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_link_directory_names_its_front(tmp_path: Path) -> None:
    paths = LinkPaths.create(tmp_path)
    assert paths.runtime_dir.parent == tmp_path and paths.owner_pid == os.getpid()
    assert paths.runtime_dir.stat().st_mode & 0o777 == 0o700
    assert LinkPaths(tmp_path / "link-abc").owner_pid is None


def test_only_dead_fronts_link_directories_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / f"link-{dead_pid()}-x1y2"
    (dead / "sub").mkdir(parents=True)
    (dead / "to-scheduler.sock").write_text("")
    live_parent = tmp_path / f"link-{os.getppid()}-abcd"
    live_parent.mkdir()
    ours = LinkPaths.create(tmp_path).runtime_dir
    unnamed = tmp_path / "link-k3j_2x"  # no pid in the name: whose it is is unknown
    unnamed.mkdir()
    other = tmp_path / "specd.sock"
    other.write_text("")

    removed, failed = remove_stale_links(tmp_path)

    assert removed == [dead] and failed == []
    assert not dead.exists()
    assert live_parent.is_dir() and ours.is_dir() and unnamed.is_dir() and other.exists()
