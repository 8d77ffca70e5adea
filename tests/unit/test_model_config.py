"""ModelConfig: what is read from a Hugging Face config.json, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specd.workers.models.config import ModelConfig, RopeScaling

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 12,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 688,
    "vocab_size": 4096, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 3,
}


def write(tmp_path: Path, config: dict[str, Any], generation: dict[str, Any] | None = None
          ) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_llama_fields(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(write(tmp_path, LLAMA))
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers) == ("LlamaForCausalLM", 256, 12)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rms_norm_eps) == (688, 4096, 1e-5)
    assert (cfg.rope_theta, cfg.rope_scaling) == (10000.0, None)
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm)
    assert cfg.eos_token_ids == (3,)
    assert cfg.max_model_len == 2048
    assert cfg.quantization_config is None


def test_generation_config_eos_list_wins(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(write(tmp_path, LLAMA, {"eos_token_id": [7, 9]}))
    assert cfg.eos_token_ids == (7, 9)


def test_explicit_head_dim_is_used(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(write(tmp_path, {**LLAMA, "head_dim": 32}))
    assert cfg.head_dim == 32 and cfg.q_size == 128 and cfg.kv_size == 64


@pytest.mark.parametrize("rope", [
    # transformers 5 layout: theta inside rope_parameters.
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}},
    # older layout: rope_theta beside rope_scaling, whose type key is `type`.
    {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}},
])
def test_llama3_rope_scaling_in_either_layout(tmp_path: Path, rope: dict[str, Any]) -> None:
    config = {k: v for k, v in LLAMA.items() if k != "rope_theta"} | rope
    cfg = ModelConfig.from_dir(write(tmp_path, config))
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_unknown_rope_type_is_refused(tmp_path: Path) -> None:
    config = {**LLAMA, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}
    with pytest.raises(ValueError, match="unsupported rope type 'longrope'.*llama3, yarn"):
        ModelConfig.from_dir(write(tmp_path, config))


def test_architecture_flags(tmp_path: Path) -> None:
    qwen2 = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"],
                                   "sliding_window": 64, "use_sliding_window": False}, tmp_path)
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen3ForCausalLM"]}, tmp_path)
    assert qwen3.qk_norm and not qwen3.qkv_bias
    biased = ModelConfig.from_dict({**LLAMA, "attention_bias": True}, tmp_path)
    assert biased.qkv_bias and biased.o_bias


def test_mistral_sliding_window_is_read_and_longer_lengths_refused(tmp_path: Path) -> None:
    # Which layers slide, and what start-up does about it: tests/unit/test_sliding_window.py.
    config = {**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 1024}
    cfg = ModelConfig.from_dir(write(tmp_path, config))
    assert cfg.sliding_window == 1024 and cfg.max_model_len == 2048
    with pytest.raises(ValueError, match="sliding_window 1024"):
        cfg.check_window(1025, "max_model_len")


def test_quantization_config_is_kept_raw(tmp_path: Path) -> None:
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    cfg = ModelConfig.from_dir(write(tmp_path, {**LLAMA, "quantization_config": quant}))
    assert cfg.quantization_config == quant


@pytest.mark.parametrize(("change", "message"), [
    ({"architectures": ["GPT2LMHeadModel"]},
     "unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM, "
     "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({"architectures": []}, "unsupported architecture None"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"vocab_size": None}, "vocab_size must be a positive integer"),
])
def test_bad_configs_name_the_field(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(write(tmp_path, {**LLAMA, **change}))


def test_missing_or_broken_config_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json: not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        ModelConfig.from_dir(tmp_path)
