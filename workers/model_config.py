"""A model's architecture, read once from a Hugging Face model directory (no torch).

`ModelConfig.from_dir(path)` parses `config.json` (and `generation_config.json` for the
end-of-sequence ids) into one frozen object that the model, the loader, the KV cache and the
engine all read. Anything the engine cannot serve faithfully is rejected here with a
ValueError naming the field and the supported values, before any weight is touched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architectures the decoder serves, and what each adds to the Llama block.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Rope types the rotary embedding implements ("default" = plain theta^(-2i/d)).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling: `linear` divides positions by `factor`; `llama3` rescales the
    low frequencies (Llama 3.1's scheme, as transformers' `_compute_llama3_parameters`)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one decoder-only model.

    qkv_bias: biases on q/k/v (Qwen2 always; Llama when `attention_bias`).
    o_bias: a bias on the output projection (Llama with `attention_bias`).
    qk_norm: RMSNorm over each head of q and k before rope (Qwen3).
    sliding_window: the attention window when the model uses one over all layers (some
        Mistral checkpoints); the engine caps its maximum length at it, so that full causal
        attention stays exact.
    quantization_config: `config.json`'s raw `quantization_config`, for the INT4 layers.
    """

    model_dir: Path
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    quantization_config: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly: the position limit, or the sliding window."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Parse `model_dir/config.json` (+ `generation_config.json` if present)."""
        model_dir = Path(model_dir)
        raw = _read_json(model_dir / "config.json")
        generation_path = model_dir / "generation_config.json"
        generation = _read_json(generation_path) if generation_path.is_file() else None
        return cls.from_dict(raw, model_dir, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], model_dir: Path,
                  generation: dict[str, Any] | None = None) -> ModelConfig:
        where = model_dir / "config.json"
        architecture = _architecture(raw, where)
        hidden = _int(raw, "hidden_size", where)
        num_heads = _int(raw, "num_attention_heads", where)
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{where}: num_attention_heads ({num_heads}) must be a multiple "
                             f"of num_key_value_heads ({num_kv_heads})")
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        attention_bias = bool(raw.get("attention_bias", False))
        # Qwen2 always biases q/k/v; Llama and Qwen3 bias q/k/v/o with `attention_bias`.
        biased = attention_bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM")
        rope_theta, rope_scaling = _rope(raw, where)
        activation = raw.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"{where}: hidden_act {activation!r} is not supported (only silu)")
        return cls(
            model_dir=model_dir,
            architecture=architecture,
            hidden_size=hidden,
            num_layers=_int(raw, "num_hidden_layers", where),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=_int(raw, "intermediate_size", where),
            vocab_size=_int(raw, "vocab_size", where),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=biased or architecture == "Qwen2ForCausalLM",
            o_bias=biased,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            max_position_embeddings=_int(raw, "max_position_embeddings", where),
            sliding_window=_sliding_window(raw, architecture),
            eos_token_ids=_eos_ids(raw, generation),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            quantization_config=raw.get("quantization_config"),
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path}: not found (a Hugging Face model directory needs it)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _int(raw: dict[str, Any], key: str, where: Path) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _architecture(raw: dict[str, Any], where: Path) -> str:
    architectures = raw.get("architectures") or []
    name = architectures[0] if architectures else None
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{where}: unsupported architecture {name!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return str(name)


def _rope(raw: dict[str, Any], where: Path) -> tuple[float, RopeScaling | None]:
    """Read rope from either layout: transformers 5's `rope_parameters` (theta inside) or
    the older `rope_theta` + `rope_scaling` (whose type key is `rope_type` or `type`)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {partial} is not supported (only 1.0)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{where}: unsupported rope type {rope_type!r}; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(params["factor"]))
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in params]
    if missing:
        raise ValueError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
    return theta, RopeScaling(
        "llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    # Qwen2/3 carry a `sliding_window` value that only applies with `use_sliding_window`.
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get(
            "use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    """generation_config.json's eos_token_id wins over config.json's; either may be a list."""
    value = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    return tuple(int(i) for i in ids)
