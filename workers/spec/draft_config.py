"""The EAGLE-3 draft head's configuration: its config.json as published (`DraftConfig`) and
which target hidden states it reads (`resolve_aux_layer_ids`). The head itself is in
workers/spec/draft_model.py (a Llama layer) and workers/spec/draft_mla.py (an MLA layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specd.workers.models.config import ModelConfig
from specd.workers.models.deepseek_config import MLA_ARCHITECTURE

# How each config.json format numbers `eagle_aux_hidden_state_layer_ids`: the offset that
# turns its ids into specd's numbering (transformers' `output_hidden_states` index: 0 is the
# embedding output, k the output of decoder block k-1, i.e. the input of block k).
#  * LlamaForCausalLMEagle3 (SpecForge's and SGLang's format): id i is the OUTPUT of block i.
#    SpecForge trains on `hidden_states[i + 1]` (its default ids (1, L//2 - 1, L - 4) are
#    (2, L//2, L - 3) here); SGLang's `set_eagle3_layers_to_capture` captures before block
#    i + 1. So -1 would name the embedding output.
#  * Eagle3DeepseekV2ForCausalLM (an MLA layer; SGLang's name, which TorchSpec trains and
#    NVIDIA ModelOpt exports for Kimi-K2.x): SGLang's rule, as LlamaForCausalLMEagle3 (vLLM
#    serves the same name capturing block inputs; such a head read by vLLM's rule is one
#    block off).
#  * Eagle3LlamaForCausalLM (vLLM's name), LlamaForCausalLM with a draft_vocab_size (the
#    original EAGLE-3 releases, which vLLM serves; EAGLE's own trainer writes no ids) and
#    the Speculators format (its data generation uses vLLM's capture): id i is the INPUT of
#    block i; vLLM captures `hidden_states + residual` before block i, as given.
# Without ids every engine uses the EAGLE reference default, (2, L//2, L - 3) here.
MLA_HEAD = "Eagle3DeepseekV2ForCausalLM"
AUX_ID_OFFSET = {
    "LlamaForCausalLMEagle3": 1,
    MLA_HEAD: 1,
    "Eagle3LlamaForCausalLM": 0,
    "LlamaForCausalLM": 0,
    "Eagle3Speculator": 0,
}
ARCHITECTURES = tuple(AUX_ID_OFFSET)
SPECULATORS = "Eagle3Speculator"
# An MLA head's config.json is a DeepSeek-V3 config; these keys describe its attention (and
# rope) and are read as the target's are (ModelConfig). The MoE keys a ModelOpt export copies
# from the target describe no part of the head (its layer has a dense MLP) and are not read.
LLAMA_ROPE_FIELDS = ("rope_type", "rope_factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position")
MLA_LAYER_KEYS = ("model_type", "hidden_size", "num_attention_heads", "intermediate_size",
                  "vocab_size", "max_position_embeddings", "rms_norm_eps", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
                  "original_max_position_embeddings")


@dataclass(frozen=True)
class DraftConfig:
    """The head's shape, read from its config.json (`DraftConfig.from_dict`).

    vocab_size is the TARGET vocabulary (d2t/t2d map into it); draft_vocab_size the head's.
    aux_layer_ids: in specd's numbering (`output_hidden_states` index; `from_dict` converts a
    config's ids by its format's rule, `AUX_ID_OFFSET`); None means the reference default
    for the target (`resolve_aux_layer_ids`).
    rope_type "default" or "llama3" (then rope_factor, low/high_freq_factor and
    original_max_position describe the Llama-3 frequency scaling).
    norm_before_residual: the residual of the layer's attention is `hidden_norm(hidden)`
    rather than `hidden` (a Speculators option; vLLM reads it from any config).
    norm_output: the layer's output is normed (`norm`) before it is fed back to the next
    draft step, and the logits are `lm_head` of that normed state (Speculators' Eagle 3.1
    option, which vLLM reads from any config).
    mla_layer: for an `Eagle3DeepseekV2ForCausalLM` head, its layer's multi-head latent
    attention as a one-layer DeepSeek-V3 `ModelConfig` (MLA shapes, rope, rms_norm_eps);
    the head's num_key_value_heads then equals num_attention_heads, head_dim is the q/k
    head dim (nope + rope), and the Llama rope fields above are unused. None for a Llama
    layer.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    max_position_embeddings: int = 2048
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    norm_output: bool = False
    mla_layer: ModelConfig | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size",
                     "target_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"draft config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"draft config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft config: draft_vocab_size ({self.draft_vocab_size}) must be "
                             f"<= vocab_size ({self.vocab_size})")
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(
                f"draft config: rope type must be default or llama3, got {self.rope_type!r}")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(f"draft config: eagle_aux_hidden_state_layer_ids must name 3 layers, "
                             f"got {list(self.aux_layer_ids)}")

    @property
    def kv_elements_per_token(self) -> int:
        """Draft-cache elements one token takes: K and V of every KV head, or an MLA head's
        latent row (kv_lora_rank + qk_rope_head_dim)."""
        if self.mla_layer is not None:
            return self.mla_layer.kv_elements_per_token
        return 2 * self.num_key_value_heads * self.head_dim

    def kv_layer_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The head's paged cache: `[2, num_blocks, block_size, num_key_value_heads,
        head_dim]`, or an MLA head's `[num_blocks, block_size, kv_lora_rank +
        qk_rope_head_dim]` (the target's layouts, `ModelConfig.kv_layer_shape`)."""
        if self.mla_layer is not None:
            return self.mla_layer.kv_layer_shape(num_blocks, block_size)
        return (2, num_blocks, block_size, self.num_key_value_heads, self.head_dim)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DraftConfig:
        """Parse a head's config.json in any published format (`head_format`); ValueError
        names the field that is wrong or that specd cannot serve."""
        fmt = head_format(cfg)
        if fmt == SPECULATORS:
            layer = cfg.get("transformer_layer_config")
            if not isinstance(layer, dict):
                raise ValueError("draft config: a Speculators config needs a "
                                 "transformer_layer_config object")
            if layer.get("model_type", "llama") != "llama":
                raise ValueError("draft config: transformer_layer_config.model_type must be "
                                 f"llama, got {layer['model_type']!r}")
            if "norm_before_residual" not in cfg:
                # The speculators library defaults it to false, vLLM to true: say which.
                raise ValueError("draft config: a Speculators config must set "
                                 "norm_before_residual (its readers disagree on the default)")
            eagle, aux = cfg, cfg.get("eagle_aux_hidden_state_layer_ids")
        else:
            layer, eagle = cfg, cfg
            nested = cfg.get("eagle_config") or {}
            if nested.get("use_aux_hidden_state", True) is not True:
                raise ValueError("draft config: eagle_config.use_aux_hidden_state must be true "
                                 "(a head without the fused target hidden states is EAGLE-1)")
            aux = nested.get("eagle_aux_hidden_state_layer_ids",
                             cfg.get("eagle_aux_hidden_state_layer_ids"))
        _check_layer(layer, eagle)
        _check_dense_weights(cfg, layer)
        offset = AUX_ID_OFFSET[fmt]
        fields = _shape_fields(layer, eagle)
        mla_layer = _mla_layer(layer) if fmt == MLA_HEAD else None
        if mla_layer is not None:
            for key in LLAMA_ROPE_FIELDS:  # the MLA rope is mla_layer's
                del fields[key]
            fields.update(num_key_value_heads=mla_layer.num_heads,
                          head_dim=mla_layer.head_dim, rms_norm_eps=mla_layer.rms_norm_eps)
        return cls(**fields,
                   aux_layer_ids=tuple(int(i) + offset for i in aux) if aux else None,
                   norm_before_residual=bool(eagle.get("norm_before_residual", False)),
                   norm_output=bool(eagle.get("norm_output", False)), mla_layer=mla_layer)


def head_format(cfg: dict[str, Any]) -> str:
    """Which published format a head's config.json is in (a key of `AUX_ID_OFFSET`).

    Speculators: `speculators_model_type` "eagle3" (architecture `Eagle3Speculator`). A plain
    `LlamaForCausalLM` counts as an EAGLE-3 head only with a `draft_vocab_size` (vLLM's rule
    for the original EAGLE-3 releases). ValueError naming `architectures` otherwise.
    """
    arch = cfg.get("architectures") or []
    if "speculators_model_type" in cfg or SPECULATORS in arch:
        kind = cfg.get("speculators_model_type")
        if kind != "eagle3":
            raise ValueError(f"draft config: speculators_model_type must be eagle3, got {kind!r}")
        return SPECULATORS
    for name in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", MLA_HEAD):
        if name in arch:
            return name
    if "LlamaForCausalLM" in arch:
        if "draft_vocab_size" not in cfg:
            raise ValueError("draft config: architectures LlamaForCausalLM without "
                             "draft_vocab_size is a target model, not an EAGLE-3 head")
        return "LlamaForCausalLM"
    raise ValueError(f"draft config: architectures must contain one of {ARCHITECTURES} "
                     f"(the published EAGLE-3 formats), got {arch}")


def aux_layer_ids_as(config: DraftConfig, fmt: str) -> list[int] | None:
    """The config's aux layer ids as format `fmt` writes them (inverse of `from_dict`)."""
    if config.aux_layer_ids is None:
        return None
    return [i - AUX_ID_OFFSET[fmt] for i in config.aux_layer_ids]


def _check_layer(layer: dict[str, Any], eagle: dict[str, Any]) -> None:
    """Refuse, by field, what the head (one bias-free Llama layer) does not implement."""
    if layer.get("num_hidden_layers", 1) != 1:
        raise ValueError("draft config: only one-layer EAGLE-3 heads are supported, got "
                         f"num_hidden_layers={layer['num_hidden_layers']}")
    if layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"draft config: hidden_act must be silu, got {layer['hidden_act']!r}")
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key, False):
            raise ValueError(f"draft config: {key} must be false (the head has no biases)")
    if eagle.get("norm_before_fc", False):
        raise ValueError("draft config: norm_before_fc (a norm before fc) is not supported")
    if eagle.get("fc_norm", False):
        raise ValueError("draft config: fc_norm (a norm of each aux hidden state before fc) is "
                         "not supported")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in layer:
            raise ValueError(f"draft config: missing {key!r}")


def _check_dense_weights(cfg: dict[str, Any], layer: dict[str, Any]) -> None:
    """Refuse a head that says its weights are quantized (FP8, NVFP4, INT4 heads exist):
    specd serves draft heads in the serving dtype only."""
    for where, raw in (("", cfg), ("transformer_layer_config.", layer)):
        for key in ("quantization_config", "compression_config"):
            quant = raw.get(key)
            if quant:
                method = quant.get("quant_method") if isinstance(quant, dict) else quant
                raise ValueError(f"draft config: {where}{key} (quant_method {method!r}) is not "
                                 "supported: draft heads are served with dense weights")


def _mla_layer(layer: dict[str, Any]) -> ModelConfig:
    """An Eagle3DeepseekV2ForCausalLM head's attention, read as a one-layer DeepSeek-V3 (its
    MLA fields and rope parsed and checked as the target's are). Refused: rope_interleave
    false (SGLang, vLLM and TorchSpec rotate an MLA head's rope in interleaved pairs whatever
    the config says)."""
    if layer.get("rope_interleave", True) is not True:
        raise ValueError("draft config: rope_interleave must be true for an MLA head (its "
                         "readers rotate interleaved pairs)")
    raw = {k: layer[k] for k in MLA_LAYER_KEYS if k in layer}
    raw.update(architectures=[MLA_ARCHITECTURE], num_hidden_layers=1, attention_bias=False,
               rope_interleave=True)
    where = Path("config.json")
    try:
        return ModelConfig.from_dict(raw, Path(""))
    except ValueError as e:
        raise ValueError(f"draft config: {str(e).removeprefix(f'{where}: ')}") from e


def _shape_fields(layer: dict[str, Any], eagle: dict[str, Any]) -> dict[str, Any]:
    """DraftConfig's shape and rope fields from the layer's keys (Llama config names) and
    the EAGLE-3 keys (`draft_vocab_size`, `target_hidden_size`)."""
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    return {
        "hidden_size": hidden,
        "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": layer.get("num_key_value_heads") or heads,
        "head_dim": layer.get("head_dim") or hidden // heads,
        "vocab_size": layer["vocab_size"],
        "draft_vocab_size": eagle.get("draft_vocab_size") or layer["vocab_size"],
        "target_hidden_size": eagle.get("target_hidden_size") or hidden,
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-5),
        "rope_theta": layer.get("rope_theta", rope.get("rope_theta", 10000.0)),
        "rope_type": rope.get("rope_type", rope.get("type", "default")),
        "rope_factor": rope.get("factor", 1.0),
        "low_freq_factor": rope.get("low_freq_factor", 1.0),
        "high_freq_factor": rope.get("high_freq_factor", 4.0),
        "original_max_position": rope.get("original_max_position_embeddings", 8192),
        "max_position_embeddings": layer.get("max_position_embeddings", 2048),
    }


def resolve_aux_layer_ids(config: DraftConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target hidden states the head reads, in `output_hidden_states` numbering.

    The config's ids (already in this numbering, `DraftConfig.from_dict`) when it names
    them, else the reference default (2, L // 2, L - 3).
    Valid ids are 0 (the embedding output) .. L (the last block's output, before the norm),
    strictly ascending (the default is, from L = 7 on); the same rule for dense and MoE targets.
    """
    ids = config.aux_layer_ids
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    if any(not 0 <= i <= num_target_layers for i in ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(ids)} (output_hidden_states "
                         f"numbering) out of range for a target of {num_target_layers} layers "
                         f"(valid: 0..{num_target_layers})")
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(ids)} are not strictly "
                         f"ascending (name them for a target of {num_target_layers} layers)")
    return tuple(ids)
