"""The serving benchmark's targets, judged on a report of `specctl bench`
(`tools/bench_serving.py` adds them to the report it writes): `auto` at least AUTO_TARGET
times the better of `on` and `off` at every concurrency; specd at batch 1 (spec on) at
least BASELINE_TARGET times transformers `generate()` (tools/bench_baseline.py).

These are goals set for specd, not a property of the product: specd's own report gives the
figures (points, medians over rounds, paired windows, batch-1 pairs) and judges nothing.
"""

from __future__ import annotations

import statistics
from typing import Any

from specd.daemon.bench.report import by_point

AUTO_TARGET = 0.97
BASELINE_TARGET = 3.0


def check_targets(points: list[dict[str, Any]], baseline: dict[str, Any] | None,
                  paired: list[dict[str, Any]] | None = None,
                  batch1_pairs: dict[str, Any] | None = None) -> dict[str, Any]:
    """auto vs the better of on/off at each concurrency, and batch-1 spec-on vs the
    transformers baseline.

    Each target reads its paired measurement where one ran (bench.paired: auto from the
    modes' windows on one running load, `source` "paired windows", spread `by_cycle`; batch
    1 from prompts run alternately through both, "pairs", spread `by_pair`), since those
    compare figures taken seconds apart; else the medians over rounds ("rounds' medians").
    The rounds' figures are kept either way (`*_rounds`, `by_round`: auto over the better
    of on and off in the same round; spec on at batch 1 over the baseline round that ran
    right after it). A target that cannot be judged (a mode missing, a paired run with
    failed requests and no rounds) is left out (auto) or None (batch 1)."""
    by_key = {key: statistics.median(p["output_tokens_per_s"] for p in group)
              for key, group in by_point(points).items()}
    by_round = {(p["mode"], p["concurrency"], p.get("round", 1)): p["output_tokens_per_s"]
                for p in points}
    windows = {row["concurrency"]: row for row in paired or []
               if row.get("auto_over_best") is not None and not row["errors"]}
    auto_rows = []
    for concurrency in sorted({p["concurrency"] for p in points} | set(windows)):
        auto = by_key.get(("auto", concurrency))
        others = [by_key[(mode, concurrency)] for mode in ("on", "off")
                  if (mode, concurrency) in by_key]
        from_rounds = auto / max(others) if auto is not None and len(others) == 2 else None
        round_ratios = []
        for r in sorted({k[2] for k in by_round if k[:2] == ("auto", concurrency)}):
            same = [by_round.get((mode, concurrency, r)) for mode in ("on", "off")]
            if all(x is not None for x in same):
                round_ratios.append(by_round[("auto", concurrency, r)]
                                    / max(x for x in same if x is not None))
        row: dict[str, Any] = {"concurrency": concurrency, "auto_over_best_rounds": from_rounds,
                               "by_round": round_ratios}
        if concurrency in windows:
            row |= {"auto_over_best": windows[concurrency]["auto_over_best"],
                    "source": "paired windows",
                    "by_cycle": windows[concurrency]["auto_over_best_by_cycle"]}
        elif from_rounds is not None:
            row |= {"auto_over_best": from_rounds, "source": "rounds' medians"}
        else:
            continue
        row["met"] = row["auto_over_best"] >= AUTO_TARGET
        auto_rows.append(row)
    specd_b1 = by_key.get(("on", 1))
    versus: dict[str, Any] = {"specd_mode": "on", "specd_tokens_per_s": specd_b1,
                              "baseline_tokens_per_s": None, "ratio": None, "met": None,
                              "ratio_rounds": None}
    if baseline is not None and specd_b1 is not None:
        # Round r of the baseline ran right after round r of batch 1 (bench.command.run_bench).
        on_rounds = [p["output_tokens_per_s"] for p in by_point(points).get(("on", 1), [])]
        base_rounds = baseline.get("tokens_per_s_by_round") or []
        ratio = specd_b1 / baseline["tokens_per_s"]
        versus |= {"baseline_tokens_per_s": baseline["tokens_per_s"], "ratio": ratio,
                   "ratio_rounds": ratio, "source": "rounds' medians",
                   "by_round": [a / b for a, b in zip(on_rounds, base_rounds, strict=False)]}
    if batch1_pairs is not None:
        versus |= {"specd_tokens_per_s": batch1_pairs["specd_tokens_per_s"],
                   "baseline_tokens_per_s": batch1_pairs["baseline_tokens_per_s"],
                   "ratio": batch1_pairs["ratio"], "source": "pairs",
                   "by_pair": batch1_pairs["ratio_by_pair"]}
    if versus["ratio"] is not None:
        versus["met"] = versus["ratio"] >= BASELINE_TARGET
    return {
        "auto_target": AUTO_TARGET,
        "auto_vs_best": auto_rows,
        "auto_met": all(r["met"] for r in auto_rows) if auto_rows else None,
        "baseline_target": BASELINE_TARGET,
        "batch1_vs_transformers": versus,
    }


def judge(report: dict[str, Any]) -> dict[str, Any]:
    """The targets of a `specctl bench` report (its points, baseline and paired figures)."""
    return check_targets(report["points"], report.get("baseline"), report.get("paired"),
                         report.get("batch1_pairs"))


def _by_round(row: dict[str, Any], rounds: bool, unit: str = "") -> str:
    """The spread of a target row: "; by cycle 0.98, 1.02, ..." (paired windows), "; by
    pair ..." (batch-1 pairs), "; rounds' medians 0.95, by round ..." (the rounds, when the
    report has several); "" when there is none to show."""
    parts = []
    for key, name in (("by_cycle", "by cycle"), ("by_pair", "by pair")):
        if row.get(key):
            parts.append(f"{name} " + ", ".join(f"{x:.2f}{unit}" for x in row[key]))
    ratios = row.get("by_round") or []
    if rounds and ratios:
        from_rounds = row.get("auto_over_best_rounds", row.get("ratio_rounds"))
        if row.get("source") != "rounds' medians" and from_rounds is not None:
            parts.append(f"rounds' medians {from_rounds:.2f}{unit}")
        parts.append("by round " + ", ".join(f"{x:.2f}{unit}" for x in ratios))
    return "".join(f"; {part}" for part in parts)


def several_rounds(report: dict[str, Any]) -> bool:
    return any(p.get("round", 1) > 1 for p in report["points"])


def format_targets(report: dict[str, Any], targets: dict[str, Any], markdown: bool = False
                   ) -> list[str]:
    """One line per target: met or not, the figure and where it comes from, its spread
    (`markdown`: as list items for docs/benchmarks.md)."""
    rounds = several_rounds(report)
    lines = []
    for row in targets["auto_vs_best"]:
        met = "met" if row["met"] else ("not met" if markdown else "NOT met")
        where = (f"concurrency {row['concurrency']}" if markdown
                 else f"c={row['concurrency']}")
        target = "" if markdown else f"target {targets['auto_target']}, "
        lines.append(f"{'- ' if markdown else ''}auto / best(on, off) at {where}: "
                     f"{row['auto_over_best']:.3f} ({met}, {target}{row['source']})"
                     + _by_round(row, rounds))
    versus = targets["batch1_vs_transformers"]
    if versus["ratio"] is not None:
        met = "met" if versus["met"] else ("not met" if markdown else "NOT met")
        lines.append(f"{'- ' if markdown else ''}specd spec on at batch 1 / transformers: "
                     f"{versus['ratio']:.2f}x ({met}{';' if markdown else ','} target "
                     f"{targets['baseline_target']}x, {versus['source']})"
                     + _by_round(versus, rounds, "x"))
    return lines
