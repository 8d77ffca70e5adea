"""`specctl bench`: the serving benchmark's command line. It reads the group's settings
(`ctx.obj`, a `ctl.common.Settings`) and is registered on `specctl`.

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
from pathlib import Path
from typing import Any

import click

from specd.daemon.ctl.common import Settings, int_list, run_client_call


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
              "rotated per round); the targets and plots use each mode's median")
@click.option("--paired-cycles", type=int, default=4, show_default=True,
              help="after each concurrency's rounds, switch the modes on one running load "
              "this many times each and count each mode's windows (0: skip); the auto "
              "target reads these paired figures")
@click.option("--paired-window", type=float, default=3.0, show_default=True,
              help="seconds counted per paired window (0.5 s more settle after each switch)")
@click.option("--batch1-pairs", type=int, default=16, show_default=True,
              help="prompts run alternately through specd (spec on, batch 1) and the "
              "transformers baseline (0: skip); the batch-1 target reads these pairs")
@click.option("--out-dir", type=click.Path(path_type=Path), default=Path("bench_out/serving"),
              show_default=True, help="where bench_serving.json, bench_serving.md (the table in "
              "Markdown) and the PNG plots go")
@click.option("--plots/--no-plots", default=True, show_default=True)
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="also time transformers generate() at batch 1 on the same prompts")
@click.option("--baseline-prompts", type=int, default=8, show_default=True)
@click.option("--baseline-model", type=click.Path(path_type=Path), default=None,
              help="model directory for the baseline [default: the daemon's model]")
@click.pass_context
def bench(ctx: click.Context, modes: str, concurrency_text: str, request_rate: float | None,
          num_requests: int | None, max_duration: float | None, max_tokens: int,
          rounds: int, paired_cycles: int, paired_window: float, batch1_pairs: int,
          out_dir: Path, plots: bool, baseline: bool, baseline_prompts: int,
          baseline_model: Path | None) -> None:
    """Serving benchmark against the running daemon: a concurrency sweep per speculation
    mode; prints a table, writes JSON and PNG plots."""
    from specd.daemon.bench import report as bench_report
    from specd.daemon.bench.baseline import Baseline  # torch and transformers load lazily
    from specd.daemon.bench.paired import (
        PairedConfig,
        summarize_batch1_pairs,
        summarize_paired,
    )
    from specd.daemon.bench.sweep import BenchConfig, load_prompts, run_sweep

    settings: Settings = ctx.obj
    try:
        if paired_cycles < 0:
            raise ValueError(f"--paired-cycles must be >= 0, got {paired_cycles}")
        paired = (PairedConfig(cycles=paired_cycles, window_s=paired_window)
                  if paired_cycles else None)
        config = BenchConfig(modes=tuple(x.strip() for x in modes.split(",") if x.strip()),
                             concurrencies=int_list(concurrency_text),
                             request_rate=request_rate, num_requests=num_requests,
                             max_duration_s=max_duration, max_tokens=max_tokens,
                             rounds=rounds, timeout_s=max(settings.timeout, 600.0),
                             paired=paired, batch1_pairs=batch1_pairs if baseline else 0)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    # Libraries used after the sweep are checked before it: a missing one must not cost a run.
    for wanted, module, flag in ((plots, "matplotlib", "--no-plots"),
                                 (baseline, "transformers", "--no-baseline")):
        if wanted and importlib.util.find_spec(module) is None:
            raise click.UsageError(f"{module} is not installed; install specd[tools] or pass "
                                   f"{flag}")
    machine_before = machine_info()
    runner: Baseline | None = None  # built at its first round

    def baseline_runner(daemon: dict[str, Any]) -> Baseline:
        nonlocal runner
        if runner is None:
            from specd.workers.config import FIXTURE_DIR

            model = baseline_model or Path(daemon["engine_config"].get("model") or FIXTURE_DIR)
            click.echo(f"bench: transformers baseline on {model}", err=True)
            # The daemon's dtype, so that both sides run the same arithmetic.
            dtype = str(daemon.get("resolved", {}).get("dtype", "float32"))
            runner = Baseline(model, load_prompts(max(baseline_prompts, batch1_pairs)),
                              max_tokens, dtype=dtype, round_prompts=baseline_prompts)
        return runner

    async def baseline_round(daemon: dict[str, Any], concurrency: int, round_index: int
                             ) -> None:
        # Batch 1's rounds and the baseline's alternate: the batch-1 ratio compares figures
        # taken a minute apart, not a whole sweep apart.
        if concurrency == 1:
            tok_s = await asyncio.to_thread(baseline_runner(daemon).run_round)
            click.echo(f"bench: transformers round {round_index}/{rounds}: {tok_s:.1f} tok/s",
                       err=True)

    sweep = run_client_call(lambda: asyncio.run(run_sweep(
        settings.socket_path, config, baseline_round if baseline else None,
        (lambda daemon: baseline_runner(daemon).run_prompt) if baseline else None)))
    points = [bench_report.summarize(p) for p in sweep.points]
    paired_rows = [summarize_paired(run) for run in sweep.paired]
    pairs_row = (summarize_batch1_pairs(sweep.batch1_pairs)
                 if sweep.batch1_pairs is not None else None)
    baseline_result = None
    if baseline:
        # Without batch 1 in the sweep, the baseline's rounds run now, back to back.
        done = baseline_runner(sweep.daemon)
        while len(done.rounds) < rounds:
            done.run_round()
        baseline_result = done.result()
    report: dict[str, Any] = {
        "benchmark": "serving", "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": " ".join(sys.argv), "machine": machine_before,
        "load_average_1m_after": os.getloadavg()[0], "daemon": sweep.daemon,
        "config": {"modes": list(config.modes), "concurrencies": list(config.concurrencies),
                   "request_rate": config.request_rate, "max_tokens": config.max_tokens,
                   "num_requests": config.num_requests, "max_duration_s": config.max_duration_s,
                   "rounds": config.rounds, "paired_cycles": paired_cycles,
                   "paired_window_s": paired_window, "batch1_pairs": config.batch1_pairs},
        "points": points, "medians": bench_report.medians(points),
        "paired": paired_rows, "batch1_pairs": pairs_row,
        "skipped_modes": sweep.skipped, "baseline": baseline_result,
        "targets": bench_report.check_targets(points, baseline_result, paired_rows,
                                              pairs_row),
        "plots": {},
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
