"""The engine generates exactly what transformers generates (greedy), whatever the batching.

Oracle: transformers' `generate()` on the same weights in float32, one prompt at a time.
specd runs all prompts batched, with chunked prefill, prefix reuse on and off, and with
preemption forced by a tiny KV-block budget; the greedy tokens must be identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specd
from specd.workers.config import FIXTURE_DIR

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32


def hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuation by transformers' model, one prompt at a time, EOS not special
    (as with ignore_eos). A plain argmax loop: `generate(min_new_tokens=...)` would mask
    EOS and so change the argmax."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        past = None
        new: list[int] = []
        with torch.no_grad():
            for _ in range(new_tokens):
                out = model(input_ids=x, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                new.append(token)
                x = torch.tensor([[token]])
        outs.append(new)
    return outs


def make_tiny_model(tmp: Path, arch: str) -> Path:
    """A small random model of `arch`, saved as a Hugging Face directory."""
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=299, bos_token_id=298)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.MistralConfig(**common)
        model_cls = transformers.MistralForCausalLM
    torch.manual_seed(0)
    model = model_cls(cfg)
    # Random weights give near-uniform logits; sharpen them so greedy ties are implausible.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    out = tmp / arch
    model.save_pretrained(out, safe_serialization=True)
    return out


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 3, (n,), generator=gen).tolist() for n in lengths]


def specd_greedy(model_dir: Path | None, prompts: list[list[int]], **options: object
                 ) -> list[list[int]]:
    engine = specd.Engine(str(model_dir) if model_dir else None, dtype="float32",
                          spec_mode="off", **options)
    params = specd.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_tiny_models_match_transformers_greedy(tmp_path: Path, arch: str) -> None:
    model_dir = make_tiny_model(tmp_path, arch)
    # Lengths straddle the block size (16) and the chunk budget below.
    prompts = random_prompts(300, [5, 16, 17, 40])
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    assert specd_greedy(model_dir, prompts, max_num_batched_tokens=32) == expected


@pytest.fixture(scope="module")
def fixture_case() -> tuple[list[list[int]], list[list[int]]]:
    from specd.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(FIXTURE_DIR)
    shared = "import os\nimport sys\n\n\ndef main(argv):\n    "
    texts = [shared + "parser = ", shared + "if len(argv)", "class Point:\n    def __init__(",
             "def fib(n):\n"]
    prompts = [tokenizer.encode(t) for t in texts]
    return prompts, hf_greedy(FIXTURE_DIR, prompts, NEW_TOKENS)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_fixture_matches_transformers_with_and_without_prefix_reuse(
    fixture_case: tuple[list[list[int]], list[list[int]]], prefix_caching: bool
) -> None:
    prompts, expected = fixture_case
    got = specd_greedy(None, prompts, enable_prefix_caching=prefix_caching)
    assert got == expected


def test_fixture_matches_transformers_under_preemption(
    fixture_case: tuple[list[list[int]], list[list[int]]]
) -> None:
    prompts, expected = fixture_case
    # 8 blocks of 16 tokens cannot hold four sequences of ~50 tokens: some are preempted
    # and recomputed, and the output must not change.
    engine = specd.Engine(None, dtype="float32", spec_mode="off", num_kv_blocks=8)
    params = specd.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert engine.core.stats().num_preemptions > 0
    assert got == expected
