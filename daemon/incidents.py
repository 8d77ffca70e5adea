"""Named events the front saw that an operator must act on (`Incidents`): a request the
scheduler lost, a socket file someone removed, an HTTP handler that raised.

Each kind is counted (in the front's counters, so `specctl stats` and /metrics show it)
and keeps its last case; `specctl status` prints one line per kind and `specctl doctor`
fails on any (`StatusReply.problems`, or `.fallbacks` for the front's degraded parts). The
record of each case is logged where it happens, once. No torch is imported here.
"""

from __future__ import annotations

from collections import Counter


class Incidents:
    """Kinds of incident seen since the front started: how often, and the last case."""

    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        self.last: dict[str, str] = {}

    def record(self, kind: str, detail: str) -> None:
        """One more `kind` (also `counters[kind]`); `detail` says what it was."""
        self.counters[kind] += 1
        self.last[kind] = detail

    def summary(self) -> dict[str, str]:
        """kind -> "N since start; last: detail" (what status shows)."""
        return {kind: f"{self.counters[kind]} since start; last: {detail}"
                for kind, detail in sorted(self.last.items())}
