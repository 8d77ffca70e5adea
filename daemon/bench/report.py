"""The serving benchmark's results: per-point summaries, the medians over rounds, a
terminal table, the JSON report, the Markdown table and the PNG plots (matplotlib,
imported only when plots are written).

Every latency is in milliseconds and summarized as mean/p50/p90/p99 (linear interpolation
between order statistics). With several rounds per point, the medians and the plots read
each mode's median over the rounds (`medians`).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from specd.daemon.bench.paired import counter_spec_share
from specd.daemon.bench.sweep import EngineSample, PointRun
from specd.ipc.messages import SPEC_MODES

PLOT_FILES = {"throughput": "throughput.png", "tpot": "tpot.png",
              "acceptance": "acceptance_hist.png"}


def percentiles(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 of `values` (all 0.0 for an empty list)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        rank = q * (len(ordered) - 1)
        low, high = math.floor(rank), math.ceil(rank)
        return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def _ms(values: list[float]) -> dict[str, float]:
    return {key: value * 1e3 for key, value in percentiles(values).items()}


def _engine_delta(point: PointRun, key: str) -> int | None:
    before = point.stats_before.get("engine", {}).get(key)
    after = point.stats_after.get("engine", {}).get(key)
    if before is None or after is None:
        return None
    return int(after) - int(before)


def spec_share(point: PointRun) -> tuple[float, str]:
    """The share of output tokens that speculative steps produced, and where the figure
    comes from: "counter" from the engine's counters (each verify pass emits its accepted
    drafts + 1 token: (accepted + verify passes) / generated tokens), else "sampled" (the
    share of stats samples, taken while requests ran, in which speculation was active).
    A request's first token comes from its prefill step, so `on` stays a little below 1."""
    share = counter_spec_share(point.stats_before, point.stats_after)
    if share is not None:
        return share, "counter"
    busy = [s for s in point.samples if s.num_running > 0]
    if not busy:
        return 0.0, "sampled"
    return sum(s.spec_active for s in busy) / len(busy), "sampled"


def acceptance_length(point: PointRun) -> float:
    """Tokens per verify pass over the point, (accepted + passes) / passes, from the
    engine's counters; else the mean of the requests' own figures; 1.0 without
    speculation (one token per target step)."""
    passes = _engine_delta(point, "num_verify_passes")
    accepted = _engine_delta(point, "num_accepted")
    if passes and accepted is not None:
        return (accepted + passes) / passes
    drafted = [r.acceptance_length for r in point.records if r.num_drafted]
    return sum(drafted) / len(drafted) if drafted else 1.0


def _busy_batch(samples: tuple[EngineSample, ...]) -> float:
    busy = [s.num_running for s in samples if s.num_running > 0]
    return sum(busy) / len(busy) if busy else 0.0


def summarize(point: PointRun) -> dict[str, Any]:
    """One JSON-ready row per point."""
    records = point.records
    num_output = sum(r.num_output_tokens for r in records)
    drafted = [r for r in records if r.num_drafted]
    share, share_source = spec_share(point)
    return {
        "mode": point.mode,
        "concurrency": point.concurrency,
        "request_rate": point.request_rate,
        "round": point.round,
        "num_requests": len(records),
        "num_errors": sum(point.errors.values()),
        "errors": dict(point.errors),
        "wall_s": point.wall_s,
        "output_tokens_per_s": num_output / point.wall_s,
        "requests_per_s": len(records) / point.wall_s,
        "num_output_tokens": num_output,
        "num_received_tokens": sum(r.num_received for r in records),
        "num_prompt_tokens": sum(r.num_prompt_tokens for r in records),
        "ttft_ms": _ms([r.ttft_s for r in records]),
        "tpot_ms": _ms([r.tpot_s for r in records]),
        "itl_ms": _ms([gap for r in records for gap in r.itl_s]),
        "e2e_ms": _ms([r.latency_s for r in records]),
        "acceptance_length": acceptance_length(point),
        "acceptance_lengths": [r.acceptance_length for r in drafted],
        "num_drafted": sum(r.num_drafted for r in records),
        "num_accepted": sum(r.num_accepted for r in records),
        "spec_share": share,
        "spec_share_source": share_source,
        "mean_batch": _busy_batch(point.samples),
        "max_kv_use": max((s.kv_use for s in point.samples), default=0.0),
    }


def by_point(points: list[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """(mode, concurrency) -> its rounds, in round order."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for p in sorted(points, key=lambda p: p.get("round", 1)):
        groups.setdefault((p["mode"], p["concurrency"]), []).append(p)
    return groups


def medians(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, concurrency): the median over its rounds of output tokens/s, of
    TPOT p50 and of the speculation share, and each round's throughput (in round order)."""
    rows = []
    for (mode, concurrency), group in by_point(points).items():
        rows.append({
            "mode": mode, "concurrency": concurrency, "rounds": len(group),
            "output_tokens_per_s": statistics.median(p["output_tokens_per_s"] for p in group),
            "tpot_p50_ms": statistics.median(p["tpot_ms"]["p50"] for p in group),
            "spec_share": statistics.median(p["spec_share"] for p in group),
            "output_tokens_per_s_by_round": [p["output_tokens_per_s"] for p in group],
        })
    return sorted(rows, key=lambda r: (SPEC_MODES.index(r["mode"]), r["concurrency"]))


def _points_in_order(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The points mode by mode (off, on, auto), each by concurrency."""
    return sorted(report["points"], key=lambda p: (SPEC_MODES.index(p["mode"]), p["concurrency"],
                                                   p.get("round", 1)))


def _several_rounds(report: dict[str, Any]) -> bool:
    return any(p.get("round", 1) > 1 for p in report["points"])


def _paired_lines(report: dict[str, Any]) -> list[str]:
    """One line per concurrency of the paired windows (each mode's pooled tokens/s and,
    for auto, the share of its tokens that speculative steps made), then the batch-1
    pairs."""
    lines = []
    for row in report.get("paired") or []:
        figures = []
        for mode in SPEC_MODES:
            if mode in row["modes"]:
                fig = row["modes"][mode]
                shares = [x for x in fig["spec_share_by_cycle"] if x is not None]
                share = (f" (spec {sum(shares) / len(shares):.2f})"
                         if mode == "auto" and shares else "")
                figures.append(f"{mode} {fig['tokens_per_s']:.1f}{share}")
        errors = f"; errors {row['errors']}" if row["errors"] else ""
        lines.append(f"c={row['concurrency']}: " + ", ".join(figures)
                     + f" tok/s over {len(row['windows'])} windows{errors}")
    pairs = report.get("batch1_pairs")
    if pairs is not None:
        name = (report.get("baseline") or {}).get("library", "baseline")
        lines.append(f"batch 1, {pairs['num_pairs']} prompts alternately: specd spec on "
                     f"{pairs['specd_tokens_per_s']:.1f} tok/s, {name} "
                     f"{pairs['baseline_tokens_per_s']:.1f} tok/s ({pairs['ratio']:.2f}x)")
    return lines


def format_table(report: dict[str, Any]) -> str:
    """The terminal table: one row per point (and round), the medians over rounds when
    there are several, the paired figures, then the baseline."""
    rounds = _several_rounds(report)
    head = (f"{'mode':<5} {'conc':>4} " + (f"{'rnd':>3} " if rounds else "")
            + f"{'reqs':>4} {'tok/s':>8} {'req/s':>6} "
            f"{'ttft p50':>8} {'ttft p99':>8} {'tpot p50':>8} {'itl p50':>8} {'itl p90':>8} "
            f"{'itl p99':>8} {'acc len':>7} {'spec':>5} {'batch':>5}")
    lines = [head, "-" * len(head)]
    for p in _points_in_order(report):
        lines.append(
            f"{p['mode']:<5} {p['concurrency']:>4} "
            + (f"{p.get('round', 1):>3} " if rounds else "")
            + f"{p['num_requests']:>4} "
            f"{p['output_tokens_per_s']:>8.1f} {p['requests_per_s']:>6.2f} "
            f"{p['ttft_ms']['p50']:>8.1f} {p['ttft_ms']['p99']:>8.1f} "
            f"{p['tpot_ms']['p50']:>8.2f} {p['itl_ms']['p50']:>8.2f} "
            f"{p['itl_ms']['p90']:>8.2f} {p['itl_ms']['p99']:>8.2f} "
            f"{p['acceptance_length']:>7.2f} {p['spec_share']:>5.2f} {p['mean_batch']:>5.1f}"
            + (f"  errors {p['errors']}" if p["num_errors"] else ""))
    lines.append("(latencies in ms; acc len = tokens per verify pass, 1 without speculation; "
                 "spec = share of output tokens from speculative steps)")
    if rounds:
        lines.append("medians over rounds:")
        for row in medians(report["points"]):
            lines.append(f"  {row['mode']:<5} c={row['concurrency']:<3} "
                         f"{row['output_tokens_per_s']:>8.1f} tok/s  tpot p50 "
                         f"{row['tpot_p50_ms']:.2f} ms  spec {row['spec_share']:.2f}  "
                         f"({row['rounds']} rounds)")
    paired = _paired_lines(report)
    if paired:
        lines.append("paired (modes switched on one running load, pooled over cycles):")
        lines += [f"  {line}" for line in paired]
    for mode, reason in report["skipped_modes"].items():
        lines.append(f"mode {mode} skipped: {reason}")
    baseline = report.get("baseline")
    if baseline is not None:
        lines.append(f"{baseline['label']} at batch 1: {baseline['tokens_per_s']:.1f} tok/s "
                     f"({baseline['num_prompts']} prompts x {baseline['max_new_tokens']} tokens)")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def write_plots(report: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """throughput vs concurrency per mode, TPOT p50 vs concurrency per mode (medians over
    rounds), histogram of per-request acceptance lengths per mode; returns {plot name: file
    path}."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    points = report["points"]
    lines = medians(points)  # one value per mode and concurrency: the median over rounds
    modes = sorted({p["mode"] for p in points}, key=SPEC_MODES.index)
    paths = {name: out_dir / file for name, file in PLOT_FILES.items()}
    for name, key, label in (("throughput", "output_tokens_per_s", "output tokens/s"),
                             ("tpot", "tpot_p50_ms", "TPOT p50 (ms)")):
        fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
        for mode in modes:
            rows = [r for r in lines if r["mode"] == mode]
            ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows], marker="o",
                    label=f"spec {mode}")
        ax.set_xscale("log", base=2)
        concurrencies = sorted({p["concurrency"] for p in points})
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs concurrency")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(paths[name])
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    drawn = False
    for mode in modes:
        lengths = [x for p in points if p["mode"] == mode for x in p["acceptance_lengths"]]
        if lengths:
            ax.hist(lengths, bins=20, alpha=0.6, label=f"spec {mode}")
            drawn = True
    if drawn:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no request speculated", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("acceptance length (tokens per target step, per request)")
    ax.set_ylabel("requests")
    ax.set_title("acceptance length")
    fig.tight_layout()
    fig.savefig(paths["acceptance"])
    plt.close(fig)
    return {name: str(path) for name, path in paths.items()}


def format_markdown(report: dict[str, Any]) -> str:
    """The points, medians, paired figures and baseline as Markdown (for docs/benchmarks.md)."""
    rounds = _several_rounds(report)
    lines = ["| mode | concurrency | " + ("round | " if rounds else "")
             + "output tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 ms | "
             "ITL p50 / p90 / p99 ms | acceptance length | spec share |",
             "| --- | ---: | " + ("---: | " if rounds else "")
             + "---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in _points_in_order(report):
        lines.append(
            f"| {p['mode']} | {p['concurrency']} | "
            + (f"{p.get('round', 1)} | " if rounds else "")
            + f"{p['output_tokens_per_s']:.1f} | "
            f"{p['requests_per_s']:.2f} | {p['ttft_ms']['p50']:.0f} / {p['ttft_ms']['p99']:.0f} | "
            f"{p['tpot_ms']['p50']:.1f} | {p['itl_ms']['p50']:.1f} / {p['itl_ms']['p90']:.1f} / "
            f"{p['itl_ms']['p99']:.1f} | {p['acceptance_length']:.2f} | {p['spec_share']:.2f} |")
    if rounds:
        lines += ["", "Medians over rounds:", "",
                  "| mode | concurrency | output tok/s | TPOT p50 ms | spec share | by round |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        for row in medians(report["points"]):
            figures = ", ".join(f"{x:.1f}" for x in row["output_tokens_per_s_by_round"])
            lines.append(f"| {row['mode']} | {row['concurrency']} | "
                         f"{row['output_tokens_per_s']:.1f} | {row['tpot_p50_ms']:.1f} | "
                         f"{row['spec_share']:.2f} | {figures} |")
    paired = _paired_lines(report)
    if paired:
        lines += ["", "Paired (modes switched on one running load, pooled over cycles):", ""]
        lines += [f"- {line}" for line in paired]
    baseline = report.get("baseline")
    if baseline is not None:
        lines += ["", f"{baseline['label']} at batch 1: {baseline['tokens_per_s']:.1f} "
                      f"tok/s ({baseline['num_prompts']} prompts x {baseline['max_new_tokens']} "
                      "tokens, greedy)."]
    return "\n".join(lines) + "\n"
