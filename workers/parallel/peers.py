"""The other ranks as rank 0's runner, backends and model see them.

Under tensor parallelism every rank runs every model execution, in the same order, so
that all of them reach the same collectives. Rank 0 decides what runs: each place in its
runner or backends that executes the model (a forward, a compiled or captured step, the
logits, a KV copy) announces it first, `with peers.call(op, *args): <rank 0's part>`, and
the other ranks run the same op on their own shard and backend (worker.py). `Peers` itself
is the case where there is no one to tell: size 1, and ranks 1..N-1, which only follow.
The group rank 0 drives is driver.RankGroup.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class RankFailed(RuntimeError):
    """A rank or node died, or the process group broke: the engine cannot go on."""


class Peers:
    """Nobody to announce calls to (module docstring); the base of the group that has."""

    @property
    def is_leader(self) -> bool:
        """Whether calls are sent to other ranks (rank 0 of a group of several)."""
        return False

    @contextmanager
    def call(self, op: str, *args: Any) -> Iterator[None]:
        """Send (op, args) to the other ranks, then run the block: rank 0's part of the
        call. An exception in it that a rank gone or the process group caused leaves as
        `RankFailed` (driver.py); any other as raised (every rank raised it alike)."""
        del op, args
        yield


NO_PEERS = Peers()
