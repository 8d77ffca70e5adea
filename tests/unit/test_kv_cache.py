"""The paged cache per cache kind: per-head K/V (dense decoders) and MLA's latent rows.

Sizes come from the model config (`kv_layer_shape`, `kv_elements_per_token`), so the memory
budget buys blocks of the right size; speculative compaction copies a slot's whole entry
(K and V, or the latent row) in every layer and nothing else (`copy_kv_slots`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specd.workers.config import FIXTURE_DIR, EngineConfig
from specd.workers.models.config import ModelConfig
from specd.workers.models.decoder import DecoderForCausalLM
from specd.workers.models.deepseek_v3 import DeepseekV3ForCausalLM
from specd.workers.runner.kv_cache import (
    allocate_kv_cache,
    kv_block_bytes,
    kv_bytes_per_token,
    num_kv_blocks,
)

# A small DeepSeek-V3 config.json: 5 layers, latent 32 + rope 8 (no weights needed).
DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4,
    "intermediate_size": 96, "moe_intermediate_size": 32, "vocab_size": 97,
    "max_position_embeddings": 512, "q_lora_rank": 24, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
}
BLOCK_SIZE = 4


@pytest.fixture
def mla(tmp_path: Path) -> ModelConfig:
    return ModelConfig.from_dict(DEEPSEEK, tmp_path)


def test_mla_block_bytes_count_the_latent_only(mla: ModelConfig) -> None:
    # layers x (kv_lora_rank + qk_rope_head_dim) x element bytes, not expanded per head.
    assert kv_bytes_per_token(mla, torch.bfloat16) == 5 * (32 + 8) * 2
    assert kv_bytes_per_token(mla, torch.float32) == 5 * 40 * 4
    assert kv_block_bytes(mla, BLOCK_SIZE, torch.float32) == 5 * 40 * 4 * BLOCK_SIZE
    config = EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=1 << 20)
    assert num_kv_blocks(config, mla, torch.float32) == (1 << 20) // (5 * 40 * 4 * BLOCK_SIZE)
    caches = allocate_kv_cache(mla, 6, BLOCK_SIZE, torch.bfloat16, torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [(6, BLOCK_SIZE, 40)] * 5
    assert all(c.dtype == torch.bfloat16 and not c.any() for c in caches)


def test_dense_bytes_per_token_are_k_and_v_of_every_kv_head() -> None:
    cfg = ModelConfig.from_dir(FIXTURE_DIR)
    assert kv_bytes_per_token(cfg, torch.float32) == (
        2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4)
    caches = allocate_kv_cache(cfg, 3, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    assert tuple(caches[0].shape) == (2, 3, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)


def numbered(shape: tuple[int, ...], layers: int) -> list[torch.Tensor]:
    """Layers whose every element is distinct."""
    size = int(torch.tensor(shape).prod())
    return [torch.arange(size, dtype=torch.float32).view(shape) + 1e6 * i
            for i in range(layers)]


# A tree's accepted path compacted onto the slots after the root: overlapping ranges, and
# a slot in another block.
SRC, DST = torch.tensor([5, 7, 9]), torch.tensor([4, 5, 6])


def test_latent_rows_are_copied_whole_in_every_layer() -> None:
    caches = numbered((4, BLOCK_SIZE, 40), 3)
    before = [c.clone() for c in caches]
    DeepseekV3ForCausalLM.copy_kv_slots(caches, SRC, DST)
    for layer, old in zip(caches, before, strict=True):
        rows, old_rows = layer.view(-1, 40), old.view(-1, 40)
        expected = old_rows.clone()
        expected[DST] = old_rows[SRC]  # read before written: overlap is fine
        assert torch.equal(rows, expected)


def test_dense_k_and_v_are_copied_in_every_layer() -> None:
    caches = numbered((2, 4, BLOCK_SIZE, 2, 3), 2)
    before = [c.clone() for c in caches]
    DecoderForCausalLM.copy_kv_slots(caches, SRC, DST)
    for layer, old in zip(caches, before, strict=True):
        flat, old_flat = layer.view(2, -1, 2, 3), old.view(2, -1, 2, 3)
        expected = old_flat.clone()
        expected[:, DST] = old_flat[:, SRC]
        assert torch.equal(flat, expected)
