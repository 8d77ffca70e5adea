"""tools/bench_shapes.py at reduced shapes on the CPU prints its table and writes its JSON
(no timing is checked), and its speedup model's arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import bench_shapes


def test_reduced_shapes_print_the_table_and_write_json(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    out = tmp_path / "shapes.json"
    assert bench_shapes.main(["--device", "cpu", "--shapes", "reduced", "--batch-sizes", "1,2",
                              "--tokens", "1,3", "--draft-steps", "2", "--reps", "1",
                              "--warmup", "1", "--threads", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "break-even tau" in printed and "verify3 ms" in printed
    assert "acceptance length 2: speculation" in printed
    result = json.loads(out.read_text())
    assert result["shapes"] == "reduced" and result["model"]["layers"] == 2
    # tokens 1 and draft-steps + 1 are always measured
    assert {(r["batch"], r["tokens"]) for r in result["target_ms"]} == {
        (b, t) for b in (1, 2) for t in (1, 3)}
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["t_plain_ms"] > 0 and row["t_verify_ms"] > 0 and row["t_draft_ms"] > 0
        assert set(row["speedup"]) == {"2", "3"}  # tau <= draft steps + 1
    assert set(result["thresholds"]) == {"2", "3", "4", "5", "6"}


def test_speedup_model() -> None:
    # plain 10 ms; 2-step chain: draft 2 + 1 ms, verify 12 ms -> 15 ms per pass
    fig = bench_shapes.speedups(10.0, 12.0, 2.0, 1.0, 2)
    assert fig["t_spec_ms"] == pytest.approx(15.0)
    assert fig["speedup"] == {"2": pytest.approx(20 / 15), "3": pytest.approx(30 / 15)}
    assert fig["break_even_acceptance"] == pytest.approx(1.5)
    rows = [{"batch": 1, "speedup": {"2": 1.4, "3": 2.0}},
            {"batch": 8, "speedup": {"2": 0.9, "3": 1.2}},
            {"batch": 32, "speedup": {"2": 0.5, "3": 0.8}}]
    assert bench_shapes.thresholds(rows) == {"2": 1, "3": 8, "4": None, "5": None, "6": None}


def test_rejects_more_than_64_tokens() -> None:
    with pytest.raises(SystemExit):
        bench_shapes.parse_args(["--device", "cpu", "--tokens", "1,65"])
