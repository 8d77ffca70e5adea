"""A progress bar on stderr for long benchmark runs (no dependency beyond the standard
library). On a terminal the bar is redrawn in place; otherwise one line per stage, so logs
of a run in CI stay readable."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30
REDRAW_INTERVAL_S = 0.1


class Progress:
    """Counts finished units (requests) out of `total`; `begin` names the current stage."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.stream.isatty()
        self.done = 0
        self.stage = ""
        self.started = time.monotonic()
        self.last_drawn = 0.0

    def begin(self, stage: str) -> None:
        self.stage = stage
        if not self.is_tty:
            self.stream.write(f"bench: {stage} ({self.done}/{self.total} requests done)\n")
            self.stream.flush()
        self._draw(force=True)

    def advance(self, count: int = 1) -> None:
        self.done += count
        self._draw(force=self.done >= self.total)

    def close(self) -> None:
        if self.is_tty:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, force: bool) -> None:
        now = time.monotonic()
        if not self.is_tty or (not force and now - self.last_drawn < REDRAW_INTERVAL_S):
            return
        self.last_drawn = now
        filled = BAR_WIDTH * min(self.done, self.total) // self.total
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} requests  "
                          f"{now - self.started:6.1f} s  {self.stage:<16}")
        self.stream.flush()
