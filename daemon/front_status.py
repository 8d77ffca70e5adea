"""Where the front stands, shared by its parts: the lifecycle state (`lifecycle.State`), the
scheduler's start-up stage, the `Ready` the front accepted, and when the front started; and
how a part runs a task of its own (`Spawn`).

`Front` alone writes the status (as the scheduler's messages arrive, on a drain, on a
failure); the request flow, the control requests, the health watch and the HTTP API read
it. No torch is imported here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeAlias

from specd.daemon.lifecycle import State
from specd.ipc import messages as m

# Runs a coroutine as a task of the front's, cancelled when the front exits (`Front.spawn`).
Spawn: TypeAlias = Callable[[Coroutine[Any, Any, None]], None]


class FrontStatus:
    """state: starting -> ready -> draining, or failed. scheduler_stage: the scheduler's
    last start-up stage (`spawn` until it reports one). ready: its `Ready`, once accepted
    (None before: generate requests are refused). started: `time.monotonic()` when the
    front was built (uptime, the start-up timeout)."""

    def __init__(self) -> None:
        self.state = State.STARTING
        self.scheduler_stage = "spawn"
        self.ready: m.Ready | None = None
        self.started = time.monotonic()
