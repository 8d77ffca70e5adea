"""The EAGLE-3 draft head's configuration: its config.json as published (`DraftConfig`) and
which target hidden states it reads (`resolve_aux_layer_ids`). The head itself is in
workers/spec/draft_model.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class DraftConfig:
    """The head's shape, read from its config.json (`DraftConfig.from_dict`).

    vocab_size is the TARGET vocabulary (d2t/t2d map into it); draft_vocab_size the head's.
    aux_layer_ids: None means the reference default for the target (`resolve_aux_layer_ids`).
    rope_type "default" or "llama3" (then rope_factor, low/high_freq_factor and
    original_max_position describe the Llama-3 frequency scaling).
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

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DraftConfig:
        """Parse a `LlamaForCausalLMEagle3` config.json; ValueError names what is wrong."""
        arch = cfg.get("architectures") or []
        if not any(a in ARCHITECTURES for a in arch):
            raise ValueError(f"draft config: architectures must contain one of {ARCHITECTURES} "
                             f"(the SGLang/vLLM/SpecForge EAGLE-3 layout), got {arch}")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError("draft config: only one-layer EAGLE-3 heads are supported, got "
                             f"num_hidden_layers={cfg['num_hidden_layers']}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"draft config: hidden_act must be silu, got {cfg['hidden_act']!r}")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            if key not in cfg:
                raise ValueError(f"draft config: missing {key!r}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        eagle = cfg.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids",
                        cfg.get("eagle_aux_hidden_state_layer_ids"))
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        return cls(
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size") or hidden,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_type=rope.get("rope_type", rope.get("type", "default")),
            rope_factor=rope.get("factor", 1.0),
            low_freq_factor=rope.get("low_freq_factor", 1.0),
            high_freq_factor=rope.get("high_freq_factor", 4.0),
            original_max_position=rope.get("original_max_position_embeddings", 8192),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            aux_layer_ids=None if aux is None else tuple(int(i) for i in aux),
        )


def resolve_aux_layer_ids(config: DraftConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target hidden states the head reads, in `output_hidden_states` numbering.

    The config's ids when it names them, else the reference default (2, L // 2, L - 3).
    Valid ids are 0 (the embedding output) .. L (the last block's output, before the norm),
    strictly ascending (the default is, from L = 7 on); the same rule for dense and MoE targets.
    """
    ids = config.aux_layer_ids
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    if any(not 0 <= i <= num_target_layers for i in ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(ids)} out of range for a target "
                         f"of {num_target_layers} layers (valid: 0..{num_target_layers})")
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(ids)} are not strictly "
                         f"ascending (name them for a target of {num_target_layers} layers)")
    return tuple(ids)
