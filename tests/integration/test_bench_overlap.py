"""tools/bench_overlap.py runs on the CPU, writes every figure, and every pipeline (overlap
and graphs off and on) produces the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow  # 5-15 s: in the second tier, to keep the README's command under 10 min
def test_bench_overlap_writes_figures_and_both_pipelines_agree(tmp_path: Path) -> None:
    from tools import bench_overlap
    out = tmp_path / "overlap.json"
    # float32: batch 3 replays a graph padded to 4, and bfloat16 could round a near-tie
    # differently there.
    bench_overlap.main(["--device", "cpu", "--dtype", "float32", "--batch-sizes", "1,3",
                        "--max-tokens", "6", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 4  # modes x batch sizes x (overlap, graphs) off/on
    for row in rows:
        assert row["same_tokens"] is True
        assert (row["graph_replays"] > 0) == row["graphs"]
        assert row["steps"] > 0 and row["tokens"] > 0 and row["step_ms"] > 0
        assert 0.0 <= row["host_busy_share"] <= 1.0
    plain = [r for r in rows if r["mode"] == "plain"]
    # Every request gets 6 tokens; the first of each comes before timing starts.
    assert {(r["batch"], r["tokens"]) for r in plain} == {(1, 5), (3, 15)}
