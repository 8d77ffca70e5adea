"""Prompt log-probabilities and min_tokens in the engine (float32, the embedded fixture).

Oracle: transformers' forward over the same prompt in float32: log_softmax of its logits
at row p is the distribution of prompt token p + 1. specd's prompt log-probabilities
(chunked prefill over several steps, a prompt whose blocks sit in the prefix cache, with
speculation on and off) equal it to 1e-4, and their top-n are its top-n. min_tokens: the
greedy output equals transformers' argmax loop with the stop tokens masked while fewer than
min_tokens are generated, with speculation on and off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.config import FIXTURE_DIR, EngineConfig
from specd.workers.engine.core import EngineCore
from tests.integration.heldout import heldout_prompt_ids

transformers = pytest.importorskip("transformers")

PROMPTS = heldout_prompt_ids(3, 30, 11)  # 30, 41, 52 tokens: over several blocks
TOP = 3


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(FIXTURE_DIR, dtype=torch.float32)
    return hf.eval()


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> dict[str, dict[str, Any]]:
    for request_id, (ids, params) in requests.items():
        core.add_request(request_id, ids, params)
    out: dict[str, dict[str, Any]] = {r: {"tokens": [], "prompt": []} for r in requests}
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id]["tokens"] += delta.new_token_ids
            out[delta.request_id]["prompt"] += delta.prompt_logprobs
    return out


@pytest.mark.parametrize("options", [
    {"speculative_algorithm": None},
    {"spec_mode": "on", "spec_topk": 1, "spec_num_steps": 3},
], ids=["plain", "speculative"])
def test_prompt_logprobs_equal_transformers(model: Any, options: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    # A budget of 24 tokens: each prompt is prefilled in chunks over several steps.
    core = EngineCore(EngineConfig(max_num_batched_tokens=24, dtype="float32", **options))
    params = SamplingParams(max_tokens=4, prompt_logprobs=TOP, ignore_eos=True)
    # "warm": the same prompt again after its blocks are cached: computed whole anyway.
    requests = {f"r{i}": (ids, params) for i, ids in enumerate(PROMPTS)}
    out = run(core, requests)
    out |= run(core, {"warm": (PROMPTS[0], params),
                      "other": (PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True))})
    requests["warm"] = (PROMPTS[0], params)
    for request_id, (ids, _) in requests.items():
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)  # [P, V]: row p predicts token p + 1
        got = out[request_id]["prompt"]
        assert len(got) == len(ids) - 1, request_id
        chosen = torch.tensor([lp.logprob for lp in got])
        want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(chosen, want, atol=1e-4, rtol=0)
        for p, lp in enumerate(got):
            values, order = expected[p].sort(descending=True, stable=True)
            assert lp.top_ids == order[:TOP].tolist()
            torch.testing.assert_close(torch.tensor(lp.top_logprobs), values[:TOP],
                                       atol=1e-4, rtol=0)
    assert out["other"]["prompt"] == []


def hf_min_tokens(model: Any, ids: list[int], stop: list[int], min_tokens: int,
                  new_tokens: int) -> list[int]:
    """Greedy argmax with `stop` masked while fewer than `min_tokens` are generated, ending
    at the first stop token after that."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1].clone()
            if len(out) < min_tokens:
                logits[stop] = float("-inf")
            out.append(int(logits.argmax()))
            if out[-1] in stop:
                break
    return out


@pytest.mark.parametrize("options", [
    {"speculative_algorithm": None},
    {"speculative_algorithm": None, "overlap_schedule": True},
    {"spec_mode": "on", "spec_topk": 1, "spec_num_steps": 3},
    {"spec_mode": "on", "spec_topk": 2, "spec_num_steps": 3, "spec_num_draft_tokens": 6},
], ids=["plain", "overlap", "chain", "tree"])
def test_min_tokens_masks_the_stop_tokens_until_reached(model: Any,
                                                        options: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(max_num_batched_tokens=64, dtype="float32", **options))
    ids = PROMPTS[0]
    free = run(core, {"free": (ids, SamplingParams(max_tokens=12, ignore_eos=True))})
    # Stop tokens the free output would stop at early: min_tokens must hold them off.
    stop = sorted(set(free["free"]["tokens"][1:4]))
    params = SamplingParams(max_tokens=12, min_tokens=6, ignore_eos=True,
                            stop_token_ids=tuple(stop))
    got = run(core, {"min": (ids, params)})["min"]["tokens"]
    assert got == hf_min_tokens(model, ids, stop, 6, 12)
    assert len(got) >= 6 and not set(got[:6]) & set(stop)
