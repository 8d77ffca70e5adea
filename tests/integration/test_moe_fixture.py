"""The embedded MoE fixture (`--model fixture-moe`): a trained DeepSeek-V3 with its EAGLE-3
head, served exactly as transformers computes it.

Greedy output in float32 equals transformers' DeepseekV3ForCausalLM token for token on
held-out prompts with speculation off, as a chain and as a tree (the head is trained, so
drafts are accepted often and trees are compacted); sampled output keeps the target's
distribution (the chi-square rank test of test_spec_lossless, same size and threshold).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.config import FIXTURE_DIR, FIXTURE_MOE_DIR, FIXTURES, EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.models.config import ModelConfig
from tests.integration.heldout import heldout_prompt_ids
from tests.integration.test_engine_parity import hf_greedy
from tests.integration.test_spec_lossless import (
    CRITICAL_CHI2_DF2,
    NUM_SEQS,
    NUM_TOKENS,
    _rank_statistic,
)

transformers = pytest.importorskip("transformers")

MOE_DIR = FIXTURE_MOE_DIR
NEW_TOKENS = 32
PROMPTS = heldout_prompt_ids(4, 9, 17)


def test_fixture_moe_names_the_embedded_moe_model_and_its_head() -> None:
    config = EngineConfig(model="fixture-moe")
    assert config.model_path == MOE_DIR and FIXTURES["fixture-moe"][0] == MOE_DIR
    assert config.draft_model_path == MOE_DIR / "eagle3"
    assert EngineConfig().model_path == EngineConfig(model="fixture").model_path == FIXTURE_DIR
    assert EngineConfig(model="/some/dir").draft_model_path is None


def test_fixture_moe_has_the_deepseek_v3_features() -> None:
    """MLA with a q LoRA, YaRN, the first layer dense, then MoE layers of 8 routed experts
    (top-2, sigmoid, noaux_tc, a trained correction bias) and a shared expert."""
    from safetensors.torch import load_file

    cfg = ModelConfig.from_dir(MOE_DIR)
    assert cfg.mla is not None and cfg.mla.q_lora_rank is not None
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn"
    moe = cfg.moe
    assert moe is not None
    assert (moe.num_routed_experts, moe.num_experts_per_tok, moe.num_shared_experts) == (8, 2, 1)
    assert (moe.scoring_func, moe.topk_method) == ("sigmoid", "noaux_tc")
    assert not moe.is_moe_layer(0) and all(moe.is_moe_layer(i) for i in range(1, cfg.num_layers))
    tensors = load_file(MOE_DIR / "model.safetensors")
    biases = [t for name, t in tensors.items() if name.endswith("e_score_correction_bias")]
    assert len(biases) == cfg.num_layers - 1 and all(b.abs().max() > 0 for b in biases)
    head = json.loads((MOE_DIR / "eagle3" / "config.json").read_text())
    # Outputs of blocks 0..2 (LlamaForCausalLMEagle3's numbering): hidden states 1..3.
    assert head["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """transformers' greedy continuations (float32), one prompt at a time."""
    torch.set_num_threads(2)
    return hf_greedy(MOE_DIR, PROMPTS, NEW_TOKENS)


def generate(**options: Any) -> tuple[list[list[int]], EngineCore]:
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(model="fixture-moe", dtype="float32",
                                   max_num_batched_tokens=32, **options))
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        core.add_request(f"r{i}", ids, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id] += delta.new_token_ids
    return list(out.values()), core


@pytest.mark.parametrize("options", [
    {"speculative_algorithm": None},
    {"spec_mode": "on", "spec_topk": 1, "spec_num_steps": 4},
    {"spec_mode": "on", "spec_topk": 4, "spec_num_steps": 4, "spec_num_draft_tokens": 8},
], ids=["off", "chain", "tree"])
def test_fixture_moe_matches_transformers(expected: list[list[int]],
                                          options: dict[str, Any]) -> None:
    got, core = generate(**options)
    assert got == expected
    if core.spec is not None:
        assert core.stats().acceptance_length > 1.5
    cfg = core.model_config
    assert cfg.mla is not None
    assert core.resolved.kv_bytes_per_token == cfg.num_layers * cfg.mla.latent_size * 4


@pytest.mark.slow  # 40-50 s a case on two cores: CI's second tier
@pytest.mark.parametrize("options", [
    {"spec_topk": 1, "spec_num_steps": 3},
    {"spec_topk": 3, "spec_num_steps": 3, "spec_num_draft_tokens": 6},
], ids=["chain", "tree"])
def test_fixture_moe_sampled_tokens_follow_the_target_distribution(
        options: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(model="fixture-moe", dtype="float32", spec_mode="on",
                                   max_num_seqs=NUM_SEQS, max_num_batched_tokens=64, seed=1,
                                   **options))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_k=3, ignore_eos=True)
    prompts = heldout_prompt_ids(6, 7, 13)
    outputs: dict[str, tuple[list[int], list[int]]] = {}
    for i in range(NUM_SEQS):
        prompt = prompts[i % len(prompts)][: 7 + i % 11]
        core.add_request(f"s{i}", prompt, params)
        outputs[f"s{i}"] = (prompt, [])
    while core.has_unfinished():
        for d in core.step():
            outputs[d.request_id][1].extend(d.new_token_ids)
    stats = core.stats()
    assert stats.num_accepted > 0.2 * stats.num_verify_passes  # drafts were really verified
    chi2, expected_counts, observed = _rank_statistic(core, outputs, params)
    assert chi2 < CRITICAL_CHI2_DF2, (chi2, expected_counts, observed)
