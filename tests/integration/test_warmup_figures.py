"""Warm-up's steps are not the workload: a fresh engine's figures start at zero."""

from __future__ import annotations

from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore


def test_figures_after_warm_up_count_only_the_requests_served() -> None:
    core = EngineCore(EngineConfig(dtype="float32", spec_mode="on"))
    core.warmup()
    fresh = core.stats()
    assert (fresh.num_steps, fresh.num_generated_tokens, fresh.num_drafted,
            fresh.num_accepted, fresh.num_verify_passes) == (0, 0, 0, 0, 0)
    assert sum(fresh.accepted_at_depth) == 0

    core.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=12, ignore_eos=True))
    last = None
    while core.has_unfinished():
        for delta in core.step():
            last = delta
    assert last is not None and last.num_output_tokens == 12
    served = core.stats()
    # The request's own figures are the engine's: nothing left over from warm-up.
    assert served.num_drafted == last.num_drafted > 0
    assert served.num_accepted == last.num_accepted
    assert served.num_generated_tokens == 12
