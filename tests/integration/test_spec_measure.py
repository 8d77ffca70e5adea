"""What the speculation controller is told a step cost: wall time while the engine has work,
the caller's time between steps included (messaging, new requests), and none of the idle
time when it has none."""

from __future__ import annotations

import time

import torch

from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.runner.sampler import SamplingParams
from specd.workers.spec.controller import bucket_of

GAP_S = 0.05


def test_time_between_busy_steps_counts_and_idle_time_does_not() -> None:
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(max_num_batched_tokens=64, dtype="float32", spec_mode="on"))
    assert core.spec is not None
    controller = core.spec.controller
    controller.settle_steps = 0
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    core.add_request("a", [5, 6, 7, 8], params)
    steps = 0
    while core.has_unfinished():
        core.step()
        steps += 1
        time.sleep(GAP_S)  # the scheduler process sending outputs, reading new requests
    on = controller.buckets[bucket_of(1)].on
    # Every step after the first paid the gap before it; the first started from idle.
    assert on.samples == steps
    assert on.seconds * steps >= GAP_S * (steps - 1) * 0.99  # a plain mean over < 32 steps

    # Idle, then a new request: the idle second is not the new step's cost.
    time.sleep(1.0)
    core.add_request("b", [5, 6, 7, 8], params)
    before = on.seconds * on.samples
    core.step()
    assert on.samples == steps + 1
    assert on.seconds * on.samples - before < 0.5
