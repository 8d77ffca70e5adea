"""Serving benchmark: drive a running specd through the client library and measure it.

For each speculation mode (`off`, `on`, `auto`: switched in the daemon between runs) and
each point of a sweep, a closed loop of `concurrency` clients (or, with a request rate,
Poisson arrivals capped at `concurrency` in flight) sends held-out prompts (shipped with
the package, never the fixture's training text) and records, per request, the arrival
time of every streamed token. A point reports output tokens/s, requests/s, TTFT, time per
output token (TPOT), inter-token latency (ITL: the gap between two streamed deltas; with
speculation one delta may carry several tokens), acceptance length and the share of
engine steps that speculated. Greedy, `ignore_eos`, a fixed `max_tokens`: every request
produces the same number of tokens in every mode, so the modes are compared on equal work.

The timed requests are `client.BenchClient`'s; reporting (table, JSON, plots) lives in
`report`; `specctl bench` (command.py) and `tools/bench_serving.py` are the command lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specd.daemon.bench.client import BenchClient, RequestRecord
from specd.daemon.bench.paired import (
    BaselinePrompt,
    Batch1Pairs,
    PairedConfig,
    PairedRun,
    round_order,
    run_batch1_pairs,
    run_paired,
)
from specd.daemon.bench.progress import Progress
from specd.ipc.errors import SpecdError
from specd.ipc.messages import SPEC_MODES
from specd.ipc.sampling import SamplingParams
from specd.workers.config import FIXTURE_DIR

PROMPTS_FILE = FIXTURE_DIR / "heldout_prompts.jsonl"
DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)
STATS_INTERVAL_S = 0.25  # how often the engine's state is sampled during a point


def load_prompts(n: int, path: Path = PROMPTS_FILE) -> list[str]:
    """The first `n` held-out prompts of `path` (JSON lines with a "prompt" field),
    cycling when the file holds fewer."""
    rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line]
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [rows[i % len(rows)] for i in range(n)]


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark invocation.

    concurrencies: the sweep; with `request_rate` each value caps the requests in flight.
    request_rate: Poisson arrivals per second (None: closed loop, each client sends its next
        request when the previous one ends).
    num_requests: requests per point (None: max(8, 2 * concurrency)).
    max_duration_s: stop sending new requests at a point after this long (None: no limit).
    rounds: each concurrency is measured this many times per mode, the modes interleaved
        and their order rotated from round to round (a machine that drifts by tens of
        percent within minutes then biases no mode).
    paired: after the rounds of each concurrency, the modes' paired windows on one running
        load (paired.py; None: not run).
    batch1_pairs: with a baseline, this many prompts run alternately through specd (spec
        on, batch 1) and the baseline (paired.run_batch1_pairs; 0: not run).
    """

    modes: tuple[str, ...] = SPEC_MODES
    concurrencies: tuple[int, ...] = DEFAULT_CONCURRENCIES
    request_rate: float | None = None
    num_requests: int | None = None
    max_duration_s: float | None = None
    max_tokens: int = 64
    seed: int = 0
    timeout_s: float = 600.0
    rounds: int = 1
    paired: PairedConfig | None = None
    batch1_pairs: int = 0

    def __post_init__(self) -> None:
        if not self.modes or any(mode not in SPEC_MODES for mode in self.modes):
            raise ValueError(f"modes must be a non-empty subset of {SPEC_MODES}, got {self.modes}")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies must be >= 1, got {self.concurrencies}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.max_duration_s is not None and not self.max_duration_s > 0:
            raise ValueError(f"max_duration_s must be > 0, got {self.max_duration_s}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.batch1_pairs < 0:
            raise ValueError(f"batch1_pairs must be >= 0, got {self.batch1_pairs}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2 (TPOT needs two tokens), "
                             f"got {self.max_tokens}")

    def requests_at(self, concurrency: int) -> int:
        return self.num_requests if self.num_requests is not None else max(8, 2 * concurrency)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)


@dataclass(frozen=True)
class EngineSample:
    """The engine's state at one moment of a point (from `stats`)."""

    spec_active: bool
    num_running: int
    num_waiting: int
    kv_use: float  # fraction of KV blocks in use


def engine_sample(stats: dict[str, Any]) -> EngineSample:
    engine = stats.get("engine") or {}
    total = int(engine.get("num_kv_blocks", 0))
    free = int(engine.get("num_free_kv_blocks", 0))
    return EngineSample(spec_active=bool(engine.get("spec_active", False)),
                        num_running=int(engine.get("num_running", 0)),
                        num_waiting=int(engine.get("num_waiting", 0)),
                        kv_use=(total - free) / total if total else 0.0)


@dataclass(frozen=True)
class PointRun:
    """What one sweep point measured, before summary (see report.summarize)."""

    mode: str
    concurrency: int
    request_rate: float | None
    round: int  # 1-based
    wall_s: float
    records: tuple[RequestRecord, ...]
    errors: dict[str, int]  # error code -> count
    samples: tuple[EngineSample, ...]
    stats_before: dict[str, Any]
    stats_after: dict[str, Any]


async def run_point(client: BenchClient, prompts: list[str], config: BenchConfig, mode: str,
                    concurrency: int, progress: Progress, round_index: int = 1) -> PointRun:
    """Send `config.requests_at(concurrency)` requests (closed loop or Poisson) and time
    them; the engine is sampled every STATS_INTERVAL_S meanwhile."""
    num_requests = config.requests_at(concurrency)
    records: list[RequestRecord] = []
    errors: dict[str, int] = {}
    samples: list[EngineSample] = []
    stats_before = await client.stats()
    started = time.perf_counter()
    give_up_at = started + (config.max_duration_s or float("inf"))

    async def one(index: int) -> None:
        try:
            records.append(await client.timed_request(prompts[index % len(prompts)],
                                                      config.sampling))
        except SpecdError as exc:
            errors[exc.code] = errors.get(exc.code, 0) + 1
        progress.advance()

    # The sampler is stopped by an event, not cancelled: it ends after its current query
    # (a failure of it still propagates).
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_engine(client, samples, stop))
    try:
        if config.request_rate is None:
            await _closed_loop(one, num_requests, concurrency, give_up_at)
        else:
            await _poisson(one, num_requests, concurrency, config.request_rate,
                           random.Random(config.seed), give_up_at)
        wall = time.perf_counter() - started
    finally:
        stop.set()
        await sampler
    stats_after = await client.stats()
    return PointRun(mode, concurrency, config.request_rate, round_index, wall, tuple(records),
                    errors, tuple(samples), stats_before, stats_after)


Send = Callable[[int], Awaitable[None]]  # sends prompt `index` and records the outcome


async def _closed_loop(one: Send, num_requests: int, concurrency: int, give_up_at: float
                       ) -> None:
    indices = iter(range(num_requests))

    async def worker() -> None:
        for index in indices:  # shared iterator: each index is taken by one worker
            if time.perf_counter() > give_up_at:
                return
            await one(index)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _poisson(one: Send, num_requests: int, concurrency: int, rate: float,
                   rng: random.Random, give_up_at: float) -> None:
    in_flight = asyncio.Semaphore(concurrency)
    tasks = []

    async def bounded(index: int) -> None:
        async with in_flight:
            await one(index)

    for index in range(num_requests):
        if time.perf_counter() > give_up_at:
            break
        tasks.append(asyncio.create_task(bounded(index)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


async def _sample_engine(client: BenchClient, samples: list[EngineSample],
                         stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(engine_sample(await client.stats()))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STATS_INTERVAL_S):
                await stop.wait()


@dataclass(frozen=True)
class SweepRun:
    """Every point of every mode that could run; `skipped` says why a mode did not."""

    daemon: dict[str, Any]  # model, resolved settings, engine config (from status)
    points: tuple[PointRun, ...]
    skipped: dict[str, str]
    paired: tuple[PairedRun, ...] = ()
    batch1_pairs: Batch1Pairs | None = None


RoundHook = Callable[[dict[str, Any], int, int], Awaitable[None]]
BaselineFactory = Callable[[dict[str, Any]], BaselinePrompt]


async def run_sweep(socket_path: Path | None, config: BenchConfig,
                    after_round: RoundHook | None = None,
                    baseline_prompt: BaselineFactory | None = None) -> SweepRun:
    """The whole sweep against the daemon at `socket_path`; the daemon's speculation mode
    is restored afterwards. A mode the daemon cannot serve (no draft model) is skipped with
    its reason rather than measured as something else. `after_round(daemon, concurrency,
    round)` runs after each round of each concurrency, while the daemon is idle (a
    baseline interleaves its rounds with batch 1's there).
    `baseline_prompt(daemon)` gives the function that runs the baseline on one prompt,
    for `config.batch1_pairs` (run after batch 1's rounds, when `on` is among the modes)."""
    async with BenchClient(socket_path, timeout=config.timeout_s) as client:
        status = await client.status()
        if status.state != "ready":
            raise SpecdError(f"the daemon is {status.state}, not ready")
        speculative = bool(status.resolved.get("speculative", False))
        initial_mode = str(status.engine.get("spec_mode", "off"))
        daemon = {"model": status.model, "version": status.version,
                  "resolved": status.resolved, "engine_config": status.config.get("engine", {}),
                  "initial_spec_mode": initial_mode}
        # Prompt i is the same text for every use of it (the baseline's pairs included).
        prompts = load_prompts(max(config.batch1_pairs,
                                   *(config.requests_at(c) for c in config.concurrencies)))
        runnable = [mode for mode in config.modes if speculative or mode == "off"]
        skipped = {mode: "the daemon serves without speculation (resolved.speculative is "
                         "false: no draft model, or speculation not built in)"
                   for mode in config.modes if mode not in runnable}
        # None where they do not run: one mode has nothing to pair with; pairs need `on`
        # at batch 1 and a baseline
        paired = config.paired if len(runnable) > 1 else None
        pair_with = (baseline_prompt if config.batch1_pairs > 0 and "on" in runnable
                     and 1 in config.concurrencies else None)
        num_points = (len(config.concurrencies) * (len(runnable) * config.rounds
                                                   + (paired is not None))
                      + (pair_with is not None))
        # With --max-duration a point ends on time, so its request count is not known.
        progress = Progress(num_points, None if config.max_duration_s is not None else
                            sum(config.requests_at(c) for c in config.concurrencies)
                            * len(runnable) * config.rounds)
        points = []
        paired_runs: list[PairedRun] = []
        pairs: Batch1Pairs | None = None
        try:
            # modes interleaved at each concurrency: the figures compared with each other
            # are taken minutes apart at most, not a whole sweep apart
            for concurrency in config.concurrencies:
                for round_index in range(1, config.rounds + 1):
                    for mode in round_order(runnable, round_index):
                        if speculative:
                            await client.set_spec(mode)
                        await client.timed_request(prompts[0],
                                                   SamplingParams(max_tokens=4))  # warm
                        label = f"{mode} c={concurrency}"
                        if config.rounds > 1:
                            label += f" round {round_index}/{config.rounds}"
                        progress.begin(label)
                        points.append(await run_point(client, prompts, config, mode,
                                                      concurrency, progress, round_index))
                    if after_round is not None:
                        await after_round(daemon, concurrency, round_index)
                if paired is not None:
                    progress.begin(f"paired windows c={concurrency}")
                    paired_runs.append(await run_paired(client, prompts, config.sampling,
                                                        runnable, concurrency, paired,
                                                        progress))
                if concurrency == 1 and pair_with is not None:
                    progress.begin(f"batch 1 vs baseline, {config.batch1_pairs} pairs")
                    pairs = await run_batch1_pairs(client, prompts, config.sampling,
                                                   config.batch1_pairs, pair_with(daemon),
                                                   progress)
        finally:
            progress.close()
            if speculative:
                await client.set_spec(initial_mode)
    return SweepRun(daemon, tuple(points), skipped, tuple(paired_runs), pairs)
