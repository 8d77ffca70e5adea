"""tune-spec's arithmetic and its environment-file edit, and the benchmark's percentiles
and targets: pure functions checked on hand-made figures; tune-spec's closed loop against a
stand-in client."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from specd.daemon.bench.report import medians, percentiles
from specd.daemon.bench.sweep import BenchConfig, round_order
from specd.daemon.ctl.tune_spec import (
    LENGTH_SPREAD,
    _run_batch,
    best_chain_depth,
    chain_acceptance_rate,
    crossover,
    recommend,
    update_env_args,
    update_env_file,
)
from tools.bench_targets import check_targets


class CountingClient:
    """Stands in for the daemon: answers each request after a short sleep, counts steps
    and tokens as an engine would (one token per request per step), and records each
    prompt's (here: each client's) request lengths in order."""

    def __init__(self) -> None:
        self.lengths: dict[str, list[int]] = {}
        self.steps = self.tokens = 0

    async def timed_request(self, prompt: str, sampling: Any) -> None:
        self.lengths.setdefault(prompt, []).append(sampling.max_tokens)
        await asyncio.sleep(0.001 * sampling.max_tokens)
        self.steps += sampling.max_tokens
        self.tokens += sampling.max_tokens

    async def stats(self) -> dict[str, Any]:
        return {"engine": {"num_steps": self.steps, "num_generated_tokens": self.tokens}}


def test_tune_spec_sends_a_steady_load_the_same_in_both_modes() -> None:
    # Requests end and join a few at a time: lengths spread over +-50% of max_tokens,
    # first requests cut anywhere in [2, 1.5 * max_tokens]; a seeded draw per client, so
    # the off and on runs send each client the same lengths.
    prompts = ["p0", "p1", "p2", "p3"]  # four clients: client i sends prompt i
    runs = []
    for _ in range(2):
        client = CountingClient()
        figures = asyncio.run(_run_batch(client, prompts, 4, 20))
        runs.append(client.lengths)
        assert figures["tokens"] > 0 and figures["wall_s"] > 0
    low, high = round(20 * (1 - LENGTH_SPREAD)), round(20 * (1 + LENGTH_SPREAD))
    for lengths in runs[0].values():
        assert 2 <= lengths[0] <= high and all(low <= n <= high for n in lengths[1:])
    every = [n for lengths in runs[0].values() for n in lengths]
    assert len(set(every)) > 3  # not one length: the clients do not move in waves
    for prompt in prompts:
        done = min(len(runs[0][prompt]), len(runs[1][prompt]))
        assert done >= 1 and runs[0][prompt][:done] == runs[1][prompt][:done]


ENV = """# comment kept
SPECD_MODEL=/srv/specd/models/target
SPECD_ARGS=--device cuda --spec-num-steps 3 --spec-topk=2 --log-format json
"""


def _rows(speedups: dict[int, float]) -> list[dict[str, object]]:
    return [{"batch_size": b, "speedup": s} for b, s in speedups.items()]


def test_crossover_interpolates_where_speedup_falls_below_one() -> None:
    # 1.5 at 4, 0.5 at 8: the line crosses 1 halfway, at 6
    assert crossover(_rows({1: 2.0, 4: 1.5, 8: 0.5})) == 6
    assert crossover(_rows({1: 2.0, 2: 1.2})) == 2  # pays everywhere measured
    assert crossover(_rows({1: 0.9, 2: 0.5})) is None  # never pays


def test_chain_acceptance_rate_inverts_the_expected_length() -> None:
    rate = 0.6
    tau = sum(rate**i for i in range(5))  # 4 drafts
    assert chain_acceptance_rate(tau, 4) == pytest.approx(rate, abs=1e-6)
    assert chain_acceptance_rate(1.0, 4) == pytest.approx(0.0, abs=1e-6)


def test_best_chain_depth_trades_acceptance_against_draft_cost() -> None:
    assert best_chain_depth(0.9, plain_ms=10.0, draft_ms=0.1) == 8  # cheap drafts: deep
    assert best_chain_depth(0.1, plain_ms=10.0, draft_ms=5.0) == 1  # poor acceptance: short


def test_recommendation_turns_speculation_off_when_it_never_pays() -> None:
    off = {"step_ms": 10.0, "tokens_per_s": 100.0}
    on = {"step_ms": 30.0, "tokens_per_step": 1.5, "tokens_per_s": 50.0}
    rows = [{"batch_size": 1, "off": off, "on": on, "speedup": 0.5}]
    tuning = recommend(rows, {"device": "cpu", "spec_num_steps": 5})
    assert tuning["recommended_flags"] == {"--spec-mode": "off"}


def test_recommendation_on_cpu_is_a_chain_with_the_threshold() -> None:
    off = {"step_ms": 10.0, "tokens_per_s": 100.0}
    on = {"step_ms": 15.0, "tokens_per_step": 3.0, "tokens_per_s": 200.0}
    rows = [{"batch_size": 1, "off": off, "on": on, "speedup": 2.0},
            {"batch_size": 4, "off": off, "on": on, "speedup": 1.0}]
    flags = recommend(rows, {"device": "cpu", "spec_num_steps": 5})["recommended_flags"]
    assert flags["--spec-mode"] == "auto" and flags["--spec-disable-batch-threshold"] == "4"
    # The measured threshold decides, not auto's online measurement.
    assert flags["--no-spec-auto-measure"] == ""
    assert flags["--spec-topk"] == "1"
    assert flags["--spec-num-draft-tokens"] == flags["--spec-num-steps"]


def test_env_args_replace_both_flag_spellings_and_keep_other_lines() -> None:
    text = update_env_args(ENV, {"--spec-num-steps": "6", "--spec-topk": "1"})
    lines = text.splitlines()
    assert lines[:2] == ENV.splitlines()[:2]
    assert lines[2] == ("SPECD_ARGS=--device cuda --log-format json --spec-num-steps 6 "
                        "--spec-topk 1")


def test_env_args_write_a_switch_bare_and_drop_either_spelling() -> None:
    text = ("SPECD_ARGS=--spec-auto-measure --spec-topk 2 --no-spec-auto-measure "
            "--device cpu\n")
    line = update_env_args(text, {"--no-spec-auto-measure": "", "--spec-topk": "1"})
    assert line == "SPECD_ARGS=--device cpu --no-spec-auto-measure --spec-topk 1\n"


def test_env_args_line_added_when_missing(tmp_path: Path) -> None:
    path = tmp_path / "specd.env"
    path.write_text("SPECD_MODEL=/m\n")
    path.chmod(0o640)
    line = update_env_file(path, {"--spec-mode": "off"})
    assert line == "SPECD_ARGS=--spec-mode off"
    assert path.read_text() == "SPECD_MODEL=/m\nSPECD_ARGS=--spec-mode off\n"
    assert path.stat().st_mode & 0o777 == 0o640


def test_percentiles_interpolate_between_order_statistics() -> None:
    figures = percentiles([float(x) for x in range(1, 102)])  # 1..101
    assert figures == {"mean": 51.0, "p50": 51.0, "p90": 91.0, "p99": 100.0}
    assert percentiles([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}


def test_targets_compare_auto_with_the_better_mode() -> None:
    points = [{"mode": mode, "concurrency": c, "output_tokens_per_s": tps}
              for mode, c, tps in (("off", 1, 100.0), ("on", 1, 200.0), ("auto", 1, 198.0),
                                   ("off", 8, 400.0), ("on", 8, 300.0), ("auto", 8, 380.0))]
    targets = check_targets(points, {"tokens_per_s": 50.0})
    rows = {r["concurrency"]: r for r in targets["auto_vs_best"]}
    assert rows[1]["auto_over_best"] == pytest.approx(0.99) and rows[1]["met"]
    assert rows[8]["auto_over_best"] == pytest.approx(0.95) and not rows[8]["met"]
    assert targets["auto_met"] is False
    versus = targets["batch1_vs_transformers"]
    assert versus["ratio"] == pytest.approx(4.0) and versus["met"] is True


def test_each_round_rotates_the_modes_so_each_runs_once_in_each_position() -> None:
    modes = ["off", "on", "auto"]
    orders = [round_order(modes, r) for r in (1, 2, 3, 4)]
    assert orders == [["off", "on", "auto"], ["on", "auto", "off"], ["auto", "off", "on"],
                      ["off", "on", "auto"]]
    for position in range(3):
        assert {order[position] for order in orders[:3]} == set(modes)
    assert round_order(["off"], 2) == ["off"]


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        BenchConfig(rounds=0)


def _point(mode: str, c: int, r: int, tps: float) -> dict[str, object]:
    return {"mode": mode, "concurrency": c, "round": r, "output_tokens_per_s": tps,
            "tpot_ms": {"p50": 1000.0 / tps}, "spec_share": 1.0 if mode == "on" else 0.0}


def test_with_rounds_the_targets_read_each_modes_median() -> None:
    # round 2 is a slow patch of the machine for auto only: the medians ignore it, the
    # per-round ratios show it
    figures = {"off": (100.0, 104.0, 98.0), "on": (200.0, 190.0, 210.0),
               "auto": (199.0, 120.0, 205.0)}
    points = [_point(mode, 1, r + 1, tps[r]) for mode, tps in figures.items() for r in range(3)]
    (row,) = check_targets(points, None)["auto_vs_best"]
    assert row["auto_over_best"] == pytest.approx(199.0 / 200.0) and row["met"]
    assert row["by_round"] == pytest.approx([199 / 200, 120 / 190, 205 / 210])
    rows = {r["mode"]: r for r in medians(points)}
    assert [r["mode"] for r in medians(points)] == ["off", "on", "auto"]
    assert rows["on"]["output_tokens_per_s"] == 200.0 and rows["on"]["rounds"] == 3
    assert rows["on"]["output_tokens_per_s_by_round"] == [200.0, 190.0, 210.0]
    assert rows["off"]["tpot_p50_ms"] == pytest.approx(1000.0 / 100.0)
