"""Loading memory under tensor parallelism: a rank of 2 reads only its slices, so the rise
of its peak resident memory while loading stays below 60% of a size-1 load's.

Each load runs in a fresh process (so the peak is that load's): the process imports torch
and specd, records its resident memory, resets the kernel's high-water mark
(/proc/self/clear_refs, "5"), loads, and reports the peak (VmHWM) minus the resident memory
before. What python and torch hold before loading (the same in every process) is left out:
it is not loading memory. The dense fixture in float32 (its bfloat16 checkpoint doubles in
memory) and the MoE fixture with expert parallelism. Measured on the 2-vCPU VM: dense
147.5 MB at size 1, 82.2 MB per rank at size 2 (0.557); MoE 97.9 MB, 52.7-53.1 MB per
expert-parallel rank (0.54); what does not shrink is the loader's and torch's own working
memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

LOAD_SCRIPT = """
import json, sys, torch
from specd.workers.models.layers import dense_linear
from specd.workers.models.loader import load_model
from specd.workers.models.config import ModelConfig
from specd.workers.parallel.context import ParallelContext

def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)

model_dir, rank, world, expert_parallel = sys.argv[1], *map(int, sys.argv[2:5])
cfg = ModelConfig.from_dir(model_dir)
before = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
# One loader: size 1 (rank 0 of 1) is the one-process load.
model = load_model(cfg, torch.device("cpu"), torch.float32, dense_linear,
                   ParallelContext(rank, world, bool(expert_parallel)))
print(json.dumps({"rise_bytes": (status_kib("VmHWM") - before) * 1024}))
"""


def load_rise(model_dir: Path, rank: int, world: int, expert_parallel: bool = False) -> int:
    """The peak-memory rise of one load in a fresh process, in bytes."""
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(model_dir), str(rank),
                          str(world), str(int(expert_parallel))],
                         capture_output=True, text=True, check=True, timeout=300)
    rise: int = json.loads(out.stdout.strip().splitlines()[-1])["rise_bytes"]
    return rise


@pytest.mark.slow  # three fresh processes importing torch: ~25 s on 2 cores
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(("model", "expert_parallel"), [("fixture", False),
                                                        ("fixture-moe", True)])
def test_each_rank_of_two_peaks_below_60_percent_of_one(model: str,
                                                        expert_parallel: bool) -> None:
    from specd.workers.config import FIXTURES

    model_dir = FIXTURES[model][0]
    whole = load_rise(model_dir, 0, 1)
    ranks = [load_rise(model_dir, r, 2, expert_parallel) for r in range(2)]
    assert whole > 0
    assert all(rise < 0.6 * whole for rise in ranks), (whole, ranks)
