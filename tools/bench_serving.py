"""Serving benchmark: `specctl bench` plus what the product does not ship.

The benchmark itself is `specctl bench` (the package specd.daemon.bench), so it runs from
an installed package too; every option of `specctl bench --help` works here. This script
adds:

* without `--socket`, a daemon started on a private socket for the run (`--model`, and
  `--daemon-args` passed to `specd`), stopped afterwards;
* the transformers `generate()` baseline at batch 1 (tools/bench_baseline.py), its rounds
  alternating with batch 1's, and `--batch1-pairs` prompts run alternately through both;
* the serving targets judged on the report (tools/bench_targets.py): written into
  bench_serving.json ("targets") and bench_serving.md, and printed.

    python -m tools.bench_serving --out-dir bench_out/serving
    python -m tools.bench_serving --socket /run/specd/specd.sock --modes off,on --concurrency 1,8
"""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path
from typing import Any

import click

from specd.daemon.bench import report as bench_report
from specd.daemon.bench.command import (
    Baseline,
    BaselineFactory,
    bench,
    bench_config,
    run_bench,
)
from specd.daemon.ctl.common import Settings
from tools.bench_daemon import DaemonProcess
from tools.bench_targets import format_targets, judge


def transformers_baseline(model: Path | None, num_prompts: int, round_prompts: int,
                          max_tokens: int) -> BaselineFactory:
    """Builds the baseline from the daemon's status: its model (unless `model`) and dtype,
    so that both sides run the same weights and arithmetic."""

    def make(daemon: dict[str, Any]) -> Baseline:
        from specd.daemon.bench.sweep import load_prompts
        from specd.workers.config import FIXTURE_DIR
        from specd.workers.named_models import named_model
        from tools.bench_baseline import Baseline as TransformersBaseline  # torch, transformers

        served = str(daemon["engine_config"].get("model") or FIXTURE_DIR)
        named = named_model(served)  # a name such as "fixture" is served from its directory
        model_dir = model or (named.model_dir if named is not None else Path(served))
        click.echo(f"bench: transformers baseline on {model_dir}", err=True)
        dtype = str(daemon.get("resolved", {}).get("dtype", "float32"))
        return TransformersBaseline(model_dir, load_prompts(num_prompts), max_tokens,
                                    dtype=dtype, round_prompts=round_prompts)

    return make


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), default=None,
              help="use this running daemon [default: start a private one]")
@click.option("--model", default=None, help="model for a private daemon")
@click.option("--daemon-args", default="", help="more `specd` flags, one string")
@click.option("--timeout", type=float, default=60.0, show_default=True)
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="also time transformers generate() at batch 1 on the same prompts")
@click.option("--baseline-prompts", type=int, default=8, show_default=True)
@click.option("--baseline-model", type=click.Path(path_type=Path), default=None,
              help="model directory for the baseline [default: the daemon's model]")
@click.option("--batch1-pairs", type=int, default=16, show_default=True,
              help="prompts run alternately through specd (spec on, batch 1) and the "
              "baseline (0: skip); the batch-1 target reads these pairs")
def main(socket_path: Path | None, model: str | None, daemon_args: str, timeout: float,
         baseline: bool, baseline_prompts: int, baseline_model: Path | None,
         batch1_pairs: int, out_dir: Path, plots: bool, **sweep_options: Any) -> None:
    """specctl bench with the transformers baseline and the serving targets."""
    settings = Settings(socket_path, timeout, False)
    config = bench_config(settings, batch1_pairs=batch1_pairs if baseline else 0,
                          **sweep_options)
    make_baseline = None
    if baseline:
        # Checked before the sweep: a missing library must not cost a run.
        if importlib.util.find_spec("transformers") is None:
            raise click.UsageError("transformers is not installed; install specd[tools] or "
                                   "pass --no-baseline")
        make_baseline = transformers_baseline(baseline_model,
                                              max(baseline_prompts, batch1_pairs),
                                              baseline_prompts, config.max_tokens)
    daemon = None
    if socket_path is None:
        daemon = DaemonProcess(model, shlex.split(daemon_args))
        click.echo(f"bench: starting specd on {daemon.socket_path}", err=True)
        daemon.wait_ready()
        settings = Settings(daemon.socket_path, timeout, False)
    try:
        report = run_bench(settings, config, out_dir, plots, make_baseline)
    finally:
        if daemon is not None:
            daemon.stop()
    report["targets"] = judge(report)
    bench_report.write_json(report, out_dir / "bench_serving.json")
    with (out_dir / "bench_serving.md").open("a") as markdown:
        markdown.write("\n".join(["", *format_targets(report, report["targets"], True)]) + "\n")
    if report["baseline"] is not None:
        click.echo("assisted generation with the EAGLE-3 head: "
                   + report["baseline"]["assisted_generation"]["verdict"])
    click.echo("\n".join(format_targets(report, report["targets"])))


# Every option of `specctl bench` (modes, concurrency, rounds, paired windows, out-dir, ...).
main.params.extend(bench.params)

if __name__ == "__main__":
    main()
