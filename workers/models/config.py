"""A model's architecture, read once from a Hugging Face model directory (no torch).

`ModelConfig.from_dir(path)` parses `config.json` (and `generation_config.json` for the
end-of-sequence ids) into one frozen object that the model, the loader, the KV cache and the
engine all read. Anything the engine cannot serve faithfully is rejected here with a
ValueError naming the field and the supported values, before any weight is touched.

DeepSeek-V3 / Kimi-K2 (and Kimi-K2.5's language model) add an `MlaConfig` and a `MoeConfig`
(deepseek_config.py); for the dense decoders both are None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.workers.models.deepseek_config import (
    MLA_ARCHITECTURE,
    MlaConfig,
    MoeConfig,
    language_model_config,
    num_mtp_layers,
    parse_mla,
    parse_moe,
)

# Architectures the decoder serves, and what each adds to the Llama block.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    MLA_ARCHITECTURE,
)
# Rope types the rotary embedding implements ("default" = plain theta^(-2i/d)).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MLA_ROPE_TYPES = ("default", "yarn")
# transformers' defaults when config.json leaves the sliding-window fields out (Mistral's
# and Qwen2/3's `sliding_window`; Qwen2/3's `max_window_layers`).
DEFAULT_SLIDING_WINDOW = 4096
QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
YARN_ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "factor",
                  "original_max_position_embeddings", "attention_factor", "beta_fast",
                  "beta_slow", "mscale", "mscale_all_dim", "truncate")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling: `linear` divides positions by `factor`; `llama3` rescales the
    low frequencies (Llama 3.1's scheme, as transformers' `_compute_llama3_parameters`);
    `yarn` blends interpolated and original frequencies between the correction dimensions
    of beta_fast and beta_slow, scales cos/sin by `attention_factor` (or the mscale ratio)
    and, for MLA, the softmax by mscale(factor, mscale_all_dim)^2 (workers/models/rope.py)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor!r}")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one decoder-only model.

    qkv_bias: biases on q/k/v (Qwen2 always; Llama when `attention_bias`).
    o_bias: a bias on the output projection (Llama with `attention_bias`).
    qk_norm: RMSNorm over each head of q and k before rope (Qwen3).
    sliding_window: the attention window of the layers that use one, as transformers reads
        the config (`_sliding_window`); None when no layer slides. specd attends over the
        whole sequence, which equals windowed attention only while a sequence is no longer
        than the window, so a longer maximum length is refused at start-up (`check_window`).
    quantization_config: `config.json`'s raw `quantization_config` (or the older
        `compression_config`), for the INT4 layers (checked by workers/models/quant_config.py).
    mla, moe: DeepSeek-V3's attention and experts (None for the dense decoders; num_kv_heads
        is then nominal, equal to num_heads, and head_dim is the q/k head dim, nope + rope).
    weight_prefix: the prefix of the served model's tensor names in the checkpoint
        ("language_model." for Kimi-K2.5, whose other tensors are its vision part, not
        served); "" for a plain causal LM.
    num_mtp_layers: multi-token-prediction layers stored after the last decoder layer
        (numbered num_layers, ...): not served, their tensors are skipped.
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
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None
    weight_prefix: str = ""
    num_mtp_layers: int = 0

    @property
    def kv_elements_per_token(self) -> int:
        """Paged-cache elements one token takes over all layers: K and V of every KV head,
        or for MLA the latent [kv_c_normed ‖ roped k_pe] (kv_lora_rank + qk_rope_head_dim)."""
        if self.mla is not None:
            return self.num_layers * self.mla.latent_size
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def kv_layer_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's paged-cache tensor: `[2, num_blocks, block_size, num_kv_heads,
        head_dim]` (K at [0], V at [1]), or for MLA `[num_blocks, block_size, kv_lora_rank +
        qk_rope_head_dim]` (one latent row per token, shared by all heads)."""
        if self.mla is not None:
            return (num_blocks, block_size, self.mla.latent_size)
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @property
    def max_model_len(self) -> int:
        """The model's own length limit: max_position_embeddings."""
        return self.max_position_embeddings

    def served_len(self, max_model_len: int | None) -> int:
        """The longest sequence asked for: `max_model_len` (the option), else
        max_position_embeddings. Raises a ValueError when it exceeds that limit or the
        sliding window (`check_window`). No torch: the front checks it before the
        scheduler starts, and the engine again (engine_setup.requested_model_len)."""
        limit = self.max_position_embeddings
        if max_model_len is None:
            self.check_window(limit, "max_position_embeddings, as no max_model_len is set")
            return limit
        if max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {limit}")
        self.check_window(max_model_len, "max_model_len")
        return max_model_len

    def check_window(self, length: int, source: str) -> None:
        """Raise a ValueError naming `sliding_window` when sequences of `length` tokens
        (whose value comes from `source`) would reach past the window: there the model
        attends to the last `sliding_window` tokens only, which specd does not implement.
        Up to the window both attentions see every earlier token (transformers' rule: key
        k is visible to query q iff q - window < k <= q), so serving stays exact."""
        window = self.sliding_window
        if window is not None and length > window:
            raise ValueError(
                f"{self.model_dir / 'config.json'}: sliding_window {window} is shorter than "
                f"the maximum length {length} ({source}); specd attends over the whole "
                f"sequence, which equals the model's windowed attention only up to "
                f"{window} tokens: pass --max-model-len {window} (or less)")

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
        raw = read_json_object(model_dir / "config.json")
        generation_path = model_dir / "generation_config.json"
        generation = read_json_object(generation_path) if generation_path.is_file() else None
        return cls.from_dict(raw, model_dir, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], model_dir: Path,
                  generation: dict[str, Any] | None = None) -> ModelConfig:
        where = model_dir / "config.json"
        raw, weight_prefix = language_model_config(raw, where)
        architecture = _architecture(raw, where)
        hidden = _int(raw, "hidden_size", where)
        num_heads = _int(raw, "num_attention_heads", where)
        is_mla = architecture == MLA_ARCHITECTURE
        mla = parse_mla(raw, where) if is_mla else None
        # MLA's num_key_value_heads is nominal (one latent serves every head).
        num_kv_heads = num_heads if is_mla else int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{where}: num_attention_heads ({num_heads}) must be a multiple "
                             f"of num_key_value_heads ({num_kv_heads})")
        head_dim = (mla.qk_head_dim if mla is not None
                    else int(raw.get("head_dim") or hidden // num_heads))
        attention_bias = bool(raw.get("attention_bias", False))
        # Qwen2 always biases q/k/v; Llama and Qwen3 bias q/k/v/o with `attention_bias`
        # (MLA's biases are MlaConfig.attention_bias).
        biased = attention_bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM")
        rope_theta, rope_scaling = _rope(raw, where, MLA_ROPE_TYPES if is_mla
                                         else SUPPORTED_ROPE_TYPES)
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
            sliding_window=_sliding_window(raw, architecture, where),
            eos_token_ids=_eos_ids(raw, generation),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            # `compression_config`: the key older compressed-tensors exports wrote instead.
            quantization_config=raw.get("quantization_config", raw.get("compression_config")),
            mla=mla,
            moe=parse_moe(raw, where) if is_mla else None,
            weight_prefix=weight_prefix,
            num_mtp_layers=num_mtp_layers(raw) if is_mla else 0,
        )


class MissingFileError(FileNotFoundError, ValueError):
    """A file a model or draft head directory needs is absent: a missing file (what the engine
    reports) and a wrong value of the option naming the directory (what `specctl plan`
    reports as a usage error)."""


def read_json_object(path: Path, needed_by: str = "a Hugging Face model directory",
                     ) -> dict[str, Any]:
    """The JSON object in `path` (config.json, generation_config.json; the one reader of a
    model's or a draft head's): MissingFileError naming the file and what `needed_by` it when
    it is absent, ValueError naming it when it is not JSON or not an object."""
    if not path.is_file():
        raise MissingFileError(f"{path}: not found ({needed_by} needs it)")
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


def _rope(raw: dict[str, Any], where: Path, supported: tuple[str, ...]
          ) -> tuple[float, RopeScaling | None]:
    """Read rope from either layout: transformers 5's `rope_parameters` (theta inside) or
    the older `rope_theta` + `rope_scaling` (whose type key is `rope_type` or `type`)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {partial} is not supported (only 1.0)")
    if rope_type not in supported:
        raise ValueError(f"{where}: unsupported rope type {rope_type!r}; "
                         f"supported: {', '.join(supported)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(params["factor"]))
    if rope_type == "yarn":
        return theta, _yarn(raw, params, where)
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


def _yarn(raw: dict[str, Any], params: dict[str, Any], where: Path) -> RopeScaling:
    """YaRN as transformers reads it: a top-level original_max_position_embeddings wins over
    the rope dict's, which defaults to max_position_embeddings; a null factor is their
    ratio; a null (or zero) beta_fast / beta_slow is 32 / 1."""
    unknown = sorted(set(params) - set(YARN_ROPE_KEYS))
    if unknown:
        raise ValueError(f"{where}: yarn rope scaling key {unknown[0]!r} is not supported; "
                         f"supported: {', '.join(YARN_ROPE_KEYS)}")
    original = int(raw.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings")
                   or _int(raw, "max_position_embeddings", where))
    factor = params.get("factor")
    if factor is None:
        factor = _int(raw, "max_position_embeddings", where) / original
    try:
        return RopeScaling("yarn", factor=float(factor),
                           original_max_position_embeddings=original,
                           beta_fast=float(params.get("beta_fast") or 32),
                           beta_slow=float(params.get("beta_slow") or 1),
                           mscale=_optional_float(params, "mscale"),
                           mscale_all_dim=_optional_float(params, "mscale_all_dim"),
                           attention_factor=_optional_float(params, "attention_factor"),
                           truncate=bool(params.get("truncate", True)))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def _optional_float(params: dict[str, Any], key: str) -> float | None:
    return None if params.get(key) is None else float(params[key])


def _sliding_window(raw: dict[str, Any], architecture: str, where: Path) -> int | None:
    """The window as transformers applies it. Mistral: on every layer (`sliding_window`,
    4096 when absent, null for none). Qwen2/3: only with `use_sliding_window`, and only on
    the layers `layer_types` marks "sliding_attention", by default those numbered >=
    `max_window_layers` (28 when absent); a window no layer uses is None. Llama and
    DeepSeek-V3 have none."""
    if architecture == "MistralForCausalLM":
        window = raw.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not raw.get("use_sliding_window", False):
            return None
        window = raw.get("sliding_window", DEFAULT_SLIDING_WINDOW)
        num_layers = _int(raw, "num_hidden_layers", where)
        first_sliding = int(raw.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS))
        layer_types = raw.get("layer_types") or [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(num_layers)]
        if "sliding_attention" not in layer_types:
            return None
    else:
        return None
    if window is None:
        return None
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{where}: sliding_window must be a positive integer or null, "
                         f"got {window!r}")
    return window


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    """generation_config.json's eos_token_id wins over config.json's; either may be a list."""
    value = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    return tuple(int(i) for i in ids)
