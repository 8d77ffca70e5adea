"""Where the daemon's socket is, defined once: the daemon listens there by default
(`DaemonConfig.socket_path`) and clients connect there unless told otherwise."""

from __future__ import annotations

import os
from pathlib import Path


def default_socket_path() -> Path:
    """`/run/specd/specd.sock` for root, else `$XDG_RUNTIME_DIR/specd/specd.sock`
    (falling back to `/tmp/specd-<uid>/specd.sock` when XDG_RUNTIME_DIR is unset)."""
    if os.geteuid() == 0:
        return Path("/run/specd/specd.sock")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "specd" / "specd.sock"
    return Path(f"/tmp/specd-{os.geteuid()}") / "specd.sock"


def client_socket_path() -> Path:
    """$SPECD_SOCKET, else the daemon's default."""
    env = os.environ.get("SPECD_SOCKET")
    return Path(env) if env else default_socket_path()
