"""tools/bench_tensor_parallel.py --messaging: both transports carry a decode step's calls
to every receiver process (fresh interpreters) and the table and JSON hold one row per
transport, size and batch. Figures are not judged (timings are not behaviour)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specd.workers.parallel.codec import decode, encode
from tools import bench_tensor_parallel as bench

FIELDS = {"transport", "tensor_parallel_size", "batch", "send_us", "decode_us", "latency_us",
          "latency_p90_us"}


def test_a_step_of_calls_round_trips_through_the_codec_as_the_ring_carries_it() -> None:
    for op, args in bench.step_calls(2, 40, 64):
        got_op, got = decode(encode(op, *args).frame, torch.device("cpu"))
        assert got_op == op
        if op == "logits":
            assert torch.equal(got[0], args[0]) and got[0].dtype == torch.bfloat16
        else:
            assert torch.equal(got[0], args[0]) and torch.equal(got[1], args[1])
            assert got[3] == args[3]


@pytest.mark.slow  # six receiver interpreters start (torch imported in each): 30-90 s
def test_messaging_runs_both_transports_and_writes_a_row_each(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "messaging.json"
    assert bench.main(["--messaging", "--sizes", "2", "3", "--batch", "1", "--steps", "10",
                       "--context", "64", "--hidden", "64", "--gap-ms", "0",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["transport"], r["tensor_parallel_size"], r["batch"]) for r in rows] == [
        ("pipe", 2, 1), ("ring", 2, 1), ("pipe", 3, 1), ("ring", 3, 1)]
    for row in rows:
        assert set(row) == FIELDS
        assert all(row[k] >= 0 for k in FIELDS - {"transport"})
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["transport", "N", "batch", "send", "us", "decode", "us",
                                "latency", "us", "p90", "us"]
    assert len(table) == 1 + len(rows)
