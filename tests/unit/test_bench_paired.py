"""The paired measurements' arithmetic (bench.paired) and how the targets read them: pure
functions checked on hand-made windows and pairs; the windows' requests against a stand-in
client."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any, cast

import pytest

from specd.daemon.bench.paired import (
    Batch1Pairs,
    PairedConfig,
    PairedRun,
    Window,
    request_lengths,
    run_paired,
    sequence_start,
    summarize_batch1_pairs,
    summarize_paired,
    tokens_in,
)
from specd.ipc.sampling import SamplingParams
from tools.bench_targets import check_targets


def _run(figures: dict[str, list[int]], seconds: float = 2.0,
         errors: dict[str, int] | None = None) -> PairedRun:
    """Windows of `seconds` each, cycle by cycle, `figures[mode][cycle]` tokens."""
    windows = []
    clock = 0.0
    for cycle in range(len(next(iter(figures.values())))):
        for mode, tokens in figures.items():
            windows.append(Window(mode, cycle + 1, clock, clock + seconds, tokens[cycle],
                                  1.0 if mode == "on" else 0.0))
            clock += seconds + 0.5
    return PairedRun(8, tuple(windows), 40, errors or {})


def test_a_window_counts_the_tokens_that_arrived_inside_it() -> None:
    arrivals = [(0.9, 3), (1.0, 4), (1.5, 1), (2.0, 7)]
    assert tokens_in(arrivals, 1.0, 2.0) == 5  # start counted, end not
    assert tokens_in(arrivals, 3.0, 4.0) == 0


def test_each_mode_is_pooled_over_its_windows_and_auto_compared_per_cycle() -> None:
    # cycle 2 is a slow spell of the machine for every mode alike: the pooled ratio and
    # the per-cycle ratios both see auto at the level of the better mode
    row = summarize_paired(_run({"off": [400, 200], "on": [600, 300], "auto": [594, 300]}))
    assert row["modes"]["on"]["tokens_per_s"] == pytest.approx(900 / 4.0)
    assert row["modes"]["off"]["tokens_per_s_by_cycle"] == pytest.approx([200.0, 100.0])
    assert row["auto_over_best"] == pytest.approx(894 / 900)
    assert row["auto_over_best_by_cycle"] == pytest.approx([0.99, 1.0])
    assert len(row["windows"]) == 6 and row["windows"][0]["seconds"] == pytest.approx(2.0)


def test_without_all_three_modes_there_is_no_auto_ratio() -> None:
    row = summarize_paired(_run({"off": [400], "on": [600]}))
    assert "auto_over_best" not in row and set(row["modes"]) == {"off", "on"}


def test_batch1_pairs_pool_tokens_over_seconds_on_each_side() -> None:
    pairs = Batch1Pairs(specd=((100, 0.5), (100, 1.0)), baseline=((100, 2.0), (100, 2.0)))
    row = summarize_batch1_pairs(pairs)
    assert row["specd_tokens_per_s"] == pytest.approx(200 / 1.5)
    assert row["baseline_tokens_per_s"] == pytest.approx(50.0)
    assert row["ratio"] == pytest.approx((200 / 1.5) / 50.0)
    assert row["ratio_by_pair"] == pytest.approx([4.0, 2.0])


def test_targets_read_the_paired_figures_where_they_ran() -> None:
    # the rounds' medians, taken seconds apart, put auto 10 % behind at c=8; the paired
    # windows, switched on one load, put it level: the target reads the paired figure and
    # keeps the rounds' one beside it
    points = [{"mode": mode, "concurrency": 8, "output_tokens_per_s": tps}
              for mode, tps in (("off", 400.0), ("on", 300.0), ("auto", 360.0))]
    paired = [summarize_paired(_run({"off": [800], "on": [600], "auto": [792]}))]
    (row,) = check_targets(points, None, paired)["auto_vs_best"]
    assert row["source"] == "paired windows" and row["met"]
    assert row["auto_over_best"] == pytest.approx(0.99)
    assert row["auto_over_best_rounds"] == pytest.approx(0.9)
    assert row["by_cycle"] == pytest.approx([0.99])


def test_a_paired_run_with_failed_requests_judges_nothing() -> None:
    points = [{"mode": mode, "concurrency": 8, "output_tokens_per_s": tps}
              for mode, tps in (("off", 400.0), ("on", 300.0), ("auto", 360.0))]
    paired = [summarize_paired(_run({"off": [800], "on": [600], "auto": [792]},
                                    errors={"overloaded": 1}))]
    (row,) = check_targets(points, None, paired)["auto_vs_best"]
    assert row["source"] == "rounds' medians" and not row["met"]


def test_the_batch1_target_reads_the_pairs() -> None:
    points = [{"mode": "on", "concurrency": 1, "output_tokens_per_s": 250.0}]
    pairs = summarize_batch1_pairs(Batch1Pairs(((128, 0.4),), ((128, 1.6),)))
    versus = check_targets(points, {"tokens_per_s": 100.0}, None, pairs)[
        "batch1_vs_transformers"]
    assert versus["source"] == "pairs" and versus["ratio"] == pytest.approx(4.0)
    assert versus["met"] is True and versus["ratio_rounds"] == pytest.approx(2.5)
    assert versus["by_pair"] == pytest.approx([4.0])


@pytest.mark.parametrize(("options", "message"), [
    ({"cycles": 0}, "cycles must be >= 1"),
    ({"window_s": 0.0}, "window_s must be > 0"),
    ({"settle_s": -1.0}, "settle_s must be >= 0"),
])
def test_paired_config_rejects_what_cannot_measure(options: dict[str, Any],
                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PairedConfig(**options)


def test_paired_request_lengths_vary_around_max_tokens_and_first_ones_are_cut() -> None:
    # equal lengths would move the clients in waves (all prefill, all decode together)
    rng = random.Random(0)
    later = [request_lengths(128, 0.5, rng, first=False) for _ in range(2000)]
    assert min(later) >= 64 and max(later) <= 192
    assert sum(later) / len(later) == pytest.approx(128, rel=0.03)
    assert len(set(later)) > 100
    first = [request_lengths(128, 0.5, rng, first=True) for _ in range(2000)]
    assert min(first) >= 2 and max(first) <= 192 and min(first) < 20
    assert {request_lengths(128, 0.0, rng, first=False) for _ in range(20)} == {128}
    assert request_lengths(2, 0.5, rng, first=False) >= 2


class SwitchingClient:
    """Stands in for the daemon in `run_paired`, with no clock of its own: a request
    yields to the event loop once, then streams its tokens in one frame, and `stats()`
    returns only once every client has started `REQUESTS_PER_SWITCH` requests since the
    last mode switch. `run_paired` calls `stats()` right before it opens a window and right
    after it closes one, so what each window holds is decided by these counts, not by how
    fast the machine runs. Records, per switch, the (prompt, length) of every request
    started after it, and the tokens it delivered inside each window (between the two
    `stats()` calls around it). Its counters say every token of an "on" window came from
    speculative steps (one verify pass per frame) and none of an "off" one."""

    REQUESTS_PER_SWITCH = 3

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.mode = ""
        self.num_switches = 0
        self.started: dict[int, list[tuple[str, int]]] = {}
        self.in_window = False
        self.window_tokens: list[int] = []
        self.counters = {"num_verify_passes": 0, "num_accepted": 0, "num_generated_tokens": 0}

    async def set_spec(self, mode: str) -> str:
        self.mode = mode
        self.num_switches += 1
        return mode

    def _client_counts(self) -> list[int]:
        started = self.started.get(self.num_switches, [])
        return [sum(1 for prompt, _ in started if int(prompt[1:]) % self.concurrency == c)
                for c in range(self.concurrency)]

    async def stats(self) -> dict[str, Any]:
        if self.in_window:  # the window just closed
            self.in_window = False
        else:
            while min(self._client_counts()) < self.REQUESTS_PER_SWITCH:
                await asyncio.sleep(0)
            self.in_window = True
            self.window_tokens.append(0)
        return {"engine": dict(self.counters)}

    async def timed_request(self, prompt: str, sampling: SamplingParams,
                            on_tokens: Callable[[float, int], None] | None = None) -> None:
        self.started.setdefault(self.num_switches, []).append((prompt, sampling.max_tokens))
        await asyncio.sleep(0)
        tokens = sampling.max_tokens
        self.counters["num_generated_tokens"] += tokens
        if self.mode == "on":
            self.counters["num_verify_passes"] += 1
            self.counters["num_accepted"] += tokens - 1
        if self.in_window:
            self.window_tokens[-1] += tokens
        if on_tokens is not None:
            on_tokens(time.perf_counter(), tokens)


def _run_switching(client: SwitchingClient, cycles: int) -> PairedRun:
    # Wall-clock times only as short as the config allows: the counts above decide.
    config = PairedConfig(cycles=cycles, window_s=1e-3, settle_s=0.0, warm_s=0.0)
    prompts = [f"p{i}" for i in range(1000)]
    return asyncio.run(asyncio.wait_for(
        run_paired(cast(Any, client),  # a stand-in for BenchClient: the calls it makes
                   prompts, SamplingParams(max_tokens=8), ["off", "on", "auto"],
                   client.concurrency, config), timeout=60))


def test_the_modes_of_a_cycle_serve_the_same_requests() -> None:
    # Common random numbers: at each switch every client restarts at its cycle's point of
    # the prompt and length sequence, so a cycle's windows differ only by the mode.
    client = SwitchingClient(concurrency=2)
    run = _run_switching(client, cycles=2)
    assert [(w.cycle, w.mode) for w in run.windows] == [
        (1, "off"), (1, "on"), (1, "auto"), (2, "on"), (2, "auto"), (2, "off")]

    def first_requests(switch: int) -> list[list[tuple[str, int]]]:
        """Each client's first requests after a switch (client = prompt index mod 2)."""
        started = client.started[switch]
        return [[r for r in started if int(r[0][1:]) % 2 == c][:3] for c in (0, 1)]

    # switch 1 is the warm-up's set_spec; switches 2-4 are cycle 1, 5-7 cycle 2
    cycle_1, cycle_2 = (first_requests(2), first_requests(5))
    for switches, first in (((2, 3, 4), cycle_1), ((5, 6, 7), cycle_2)):
        for k in switches:
            assert first_requests(k) == first
    for c in (0, 1):
        assert not set(cycle_1[c]) & set(cycle_2[c])  # other requests from cycle to cycle


def test_each_window_counts_the_tokens_delivered_inside_it_in_its_mode() -> None:
    client = SwitchingClient(concurrency=3)
    run = _run_switching(client, cycles=2)
    assert [w.tokens for w in run.windows] == client.window_tokens
    assert all(tokens > 0 for tokens in client.window_tokens)  # 3 requests each, at least
    for w in run.windows:
        # the counters read around each window show the mode the daemon ran in it
        assert w.spec_share == (1.0 if w.mode == "on" else 0.0)
    summary = summarize_paired(run)
    for mode, row in summary["modes"].items():
        assert row["tokens"] == sum(w.tokens for w in run.windows if w.mode == mode)


def test_a_cycles_sequence_start_depends_on_the_cycle_and_client_only() -> None:
    index, rng = sequence_start(0, 3, 1, 4)
    again_index, again_rng = sequence_start(0, 3, 1, 4)
    assert index == again_index and rng.random() == again_rng.random()
    assert sequence_start(0, 3, 2, 4)[0] != index and sequence_start(0, 4, 1, 4)[0] != index
