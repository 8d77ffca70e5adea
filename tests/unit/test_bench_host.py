"""tools/bench_host.py at reduced shapes on the CPU: its random INT4 checkpoint and head load
into a real EngineCore, every (batch, mode) row and the batch-1 speed-up are written (no
timing is checked), the speed-up arithmetic, and its plan for gpu_check.sh's dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import bench_host


@pytest.mark.slow  # an engine build and warm-up: 20-40 s on two cores
def test_reduced_shapes_write_every_row_and_the_speedup(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    work = tmp_path / "work"
    assert bench_host.main(["--device", "cpu", "--shapes", "reduced", "--batch-sizes", "1,2",
                            "--steps", "2", "--draft-steps", "3", "--work", str(work),
                            "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    # The checkpoints are a compressed-tensors INT4 target and an EAGLE-3 head.
    config = json.loads((work / "target" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert (work / "target" / "model.safetensors.index.json").is_file()
    assert result["checkpoint"]["target_bytes"] > 0 and result["engine"]["build_s"] > 0
    assert [(r["batch"], r["mode"]) for r in result["rows"]] == [
        (1, "plain"), (1, "spec"), (2, "plain"), (2, "spec")]
    for row in result["rows"]:
        assert row["steps"] == 2 and row["step_us"] >= row["host_us_per_step"] >= 0
        assert 0 <= row["host_share"] <= 1 and row["tokens_per_step"] >= row["batch"]
    speed = result["speedup_bs1"]
    assert set(speed["speedup"]) == {"2", "3", "4"}  # acceptance lengths up to steps + 1


def test_speedup_arithmetic() -> None:
    s = bench_host.speedup(plain_us=1000.0, spec_us=2500.0, draft_steps=5)
    assert s["speedup"] == {"2": 0.8, "3": 1.2, "4": 1.6, "5": 2.0, "6": 2.4}
    assert s["break_even_acceptance"] == 2.5


def test_plan_counts_the_compiles_the_engine_and_the_checkpoint(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_host.main(["--plan", "--device", "cuda", "--shapes", "llama-3.1-8b"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["figures"] == list(bench_host.FIGURES)
    assert plan["engine_builds"] == 1 and plan["compiles"] > 10
    # Llama-3.1-8B in INT4 at group 32 with bf16 embeddings and lm_head: about 6 GB.
    assert 5e9 < plan["checkpoint_bytes"] < 7e9
