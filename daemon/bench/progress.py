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
    """Counts points (`begin` starts the next one and names it) out of `num_points`, and
    finished requests (`advance`) out of `num_requests`. The bar follows the requests when
    their number is known in advance (None: points bounded by time, whose request counts
    are not), else the points."""

    def __init__(self, num_points: int, num_requests: int | None,
                 stream: TextIO | None = None) -> None:
        self.num_points = max(1, num_points)
        self.num_requests = num_requests
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.stream.isatty()
        self.points_begun = 0
        self.done = 0  # requests finished
        self.stage = ""
        self.started = time.monotonic()
        self.last_drawn = 0.0

    def begin(self, stage: str) -> None:
        self.points_begun += 1
        self.stage = stage
        if not self.is_tty:
            self.stream.write(f"bench: {stage} ({self._counts()})\n")
            self.stream.flush()
        self._draw(force=True)

    def advance(self, count: int = 1) -> None:
        self.done += count
        self._draw(force=self.num_requests is not None and self.done >= self.num_requests)

    def close(self) -> None:
        if self.is_tty:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def _counts(self) -> str:
        requests = (f"{self.done}/{self.num_requests}" if self.num_requests is not None
                    else f"{self.done}")
        return f"point {self.points_begun}/{self.num_points}, {requests} requests done"

    def _fraction(self) -> float:
        if self.num_requests is not None:
            return min(1.0, self.done / max(1, self.num_requests))
        return max(0, self.points_begun - 1) / self.num_points  # points finished

    def _draw(self, force: bool) -> None:
        now = time.monotonic()
        if not self.is_tty or (not force and now - self.last_drawn < REDRAW_INTERVAL_S):
            return
        self.last_drawn = now
        filled = int(BAR_WIDTH * self._fraction())
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        self.stream.write(f"\r[{bar}] {self._counts()}  {now - self.started:6.1f} s  "
                          f"{self.stage:<24}")
        self.stream.flush()
