"""A GGUF file's model metadata as a Hugging Face `config.json` (no torch).

llama.cpp writes the architecture as `general.architecture` and its hyperparameters under
that name (`llama.block_count`, ...). Only the `llama` architecture is imported: the Llama
family specd's dense decoder serves (SmolLM2, Llama 2/3 and their fine-tunes). Every key of
the architecture's namespace must be one this module reads; any other one (rope scaling,
expert counts, a separate key length, ...) would change the model, so it is refused by name
rather than dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ARCHITECTURES = {"llama": "LlamaForCausalLM"}

# `llama.<key>` -> the config.json field it becomes (None: read but not a field of its own).
LLAMA_KEYS: dict[str, str | None] = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "rope.dimension_count": None,  # checked: the whole head rotates
}
REQUIRED_KEYS = ("block_count", "embedding_length", "feed_forward_length",
                 "attention.head_count", "attention.layer_norm_rms_epsilon")


def model_config(metadata: Mapping[str, Any], num_tokens: int, tied: bool,
                 special_ids: Mapping[str, int]) -> dict[str, Any]:
    """config.json for a GGUF file's `metadata` (key -> value); num_tokens: the vocabulary's
    length; tied: no `output.weight` (lm_head is the embedding); special_ids: bos/eos token
    ids. ValueError naming the key for an architecture or a key this import cannot honour."""
    arch = str(metadata.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF general.architecture {arch!r} is not imported; supported: "
                         f"{sorted(ARCHITECTURES)}")
    prefix = f"{arch}."
    own = {k.removeprefix(prefix): v for k, v in metadata.items() if k.startswith(prefix)}
    unknown = sorted(k for k in own if k not in LLAMA_KEYS)
    if unknown:
        raise ValueError(f"GGUF key {prefix}{unknown[0]} is not implemented by the import "
                         f"(it would change the model); known: {sorted(LLAMA_KEYS)}")
    missing = [k for k in REQUIRED_KEYS if k not in own]
    if missing:
        raise ValueError(f"GGUF file lacks {prefix}{missing[0]}")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": num_tokens,
    }
    for key, field in LLAMA_KEYS.items():
        if field is not None and key in own:
            config[field] = _plain(own[key])
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if "rope.dimension_count" in own and int(own["rope.dimension_count"]) != head_dim:
        raise ValueError(f"GGUF {prefix}rope.dimension_count {own['rope.dimension_count']} "
                         f"rotates part of the head (head_dim {head_dim}); not implemented")
    if config["vocab_size"] != num_tokens:
        raise ValueError(f"GGUF {prefix}vocab_size {config['vocab_size']} differs from the "
                         f"{num_tokens} tokens of tokenizer.ggml.tokens")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if name in special_ids:
            config[name] = special_ids[name]
    return config


def generation_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json: the end-of-sequence id (what stops a generation)."""
    out: dict[str, Any] = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if name in config:
            out[name] = config[name]
    return out


def _plain(value: Any) -> Any:
    """A metadata value as JSON: numpy scalars become Python numbers."""
    return value.item() if hasattr(value, "item") else value
