"""The step-driven scenario the overlap and graph tests share: seven held-out prompts
arriving over the first steps, one aborted mid-generation, run through `EngineCore.step`
and collected per request (greedy, float32 unless told otherwise)."""

from __future__ import annotations

from typing import Any

import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from tests.integration.heldout import heldout_prompt_ids

# (step at which it arrives, prompt index, max_tokens); request r3 is aborted once it has
# received ABORT_AFTER tokens.
ARRIVALS = [(0, 0, 24), (0, 1, 8), (1, 2, 30), (3, 3, 40), (5, 4, 12), (9, 5, 20),
            (9, 6, 16)]
ABORTED, ABORT_AFTER = "r3", 9


PROMPTS = heldout_prompt_ids(7, 5, 11)


def run(overlap: bool, **options: Any) -> tuple[dict[str, list[int]], EngineCore]:
    torch.set_num_threads(1)
    explore_every = options.pop("_explore_every", None)
    after_build = options.pop("_after_build", None)  # called with the core before step 0
    # float32, so that a batch of another shape cannot round a near-tie differently.
    options.setdefault("dtype", "float32")
    # A fixed KV budget: tests hold several engines at once, and on CUDA the default
    # budget is a fraction of the whole device's free memory (kv_cache.kv_budget).
    options.setdefault("kv_cache_memory_bytes", 256 * 2**20)
    core = EngineCore(EngineConfig(max_num_batched_tokens=64, overlap_schedule=overlap,
                                   **options))
    if explore_every is not None and core.spec is not None:
        controller = core.spec.controller
        controller.explore_every, controller.explore_steps, controller.min_samples = (
            explore_every, 2, 2)
        controller.settle_steps = 0
    if after_build is not None:
        after_build(core)
    out: dict[str, list[int]] = {}
    pending = list(ARRIVALS)
    step = 0
    while pending or core.has_unfinished():
        while pending and pending[0][0] <= step:
            _, i, max_tokens = pending.pop(0)
            core.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=True))
            out[f"r{i}"] = []
        for delta in core.step():
            out[delta.request_id] += delta.new_token_ids
        if ABORTED in out and len(out[ABORTED]) >= ABORT_AFTER and core.abort_request(ABORTED):
            pass
        step += 1
    return out, core


MODES: dict[str, dict[str, Any]] = {
    "no-head": {"speculative_algorithm": None},
    "spec-off": {"spec_mode": "off"},
    "chain": {"spec_mode": "on", "spec_topk": 1, "spec_num_steps": 4},
    "tree": {"spec_mode": "on", "spec_topk": 3, "spec_num_steps": 3,
             "spec_num_draft_tokens": 8},
    "auto-threshold": {"spec_mode": "auto", "spec_disable_batch_threshold": 2,
                       "spec_auto_measure": False},
}


def assert_same(got: dict[str, list[int]], expected: dict[str, list[int]]) -> None:
    assert got.keys() == expected.keys()
    for request_id, tokens in expected.items():
        if request_id == ABORTED:
            # Aborted once ABORT_AFTER tokens had arrived: a prefix, cut at the same point.
            assert got[request_id][:ABORT_AFTER] == tokens[:ABORT_AFTER]
        else:
            assert got[request_id] == tokens, request_id
