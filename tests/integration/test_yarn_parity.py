"""YaRN rope scaling on the dense decoders (NeoX rotation) against transformers.

Tiny random Llama and Qwen2 models with `rope_parameters` type yarn are saved with
`save_pretrained`, loaded by specd's loader, and run over a paged cache (hand-built block
tables, `build_attention_metadata`): a prefill reaching positions past
original_max_position_embeddings, then decode steps. Tolerance as test_model_parity.py
(float32, other summation orders: ~1e-6 measured, ATOL 1e-4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from specd.workers.models.config import ModelConfig
from specd.workers.models.loader import load_model
from specd.workers.runner.attention import build_attention_metadata

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BLOCK_SIZE = 4
CPU = torch.device("cpu")
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, rope_parameters=dict(YARN)),
    "qwen2": lambda: transformers.Qwen2Config(
        **SMALL, rope_parameters=YARN | {"beta_fast": 8, "beta_slow": 2, "truncate": False}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_yarn_prefill_and_decode_match_transformers(tmp_path: Path, name: str) -> None:
    torch.manual_seed(0)
    hf: Any = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](),
                                                           attn_implementation="eager")
    hf.save_pretrained(tmp_path)
    hf.eval()
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn"
    model = load_model(cfg, CPU, torch.float32)
    caches = [torch.zeros(cfg.kv_layer_shape(16, BLOCK_SIZE)) for _ in range(cfg.num_layers)]
    blocks = list(range(15, -1, -1))
    tokens = torch.randint(cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    done = 0
    for n in (27, 1, 1, 1):  # positions 0..26, then decode to 29
        meta = build_attention_metadata([n], [done + n], [blocks], BLOCK_SIZE, CPU)
        with torch.inference_mode():
            hidden, _ = model(tokens[done:done + n], torch.arange(done, done + n), caches, meta)
            got = model.compute_logits(hidden)
        with torch.no_grad():
            expected = hf(tokens[None, :done + n]).logits[0, done:]
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        done += n
