"""The benchmark's progress: by requests when their number is known, by points when points
end on time (`--max-duration`), one line per point when stderr is not a terminal."""

from __future__ import annotations

import io

from specd.daemon.bench.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_each_point_is_one_line_with_the_counts() -> None:
    out = io.StringIO()
    progress = Progress(2, 6, stream=out)
    progress.begin("off c=1")
    progress.advance(3)
    progress.begin("on c=1")
    progress.advance(3)
    progress.close()
    assert out.getvalue().splitlines() == [
        "bench: off c=1 (point 1/2, 0/6 requests done)",
        "bench: on c=1 (point 2/2, 3/6 requests done)"]


def test_points_bounded_by_time_count_requests_without_a_total() -> None:
    out = io.StringIO()
    progress = Progress(3, None, stream=out)
    progress.begin("off c=4")
    progress.advance(40)
    progress.begin("on c=4")
    assert out.getvalue().splitlines()[-1] == "bench: on c=4 (point 2/3, 40 requests done)"


def test_on_a_terminal_the_bar_follows_requests_or_finished_points() -> None:
    by_requests = _Terminal()
    progress = Progress(2, 4, stream=by_requests)
    progress.begin("off c=1")
    progress.advance(2)
    progress.close()
    assert "[" + "#" * 15 + "-" * 15 + "] point 1/2, 2/4 requests done" in by_requests.getvalue()
    by_points = _Terminal()
    progress = Progress(4, None, stream=by_points)
    for stage in ("a", "b", "c"):
        progress.begin(stage)
    last = by_points.getvalue().split("\r")[-1]
    # two of four points finished (the third is running): half the bar
    assert last.startswith("[" + "#" * 15 + "-" * 15 + "] point 3/4, 0 requests done")
