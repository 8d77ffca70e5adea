"""`specctl bench`: the serving benchmark's command line. It reads the group's settings
(`ctx.obj`, a `ctl.common.Settings`) and is registered on `specctl`.

`run_bench` is the whole run (sweep, report, files); it also times a `Baseline`, another
implementation run at batch 1 on the same prompts, when one is given. specd ships none:
`tools/bench_serving.py` passes transformers `generate()` (tools/bench_baseline.py).

Exit codes as specctl's: 1 the daemon answered with an error, 2 usage error, 3 the daemon
cannot be reached, 4 no answer in time.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import click

from specd.daemon.ctl.common import Settings, int_list, run_client_call

if TYPE_CHECKING:
    from specd.daemon.bench.sweep import BenchConfig


class Baseline(Protocol):
    """Another implementation timed at batch 1 beside the daemon, on the same prompts.

    `run_round` times one round of its prompts (tokens/s) and appends (tokens, seconds) to
    `rounds`; `run_prompt(i)` times prompt i alone (tokens, seconds); `result` is the
    report's "baseline" entry, with at least `library`, `label`, `tokens_per_s`,
    `tokens_per_s_by_round`, `num_prompts` and `max_new_tokens`."""

    name: str
    rounds: list[tuple[int, float]]

    def run_round(self) -> float: ...

    def run_prompt(self, index: int) -> tuple[int, float]: ...

    def result(self) -> dict[str, Any]: ...


BaselineFactory = Callable[[dict[str, Any]], Baseline]  # the daemon (from status) -> baseline


def machine_info() -> dict[str, Any]:
    """Where the figures were measured."""
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"hostname": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "num_cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average_1m": os.getloadavg()[0]}  # other work competing for the CPUs


@click.command()
@click.option("--modes", default="off,on,auto", show_default=True,
              help="speculation modes to run, switched in the daemon between runs")
@click.option("--concurrency", "concurrency_text", default="1,2,4,8,16,32,64",
              show_default=True, help="concurrency sweep (comma-separated)")
@click.option("--request-rate", type=float, default=None,
              help="Poisson arrivals per second instead of a closed loop (each concurrency "
              "then caps the requests in flight)")
@click.option("--num-requests", type=int, default=None,
              help="requests per point [default: max(8, 2 x concurrency)]")
@click.option("--max-duration", type=float, default=None,
              help="seconds per point after which no new request is sent")
@click.option("--max-tokens", type=int, default=64, show_default=True,
              help="output tokens per request (ignore_eos: every request makes them all)")
@click.option("--rounds", type=int, default=1, show_default=True,
              help="measure each point this many times per mode (modes interleaved, order "
              "rotated per round); the medians and plots use each mode's median")
@click.option("--paired-cycles", type=int, default=4, show_default=True,
              help="after each concurrency's rounds, switch the modes on one running load "
              "this many times each and count each mode's windows (0: skip)")
@click.option("--paired-window", type=float, default=3.0, show_default=True,
              help="seconds counted per paired window (0.5 s more settle after each switch)")
@click.option("--out-dir", type=click.Path(path_type=Path), default=Path("bench_out/serving"),
              show_default=True, help="where bench_serving.json, bench_serving.md (the table in "
              "Markdown) and the PNG plots go")
@click.option("--plots/--no-plots", default=True, show_default=True)
@click.pass_context
def bench(ctx: click.Context, out_dir: Path, plots: bool, **sweep_options: Any) -> None:
    """Serving benchmark against the running daemon: a concurrency sweep per speculation
    mode; prints a table, writes JSON and PNG plots."""
    settings: Settings = ctx.obj
    run_bench(settings, bench_config(settings, **sweep_options), out_dir, plots)


def bench_config(settings: Settings, modes: str, concurrency_text: str,
                 request_rate: float | None, num_requests: int | None,
                 max_duration: float | None, max_tokens: int, rounds: int,
                 paired_cycles: int, paired_window: float, batch1_pairs: int = 0
                 ) -> BenchConfig:
    """The sweep's configuration from `bench`'s options (click.UsageError when invalid)."""
    from specd.daemon.bench.paired import PairedConfig
    from specd.daemon.bench.sweep import BenchConfig

    try:
        if paired_cycles < 0:
            raise ValueError(f"--paired-cycles must be >= 0, got {paired_cycles}")
        paired = (PairedConfig(cycles=paired_cycles, window_s=paired_window)
                  if paired_cycles else None)
        return BenchConfig(modes=tuple(x.strip() for x in modes.split(",") if x.strip()),
                           concurrencies=int_list(concurrency_text),
                           request_rate=request_rate, num_requests=num_requests,
                           max_duration_s=max_duration, max_tokens=max_tokens,
                           rounds=rounds, timeout_s=max(settings.timeout, 600.0),
                           paired=paired, batch1_pairs=batch1_pairs)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def run_bench(settings: Settings, config: BenchConfig, out_dir: Path, plots: bool,
              make_baseline: BaselineFactory | None = None) -> dict[str, Any]:
    """Run the sweep, print the table, write the JSON, Markdown and plots; returns the
    report. With `make_baseline`, the baseline's rounds alternate with batch 1's and its
    `config.batch1_pairs` pairs run after them."""
    from specd.daemon.bench import report as bench_report
    from specd.daemon.bench.paired import summarize_batch1_pairs, summarize_paired
    from specd.daemon.bench.sweep import run_sweep

    # A library used after the sweep is checked before it: a missing one must not cost a run.
    if plots and importlib.util.find_spec("matplotlib") is None:
        raise click.UsageError("matplotlib is not installed; install specd[tools] or pass "
                               "--no-plots")
    machine_before = machine_info()
    runner: Baseline | None = None  # built at its first round

    def baseline_runner(daemon: dict[str, Any]) -> Baseline:
        nonlocal runner
        if runner is None:
            assert make_baseline is not None  # only called with a baseline
            runner = make_baseline(daemon)
        return runner

    async def baseline_round(daemon: dict[str, Any], concurrency: int, round_index: int
                             ) -> None:
        # Batch 1's rounds and the baseline's alternate: the batch-1 ratio compares figures
        # taken a minute apart, not a whole sweep apart.
        if concurrency == 1:
            baseline = baseline_runner(daemon)
            tok_s = await asyncio.to_thread(baseline.run_round)
            click.echo(f"bench: {baseline.name} round {round_index}/{config.rounds}: "
                       f"{tok_s:.1f} tok/s", err=True)

    with_baseline = make_baseline is not None
    sweep = run_client_call(lambda: asyncio.run(run_sweep(
        settings.socket_path, config, baseline_round if with_baseline else None,
        (lambda daemon: baseline_runner(daemon).run_prompt) if with_baseline else None)))
    points = [bench_report.summarize(p) for p in sweep.points]
    baseline_result = None
    if with_baseline:
        # Without batch 1 in the sweep, the baseline's rounds run now, back to back.
        done = baseline_runner(sweep.daemon)
        while len(done.rounds) < config.rounds:
            done.run_round()
        baseline_result = done.result()
    report: dict[str, Any] = {
        "benchmark": "serving", "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": " ".join(sys.argv), "machine": machine_before,
        "load_average_1m_after": os.getloadavg()[0], "daemon": sweep.daemon,
        "config": {"modes": list(config.modes), "concurrencies": list(config.concurrencies),
                   "request_rate": config.request_rate, "max_tokens": config.max_tokens,
                   "num_requests": config.num_requests, "max_duration_s": config.max_duration_s,
                   "rounds": config.rounds,
                   "paired_cycles": config.paired.cycles if config.paired else 0,
                   "paired_window_s": config.paired.window_s if config.paired else None,
                   "batch1_pairs": config.batch1_pairs},
        "points": points, "medians": bench_report.medians(points),
        "paired": [summarize_paired(run) for run in sweep.paired],
        "batch1_pairs": (summarize_batch1_pairs(sweep.batch1_pairs)
                         if sweep.batch1_pairs is not None else None),
        "skipped_modes": sweep.skipped, "baseline": baseline_result, "plots": {},
    }
    # The figures are written before the plots, so that a failure while plotting loses
    # no measurement; the JSON is written again with the plots' paths.
    bench_report.write_json(report, out_dir / "bench_serving.json")
    if plots and points:
        report["plots"] = bench_report.write_plots(report, out_dir)
        bench_report.write_json(report, out_dir / "bench_serving.json")
    (out_dir / "bench_serving.md").write_text(bench_report.format_markdown(report))
    click.echo(bench_report.format_table(report))
    click.echo(f"wrote {out_dir / 'bench_serving.json'}"
               + (f" and {len(report['plots'])} plots" if report["plots"] else ""))
    return report
