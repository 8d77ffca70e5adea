"""tools/profile_step.py attributes a step to its phases: every decoder layer of the fixture
once per forward, each draft level of a chain once per speculative step, the torch ops of a
layer counted inside it, and the self times of the phases within the step's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specd.workers.config import FIXTURE_DIR, EngineConfig
from specd.workers.models.config import ModelConfig


@pytest.mark.slow  # two engines, four profiled cases: about 25 s on two cores
def test_the_profile_counts_each_layer_and_draft_level_of_a_step(tmp_path: Path) -> None:
    from tools import profile_step
    out = tmp_path / "profile.json"
    profile_step.main(["--steps", "2", "--batch-sizes", "1", "--out", str(out)])
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"plain bs1", "speculative bs1"}
    num_layers = ModelConfig.from_dir(FIXTURE_DIR).num_layers
    draft_levels = EngineConfig().spec_num_steps - 1  # the first level is the target's output
    plain, spec = cases["plain bs1"]["phases"], cases["speculative bs1"]["phases"]
    assert plain["layer"]["calls"] == num_layers and "draft level" not in plain
    # A verify is one forward of the target: its layers once, not once per draft token.
    assert spec["layer"]["calls"] == num_layers
    assert spec["draft level"]["calls"] == draft_levels
    for case in cases.values():
        phases = case["phases"]
        assert case["ops_per_layer"] > 0 and case["ops_per_step"] >= phases["layer"]["ops"]
        assert phases["step"]["calls"] == 1
        inside = sum(row["self_ms"] for label, row in phases.items()
                     if label not in ("step", "outside"))
        assert inside <= phases["step"]["ms"] * 1.001  # every phase runs within the step
