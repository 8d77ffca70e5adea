"""The serving benchmark for a few seconds against the real daemon (fixture model unless
$SPECD_TEST_MODEL), through `tools/bench_serving.py` (`specctl bench` plus the transformers
baseline and the serving targets) and `specctl bench` itself: every field of its JSON
present, the figures positive and consistent with each other (tokens counted by the daemon
= tokens received by the client = requests x max_tokens), the paired windows and batch-1
pairs the targets read, the transformers baseline in the same report, and the PNG plots
valid images that read back.

Only what the code decides is asserted: counts, orders and the report's arithmetic. What
a wall-clock window of a real daemon happens to hold (how many tokens, which steps) is not:
tests/unit/test_bench_paired.py checks the windows' accounting and the modes they measure
against a stand-in client whose counts decide them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from specd.daemon.ctl.cli import cli as specctl
from tests.integration.daemon_harness import Daemon
from tools import bench_serving

MAX_TOKENS = 12
NUM_REQUESTS = 3
CONCURRENCIES = (1, 2)
PAIRED_CYCLES = 2
PAIRED_WINDOW_S = 0.5
BATCH1_PAIRS = 2

# Minutes on two cores (a real daemon, the sweep, the transformers baseline): the second tier.
pytestmark = pytest.mark.slow
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPORT_KEYS = {"benchmark", "date", "command", "machine", "load_average_1m_after", "daemon",
               "config", "points", "medians", "paired", "batch1_pairs", "skipped_modes",
               "baseline", "targets", "plots"}
POINT_KEYS = {"mode", "concurrency", "request_rate", "round", "num_requests", "num_errors",
              "errors", "wall_s", "output_tokens_per_s", "requests_per_s", "num_output_tokens",
              "num_received_tokens", "num_prompt_tokens", "ttft_ms", "tpot_ms", "itl_ms",
              "e2e_ms", "acceptance_length", "acceptance_lengths", "num_drafted",
              "num_accepted", "spec_share", "spec_share_source", "mean_batch", "max_kv_use"}
BASELINE_KEYS = {"library", "model", "batch_size", "num_prompts", "max_new_tokens",
                 "num_output_tokens", "wall_s", "tokens_per_s", "torch_threads", "dtype",
                 "assisted_generation", "tokens_per_s_by_round", "label"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("bench"), "--log-level", "warning").wait_ready()
    yield d
    d.stop()


def _bench(daemon: Daemon, out_dir: Path, *options: str, tool: bool = True
           ) -> tuple[dict[str, Any], str]:
    """A run of tools/bench_serving.py (`tool`: with the baseline and targets), else of
    `specctl bench`."""
    command = ([] if tool else ["bench"]) + [
        "--max-tokens", str(MAX_TOKENS), "--num-requests", str(NUM_REQUESTS),
        "--out-dir", str(out_dir), *options]
    result = CliRunner().invoke(bench_serving.main if tool else specctl,
                                ["--socket", str(daemon.socket_path), *command])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return json.loads((out_dir / "bench_serving.json").read_text()), result.output


@pytest.fixture(scope="module")
def sweep(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[dict[str, Any], str]:
    return _bench(daemon, tmp_path_factory.mktemp("sweep"), "--modes", "off,on,auto",
                  "--concurrency", ",".join(map(str, CONCURRENCIES)), "--baseline-prompts", "1",
                  "--paired-cycles", str(PAIRED_CYCLES), "--paired-window",
                  str(PAIRED_WINDOW_S), "--batch1-pairs", str(BATCH1_PAIRS))


def _check_latencies(point: dict[str, Any]) -> None:
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        figures = point[key]
        assert set(figures) == {"mean", "p50", "p90", "p99"}, key
        assert 0 < figures["p50"] <= figures["p90"] <= figures["p99"], (key, figures)
    assert point["ttft_ms"]["p50"] <= point["e2e_ms"]["p50"]
    # every request's TPOT spans its last MAX_TOKENS - 1 tokens, which came after its TTFT
    assert point["tpot_ms"]["mean"] * (MAX_TOKENS - 1) <= point["e2e_ms"]["p99"] * 1.001


def test_every_point_is_complete_and_consistent(sweep: tuple[dict[str, Any], str]) -> None:
    report, _ = sweep
    assert set(report) == REPORT_KEYS
    assert report["config"]["max_tokens"] == MAX_TOKENS
    points = report["points"]
    for point in points:
        assert set(point) == POINT_KEYS
        assert point["num_errors"] == 0, point["errors"]
        assert point["num_requests"] == NUM_REQUESTS
        # tokens counted (the daemon's Final frames) = tokens received (streamed ids)
        assert point["num_output_tokens"] == point["num_received_tokens"] \
            == NUM_REQUESTS * MAX_TOKENS
        assert point["wall_s"] > 0 and point["num_prompt_tokens"] > 0
        assert point["output_tokens_per_s"] * point["wall_s"] == pytest.approx(
            point["num_output_tokens"])
        assert point["requests_per_s"] * point["wall_s"] == pytest.approx(NUM_REQUESTS)
        _check_latencies(point)
        assert point["acceptance_length"] >= 1.0
        assert 0.0 <= point["spec_share"] <= 1.0
        assert 0.0 <= point["max_kv_use"] <= 1.0
        assert 0 <= point["num_accepted"] <= point["num_drafted"]
        if point["mode"] == "off":
            assert point["num_drafted"] == 0 and point["spec_share"] == 0.0
        elif point["mode"] == "on":
            # every request runs to its end, and each decodes past its first token
            assert point["num_drafted"] > 0 and point["spec_share"] > 0.0
    measured = {p["mode"] for p in points}
    # every requested mode is measured at every concurrency, or skipped with its reason
    assert measured | set(report["skipped_modes"]) == {"off", "on", "auto"}
    assert not measured & set(report["skipped_modes"])
    for mode in measured:
        assert sorted(p["concurrency"] for p in points if p["mode"] == mode) \
            == list(CONCURRENCIES)
    if report["daemon"]["resolved"]["speculative"]:
        assert measured == {"off", "on", "auto"}


def test_baseline_and_targets(sweep: tuple[dict[str, Any], str]) -> None:
    report, table = sweep
    baseline = report["baseline"]
    assert set(baseline) == BASELINE_KEYS
    assert baseline["num_output_tokens"] == MAX_TOKENS and baseline["tokens_per_s"] > 0
    assert baseline["assisted_generation"]["possible"] is False
    targets = report["targets"]
    versus = targets["batch1_vs_transformers"]
    if "on" in {p["mode"] for p in report["points"]}:
        # the target reads the pairs; the rounds' ratio is kept beside it
        pairs = report["batch1_pairs"]
        assert versus["source"] == "pairs" and versus["ratio"] == pytest.approx(pairs["ratio"])
        assert versus["ratio"] == pytest.approx(
            versus["specd_tokens_per_s"] / versus["baseline_tokens_per_s"])
        on_1 = next(p for p in report["points"] if p["mode"] == "on" and p["concurrency"] == 1)
        assert versus["ratio_rounds"] == pytest.approx(
            on_1["output_tokens_per_s"] / baseline["tokens_per_s"])
        assert len(targets["auto_vs_best"]) == len(CONCURRENCIES)
        assert {row["source"] for row in targets["auto_vs_best"]} == {"paired windows"}
    else:
        assert versus["ratio"] is None and targets["auto_met"] is None
        assert report["paired"] == [] and report["batch1_pairs"] is None
    assert "transformers generate() at batch 1" in table
    for point in report["points"]:
        assert f"{point['output_tokens_per_s']:>8.1f}" in table


def test_paired_windows_switch_the_modes_on_one_load(
        daemon: Daemon, sweep: tuple[dict[str, Any], str]) -> None:
    report, table = sweep
    if not report["daemon"]["resolved"]["speculative"]:
        pytest.skip("the daemon serves without speculation: nothing to pair")
    rows = report["paired"]
    assert [row["concurrency"] for row in rows] == list(CONCURRENCIES)
    for row in rows:
        assert row["errors"] == {} and row["num_requests"] >= 0
        # every mode has one window per cycle, the modes rotated from cycle to cycle
        ran = [(w["cycle"], w["mode"]) for w in row["windows"]]
        assert ran == [(1, "off"), (1, "on"), (1, "auto"), (2, "on"), (2, "auto"), (2, "off")]
        for mode, figures in row["modes"].items():
            windows = [w for w in row["windows"] if w["mode"] == mode]
            assert figures["tokens"] == sum(w["tokens"] for w in windows) >= 0
            assert figures["seconds"] == pytest.approx(sum(w["seconds"] for w in windows))
            # asyncio may wake a timer up to its clock resolution early
            assert all(w["seconds"] >= PAIRED_WINDOW_S - 1e-6 for w in windows)
            assert figures["tokens_per_s"] == pytest.approx(figures["tokens"]
                                                            / figures["seconds"])
        # off never speculates, whatever a window held; a share is a share
        assert all(w["spec_share"] in (0.0, None) for w in row["windows"] if w["mode"] == "off")
        assert all(w["spec_share"] is None or 0.0 <= w["spec_share"] <= 1.0
                   for w in row["windows"])
        on, off, auto = (row["modes"][m]["tokens_per_s"] for m in ("on", "off", "auto"))
        assert row["auto_over_best"] == (pytest.approx(auto / max(on, off))
                                         if max(on, off) > 0 else None)
        cycles = zip(*(row["modes"][m]["tokens_per_s_by_cycle"] for m in ("auto", "on", "off")),
                     strict=True)
        assert row["auto_over_best_by_cycle"] == pytest.approx(
            [a / max(n, f) for a, n, f in cycles if max(n, f) > 0])
        assert len(row["auto_over_best_by_cycle"]) <= PAIRED_CYCLES
    pairs = report["batch1_pairs"]
    assert pairs["num_pairs"] == BATCH1_PAIRS and len(pairs["ratio_by_pair"]) == BATCH1_PAIRS
    assert pairs["specd_tokens_per_s"] > 0 and pairs["baseline_tokens_per_s"] > 0
    assert "paired (modes switched on one running load" in table
    assert f"batch 1, {BATCH1_PAIRS} prompts alternately" in table
    # the mode the daemon had is back after the paired windows switched it
    with daemon.client() as client:
        assert client.status().engine["spec_mode"] == report["daemon"]["initial_spec_mode"]


def test_plots_are_png_images_that_read_back(sweep: tuple[dict[str, Any], str]) -> None:
    import matplotlib.image

    report, _ = sweep
    assert set(report["plots"]) == {"throughput", "tpot", "acceptance"}
    for path in map(Path, report["plots"].values()):
        assert path.read_bytes()[:8] == PNG_SIGNATURE, path
        pixels = matplotlib.image.imread(path)
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100, path
        assert pixels.std() > 0, f"{path} is blank"


def test_poisson_arrivals(daemon: Daemon, tmp_path: Path) -> None:
    report, _ = _bench(daemon, tmp_path, "--modes", "off", "--concurrency", "2",
                       "--request-rate", "50", "--no-plots", "--paired-cycles", "0",
                       tool=False)
    (point,) = report["points"]
    assert point["request_rate"] == 50 and point["concurrency"] == 2
    assert point["num_output_tokens"] == point["num_received_tokens"] \
        == NUM_REQUESTS * MAX_TOKENS
    assert report["baseline"] is None and report["plots"] == {}
    assert set(report) == REPORT_KEYS - {"targets"}  # specd's own report judges nothing


def test_rounds_interleave_the_modes_and_targets_read_the_medians(
        daemon: Daemon, tmp_path: Path) -> None:
    report, table = _bench(daemon, tmp_path, "--modes", "off,on", "--concurrency", "1",
                           "--rounds", "3", "--baseline-prompts", "1", "--no-plots",
                           "--paired-cycles", "0", "--batch1-pairs", "0")
    modes = ["off", "on"] if report["daemon"]["resolved"]["speculative"] else ["off"]
    # points in the order they ran: each round rotates the modes by one
    ran = [(p["round"], p["mode"]) for p in report["points"]]
    if modes == ["off", "on"]:
        assert ran == [(1, "off"), (1, "on"), (2, "on"), (2, "off"), (3, "off"), (3, "on")]
    else:
        assert ran == [(1, "off"), (2, "off"), (3, "off")]
    assert report["config"]["rounds"] == 3
    for row in report["medians"]:
        figures = [p["output_tokens_per_s"] for p in report["points"]
                   if p["mode"] == row["mode"]]
        assert row["rounds"] == 3 and row["output_tokens_per_s_by_round"] == figures
        assert row["output_tokens_per_s"] == pytest.approx(sorted(figures)[1])
    assert [row["mode"] for row in report["medians"]] == modes
    assert "medians over rounds:" in table
    # the baseline ran three rounds (each after a batch-1 round); its figure is their median
    baseline = report["baseline"]
    assert len(baseline["tokens_per_s_by_round"]) == 3
    assert baseline["tokens_per_s"] == pytest.approx(sorted(baseline["tokens_per_s_by_round"])[1])
    assert table.count("bench: transformers round") == 3  # each round says what it measured
    versus = report["targets"]["batch1_vs_transformers"]
    if "on" in modes:
        on_rounds = [p["output_tokens_per_s"] for p in report["points"] if p["mode"] == "on"]
        assert versus["by_round"] == pytest.approx(
            [a / b for a, b in zip(on_rounds, baseline["tokens_per_s_by_round"], strict=True)])


def test_tune_spec_measures_or_says_why_not(daemon: Daemon, tmp_path: Path) -> None:
    env = tmp_path / "specd.env"
    env.write_text("SPECD_MODEL=/srv/m\nSPECD_ARGS=--device cpu\n")
    with daemon.client() as client:
        speculative = client.status().resolved["speculative"]
    result = CliRunner().invoke(specctl, [
        "--socket", str(daemon.socket_path), "tune-spec", "--batch-sizes", "1,2",
        "--max-tokens", "8", "--json", "--write-env", str(env)])
    if not speculative:
        assert result.exit_code == 1
        assert "without speculation" in result.output
        assert env.read_text() == "SPECD_MODEL=/srv/m\nSPECD_ARGS=--device cpu\n"
        return
    assert result.exit_code == 0, result.output + repr(result.exception)
    tuning = json.loads(result.stdout)
    assert [row["batch_size"] for row in tuning["rows"]] == [1, 2]
    for row in tuning["rows"]:
        assert row["off"]["step_ms"] > 0 and row["on"]["step_ms"] > 0 and row["speedup"] > 0
        assert row["off"]["drafted"] == 0 and row["on"]["drafted"] > 0
        assert row["on"]["tokens_per_step"] > 0
    args = env.read_text().splitlines()[1]
    assert args.startswith("SPECD_ARGS=--device cpu --spec-mode ")
    words = args.split("=", 1)[1].split()
    for flag, value in tuning["recommended_flags"].items():
        assert flag in words
        if value:  # "" is a switch, written bare
            assert words[words.index(flag) + 1] == value


def test_a_missing_plotting_library_is_reported_before_the_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    # No daemon on this socket: the check must come first, or the error would be another.
    result = CliRunner().invoke(specctl, ["--socket", str(tmp_path / "none.sock"), "bench",
                                          "--out-dir", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "matplotlib is not installed" in result.output and "--no-plots" in result.output
    assert not (tmp_path / "out").exists()
