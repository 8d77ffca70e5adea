"""Paired windows: the speculation modes compared on one running load.

The sweep's points measure each mode for several seconds, one mode after another. On a
machine whose speed drifts by tens of percent within seconds (a shared 2-core VM: a
single-threaded matmul loop there swings 60 % within 15 s), two modes measured 8 s apart
differ by more than the few percent `auto` must be judged on. Here the load never stops:
`concurrency` clients run a closed loop without end, the daemon's mode is switched every
`window_s + settle_s` seconds (off, on, auto, rotated each cycle), and each window counts
the output tokens the clients received in it. Each mode's throughput is its tokens over
its windows' time, summed over the cycles, so every mode samples the machine's slow and
fast spells alike; the ratio is also given per cycle, to show its spread.

What it measures is steady-state throughput at a full batch (the clients' next requests
keep it at `concurrency`). The requests' lengths vary around `max_tokens` (uniform within
+-`length_spread`), and each client's first request is cut at a uniform point, so that the
requests end at times spread over their lifetime: with equal lengths the clients move in
waves (all prefill together, all decode, all end), a wave lasts about as long as a window,
and whether a window holds a wave's prefill burst (and which mode it was) would decide its
figure. A switch's transition (the step in flight, a drain with overlap scheduling) falls
in the `settle_s` before a window, which is not counted. Per-request latencies stay with
the points (a request here can span two modes).

The modes of one cycle serve the same requests (common random numbers): at each switch
every client restarts its sequence of prompts and lengths from a point that depends only on
the cycle, so the windows of a cycle differ by the mode, not by which prompts they drew.
Acceptance varies several-fold from prompt to prompt (batch 1 against transformers:
1.8-5.7x by prompt), and with each client's own endless sequence a 3 s window at low
concurrency held a handful of requests: on one VM the same code path read 0.70-1.23x of
itself window by window (run 8a). A request in flight at a switch finishes in the next
mode's settle time or window, as before.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from specd.daemon.bench.client import BenchClient
from specd.daemon.bench.progress import Progress
from specd.ipc.errors import SpecdError
from specd.ipc.messages import SPEC_MODES
from specd.ipc.sampling import SamplingParams


def round_order(modes: list[str], round_index: int) -> list[str]:
    """The modes in the order round `round_index` (1-based) runs them: rotated by one per
    round, so that over len(modes) rounds each mode runs once in each position (first
    after a concurrency change, right after each other mode)."""
    shift = (round_index - 1) % len(modes)
    return modes[shift:] + modes[:shift]


@dataclass(frozen=True)
class PairedConfig:
    """cycles: windows per mode; window_s: a counted window; settle_s: uncounted time
    after each switch; warm_s: uncounted time before the first window (the clients' first
    requests are prefilled and the batch fills); length_spread: requests' lengths vary
    within +-this fraction of max_tokens (`request_lengths`); seed: of those draws."""

    cycles: int = 4
    window_s: float = 3.0
    settle_s: float = 0.5
    warm_s: float = 2.0
    length_spread: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.cycles < 1:
            raise ValueError(f"cycles must be >= 1, got {self.cycles}")
        if not 0.0 <= self.length_spread < 1.0:
            raise ValueError(f"length_spread must be in [0, 1), got {self.length_spread}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if not self.settle_s >= 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s}")
        if not self.warm_s >= 0:
            raise ValueError(f"warm_s must be >= 0, got {self.warm_s}")


@dataclass(frozen=True)
class Window:
    """One counted window: `tokens` output tokens received in [start, end) while the
    daemon ran `mode`; the engine's counters over it give the share of tokens that
    speculative steps made (None when the daemon does not report them)."""

    mode: str
    cycle: int  # 1-based
    start: float
    end: float
    tokens: int
    spec_share: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.end - self.start)


@dataclass(frozen=True)
class PairedRun:
    """The windows of one concurrency; `errors` counts failed requests by code (a run
    with any did not hold the load at the concurrency asked)."""

    concurrency: int
    windows: tuple[Window, ...]
    num_requests: int
    errors: dict[str, int]


def request_lengths(max_tokens: int, spread: float, rng: random.Random, first: bool) -> int:
    """Output tokens of a paired-window request: uniform in [m(1 - spread), m(1 + spread)]
    (m = max_tokens, at least 2), or, for a client's first request, uniform in
    [2, m(1 + spread)] (a request met mid-life in a steady load)."""
    high = max(2, round(max_tokens * (1 + spread)))
    low = 2 if first else max(2, round(max_tokens * (1 - spread)))
    return rng.randint(low, high)


def sequence_start(seed: int, cycle: int, client: int, concurrency: int
                   ) -> tuple[int, random.Random]:
    """Where client `client`'s requests start in `cycle` (0: the warm-up): the index of its
    first prompt (it then steps by `concurrency`) and the generator of its lengths. The
    same for every mode of a cycle, different from cycle to cycle."""
    index = client + cycle * concurrency * 64  # past what a client sends in a window
    return index, random.Random((seed * 1_000_003 + cycle) * 1_000_003 + client)


def tokens_in(arrivals: list[tuple[float, int]], start: float, end: float) -> int:
    """Tokens of the arrivals (time, count) with start <= time < end."""
    return sum(n for t, n in arrivals if start <= t < end)


def counter_spec_share(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """The share of output tokens that speculative steps made between two stats replies:
    each verify pass emits its accepted drafts + 1 token, so (accepted + verify passes) /
    generated tokens; None without the counters or without tokens."""
    a, b = before.get("engine", {}), after.get("engine", {})
    keys = ("num_verify_passes", "num_accepted", "num_generated_tokens")
    if any(a.get(k) is None or b.get(k) is None for k in keys):
        return None
    passes, accepted, generated = (int(b[k]) - int(a[k]) for k in keys)
    return min(1.0, (passes + accepted) / generated) if generated > 0 else None


async def run_paired(client: BenchClient, prompts: list[str], sampling: SamplingParams,
                     modes: list[str], concurrency: int, config: PairedConfig,
                     progress: Progress | None = None) -> PairedRun:
    """Run the closed loop at `concurrency` and count each mode's windows (see the module
    docstring). The mode the daemon had is not restored here (the sweep restores it)."""
    arrivals: list[tuple[float, int]] = []  # (time, tokens) of every frame, all clients
    errors: dict[str, int] = {}
    finished = 0
    stop = asyncio.Event()
    # The clients' sequences restart at every switch (module docstring): switches counts
    # them, cycle_of_switch is the cycle whose sequence they restart to (0: the warm-up).
    switches, cycle_of_switch = 0, 0

    def on_tokens(now: float, count: int) -> None:
        arrivals.append((now, count))

    async def worker(first: int) -> None:
        nonlocal finished
        seen = -1
        while not stop.is_set():
            if seen != switches:  # a new window: this cycle's sequence, from its start
                seen = switches
                index, rng = sequence_start(config.seed, cycle_of_switch, first, concurrency)
                cut = seen == 0  # the first request met mid-life (a steady start)
            length = request_lengths(sampling.max_tokens, config.length_spread, rng, cut)
            cut = False
            try:
                await client.timed_request(prompts[index % len(prompts)],
                                           msgspec.structs.replace(sampling, max_tokens=length),
                                           on_tokens=on_tokens)
            except SpecdError as exc:
                errors[exc.code] = errors.get(exc.code, 0) + 1
                return  # this client stops: the run is marked by its errors
            finished += 1
            if progress is not None:
                progress.advance()
            index += concurrency

    spans: list[tuple[str, int, float, float, float | None]] = []
    await client.set_spec(modes[0])
    workers = [asyncio.create_task(worker(k)) for k in range(concurrency)]
    try:
        await asyncio.sleep(config.warm_s)
        for cycle in range(1, config.cycles + 1):
            for mode in round_order(modes, cycle):
                await client.set_spec(mode)
                switches, cycle_of_switch = switches + 1, cycle
                await asyncio.sleep(config.settle_s)
                before = await client.stats()
                start = time.perf_counter()
                await asyncio.sleep(config.window_s)
                end = time.perf_counter()
                share = counter_spec_share(before, await client.stats())
                spans.append((mode, cycle, start, end, share))
    finally:
        # Each client ends its request in flight (no abort: nothing is left half-sent).
        stop.set()
        await asyncio.gather(*workers)
    windows = tuple(Window(mode, cycle, start, end, tokens_in(arrivals, start, end), share)
                    for mode, cycle, start, end, share in spans)
    return PairedRun(concurrency, windows, finished, errors)


def summarize_paired(run: PairedRun) -> dict[str, Any]:
    """JSON-ready: per mode its pooled tokens/s (tokens over window time, all cycles) and
    per-cycle figures; with off, on and auto present, auto over the better of on and off,
    pooled and per cycle."""
    modes: dict[str, dict[str, Any]] = {}
    for w in run.windows:
        row = modes.setdefault(w.mode, {"tokens": 0, "seconds": 0.0, "tokens_per_s_by_cycle":
                                        [], "spec_share_by_cycle": []})
        row["tokens"] += w.tokens
        row["seconds"] += w.end - w.start
        row["tokens_per_s_by_cycle"].append(w.tokens_per_s)
        row["spec_share_by_cycle"].append(w.spec_share)
    for row in modes.values():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
    result: dict[str, Any] = {"concurrency": run.concurrency, "num_requests": run.num_requests,
                              "errors": dict(run.errors), "modes": modes,
                              "windows": [{"mode": w.mode, "cycle": w.cycle,
                                           "seconds": w.end - w.start, "tokens": w.tokens,
                                           "spec_share": w.spec_share} for w in run.windows]}
    if all(mode in modes for mode in SPEC_MODES):
        best = max(modes["on"]["tokens_per_s"], modes["off"]["tokens_per_s"])
        by_cycle = [a / max(on, off) for a, on, off in zip(
            modes["auto"]["tokens_per_s_by_cycle"], modes["on"]["tokens_per_s_by_cycle"],
            modes["off"]["tokens_per_s_by_cycle"], strict=True) if max(on, off) > 0]
        result["auto_over_best"] = modes["auto"]["tokens_per_s"] / best if best > 0 else None
        result["auto_over_best_by_cycle"] = by_cycle
    return result


# ---- batch 1 against a baseline -------------------------------------------------------------

BaselinePrompt = Callable[[int], tuple[int, float]]  # prompt index -> (tokens, seconds)


@dataclass(frozen=True)
class Batch1Pairs:
    """specd (spec on, batch 1) and the baseline taking turns, one prompt each: pair i is
    prompt i through specd, then through the baseline. (tokens, seconds) per prompt."""

    specd: tuple[tuple[int, float], ...]
    baseline: tuple[tuple[int, float], ...]


async def run_batch1_pairs(client: BenchClient, prompts: list[str], sampling: SamplingParams,
                           num_pairs: int, baseline_prompt: BaselinePrompt,
                           progress: Progress | None = None) -> Batch1Pairs:
    """Alternate one specd request (speculation on) and one baseline generation per
    prompt, so that the two sides of each pair run seconds apart on the same machine
    state. The baseline runs in a thread while the daemon is idle."""
    ours: list[tuple[int, float]] = []
    theirs: list[tuple[int, float]] = []
    await client.set_spec("on")
    for index in range(num_pairs):
        record = await client.timed_request(prompts[index % len(prompts)], sampling)
        ours.append((record.num_output_tokens, record.latency_s))
        theirs.append(await asyncio.to_thread(baseline_prompt, index))
        if progress is not None:
            progress.advance()
    return Batch1Pairs(tuple(ours), tuple(theirs))


def summarize_batch1_pairs(pairs: Batch1Pairs) -> dict[str, Any]:
    """Each side's tokens/s over all its prompts (tokens over seconds, pooled), their
    ratio, and the ratio per pair."""
    def rate(rows: tuple[tuple[int, float], ...]) -> float:
        return sum(n for n, _ in rows) / sum(s for _, s in rows)

    ours, theirs = rate(pairs.specd), rate(pairs.baseline)
    return {"num_pairs": len(pairs.specd), "specd_tokens_per_s": ours,
            "baseline_tokens_per_s": theirs, "ratio": ours / theirs,
            "ratio_by_pair": [(a / sa) / (b / sb) for (a, sa), (b, sb)
                              in zip(pairs.specd, pairs.baseline, strict=True)]}
