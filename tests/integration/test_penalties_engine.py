"""Penalties end to end on the embedded fixture (float32, held-out prompts).

Oracle: transformers' `generate()` with the same `repetition_penalty`, greedy, one prompt at
a time (its `RepetitionPenaltyLogitsProcessor` over prompt and generated tokens). Then the
same batch of mixed penalties (repetition, frequency, presence, logit_bias, and a request
without any) gives identical greedy tokens with speculation off, chain and tree, and with
overlap scheduling on, whose steps the penalized requests turn into whole steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import specd
from specd.ipc.sampling import SamplingParams
from specd.workers.config import FIXTURE_DIR, EngineConfig
from specd.workers.engine.core import EngineCore
from tests.integration.heldout import heldout_prompt_ids

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
PROMPTS = heldout_prompt_ids(4, 9, 13)


def hf_generate(prompts: list[list[int]], repetition_penalty: float) -> list[list[int]]:
    """transformers' greedy `generate` with the penalty, EOS not special (as ignore_eos)."""
    torch.set_num_threads(1)  # the fixture is tiny: more threads only contend
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURE_DIR, dtype=torch.float32)
    model.eval()
    config = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS, min_new_tokens=0, do_sample=False,
        repetition_penalty=repetition_penalty, eos_token_id=None, pad_token_id=0)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def hf_penalized() -> list[list[int]]:
    return hf_generate(PROMPTS, 1.3)


@pytest.mark.parametrize("spec_mode", ["off", "on"])
def test_greedy_repetition_penalty_matches_transformers_generate(
        hf_penalized: list[list[int]], spec_mode: str) -> None:
    expected = hf_penalized
    assert all(len(o) == NEW_TOKENS for o in expected)
    engine = specd.Engine(None, dtype="float32", spec_mode=spec_mode)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    got = [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert got == expected
    # The penalty is doing something on these prompts: without it the output differs.
    plain = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in plain] != expected


MIXED = [
    SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=0.7, presence_penalty=0.4),
    SamplingParams(max_tokens=24, ignore_eos=True),
    SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=0.9,
                   logit_bias={65: 2.0, 85: -1.5}),
]


def _run(arrivals: tuple[int, ...] = (0, 0, 0, 0), **options: Any
         ) -> tuple[dict[str, list[int]], EngineCore]:
    """MIXED[i] on PROMPTS[i], added at engine step arrivals[i]."""
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(max_num_batched_tokens=64, dtype="float32", **options))
    out: dict[str, list[int]] = {}
    step = 0
    while len(out) < len(MIXED) or core.has_unfinished():
        for i, params in enumerate(MIXED):
            if arrivals[i] == step:
                core.add_request(f"r{i}", PROMPTS[i], params)
                out[f"r{i}"] = []
        for delta in core.step():
            out[delta.request_id] += delta.new_token_ids
        step += 1
    return out, core


@pytest.fixture(scope="module")
def plain() -> dict[str, list[int]]:
    return _run(speculative_algorithm=None)[0]


@pytest.mark.parametrize("options", [
    {"spec_mode": "off"},
    {"spec_mode": "on", "spec_topk": 1, "spec_num_steps": 3},
    {"spec_mode": "on", "spec_topk": 3, "spec_num_steps": 4, "spec_num_draft_tokens": 8},
    {"spec_mode": "on", "spec_topk": 2, "spec_num_steps": 3, "spec_num_draft_tokens": 6,
     "overlap_schedule": True},
    {"speculative_algorithm": None, "overlap_schedule": True},
], ids=["off", "chain", "tree", "tree-overlap", "plain-overlap"])
def test_greedy_with_penalties_is_the_plain_engines(plain: dict[str, list[int]],
                                                    options: dict[str, Any]) -> None:
    out, core = _run(**options)
    assert out == plain
    if options.get("spec_mode") == "on":
        assert core.stats().num_accepted > 0


@pytest.mark.parametrize("options", [
    {"spec_mode": "on", "spec_topk": 1, "spec_num_steps": 3},
    {"spec_mode": "on", "spec_topk": 2, "spec_num_steps": 3, "spec_num_draft_tokens": 6},
], ids=["chain", "tree"])
def test_penalized_requests_joining_overlapped_speculation_keep_the_output(
        plain: dict[str, list[int]], options: dict[str, Any]) -> None:
    # The unpenalized request runs overlapped (lagged verifies) until penalized ones join;
    # their steps are whole (lagged drafts dropped), then overlap resumes once they finish.
    out, core = _run(arrivals=(4, 6, 0, 9), overlap_schedule=True, **options)
    assert out == plain
    assert core.spec is not None and core.spec.verifier.num_lagged_verifies > 0


def test_penalties_change_the_greedy_output(plain: dict[str, list[int]]) -> None:
    torch.set_num_threads(1)
    unpenalized = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = specd.Engine(None, dtype="float32", spec_mode="off")
    outs = [o.token_ids for o in engine.generate(PROMPTS, unpenalized)]
    assert [outs[i] == plain[f"r{i}"] for i in range(4)] == [False, False, True, False]


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    core = EngineCore(EngineConfig(dtype="float32", speculative_algorithm=None))
    vocab = core.model_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token ids must be in \\[0, {vocab}\\)"):
        core.add_request("a", PROMPTS[0], SamplingParams(logit_bias={vocab: 1.0}))
    core.add_request("b", PROMPTS[0], SamplingParams(logit_bias={vocab - 1: 1.0}))
