"""Sliding windows: which configs have one (as transformers reads them), and the start-up rule.

specd attends over the whole sequence. That equals a window's attention only while no
sequence is longer than the window, so a maximum length past the window is refused by
name, and `--max-model-len` at or below it is served. Oracle for which configs slide:
transformers' own config classes (`sliding_window`, and Qwen's `layer_types`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specd.workers.config import EngineConfig
from specd.workers.engine.setup import max_model_len, requested_model_len
from specd.workers.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

BASE = {
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300,
    "max_position_embeddings": 2048,
}
MISTRAL = {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
QWEN2 = {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
QWEN3 = {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}

CASES = {
    "mistral-window": {**MISTRAL, "sliding_window": 1024},
    "mistral-null": {**MISTRAL, "sliding_window": None},
    "mistral-absent": MISTRAL,  # transformers' default window, 4096
    "qwen2-off": {**QWEN2, "sliding_window": 64, "use_sliding_window": False},
    "qwen2-no-layer-slides": {**QWEN2, "sliding_window": 64, "use_sliding_window": True,
                              "max_window_layers": 4},
    "qwen2-upper-layers-slide": {**QWEN2, "sliding_window": 64, "use_sliding_window": True,
                                 "max_window_layers": 2},
    "qwen2-default-max-window-layers": {**QWEN2, "sliding_window": 64,
                                        "use_sliding_window": True},
    "qwen2-layer-types": {**QWEN2, "sliding_window": 64, "use_sliding_window": True,
                          "max_window_layers": 4, "layer_types": [
                              "full_attention", "sliding_attention", "full_attention",
                              "full_attention"]},
    "qwen3-all-slide": {**QWEN3, "sliding_window": 64, "use_sliding_window": True,
                        "max_window_layers": 0},
    "qwen3-off": {**QWEN3, "sliding_window": 64},
}


def transformers_window(raw: dict[str, Any]) -> int | None:
    """The window transformers' modelling code applies to some layer, or None."""
    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    config = transformers.AutoConfig.for_model(raw["model_type"], **kwargs)
    if raw["model_type"] == "mistral":  # every layer uses config.sliding_window
        return config.sliding_window
    slides = "sliding_attention" in config.layer_types
    return config.sliding_window if slides else None


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_window_is_the_one_transformers_applies(tmp_path: Path, name: str) -> None:
    raw = CASES[name]
    assert ModelConfig.from_dict(raw, tmp_path).sliding_window == transformers_window(raw)


def test_llama_has_no_window_whatever_the_config_says(tmp_path: Path) -> None:
    # LlamaAttention has no sliding window: a stray field changes nothing.
    raw = {**BASE, "architectures": ["LlamaForCausalLM"], "sliding_window": 64}
    assert ModelConfig.from_dict(raw, tmp_path).sliding_window is None


def test_a_malformed_window_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        ModelConfig.from_dict({**MISTRAL, "sliding_window": 0}, tmp_path)


def test_start_up_refuses_the_model_length_past_the_window(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dict(CASES["mistral-window"], tmp_path)
    with pytest.raises(ValueError, match=r"sliding_window 1024 .* maximum length 2048 "
                                         r"\(max_position_embeddings.*--max-model-len 1024"):
        requested_model_len(EngineConfig(), cfg)
    with pytest.raises(ValueError, match=r"sliding_window 1024 .* 1025 \(max_model_len\)"):
        requested_model_len(EngineConfig(max_model_len=1025), cfg)


def test_a_max_model_len_within_the_window_is_served(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dict(CASES["mistral-window"], tmp_path)
    config = EngineConfig(max_model_len=1024, block_size=16)
    assert requested_model_len(config, cfg) == 1024
    assert max_model_len(config, cfg, num_kv_blocks=64) == 1024


@pytest.mark.parametrize("name", ["qwen2-off", "qwen2-no-layer-slides", "qwen3-off"])
def test_configs_without_a_sliding_layer_serve_their_whole_length(tmp_path: Path,
                                                                 name: str) -> None:
    cfg = ModelConfig.from_dict(CASES[name], tmp_path)
    assert requested_model_len(EngineConfig(), cfg) == 2048
    assert max_model_len(EngineConfig(block_size=16), cfg, num_kv_blocks=1000) == 2048
