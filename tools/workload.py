"""The benchmark workload: held-out prompts shipped with the fixture model."""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS_FILE = (Path(__file__).resolve().parent.parent / "workers" / "fixture"
                / "heldout_prompts.jsonl")


def load_prompts(n: int, path: Path = PROMPTS_FILE) -> list[str]:
    """The first `n` held-out prompts, cycling if fewer are available."""
    rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line]
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [rows[i % len(rows)] for i in range(n)]
