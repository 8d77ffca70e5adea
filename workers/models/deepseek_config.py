"""The DeepSeek-V3 / Kimi-K2 parts of a model's architecture (no torch): MLA and MoE.

`ModelConfig` holds an `MlaConfig` and a `MoeConfig` for `DeepseekV3ForCausalLM` checkpoints
(`model_type` deepseek_v3 or kimi_k2) and None for the dense decoders. A field absent from
config.json takes transformers' `DeepseekV3Config` default, as transformers itself would;
a value specd does not implement is refused with a ValueError naming the field.

Kimi-K2.5 is a multimodal wrapper (`model_type` kimi_k25): its language model is a
DeepSeek-V3 whose config is `text_config` and whose tensors sit under `language_model.`;
specd serves that language model only (`language_model_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MLA_ARCHITECTURE = "DeepseekV3ForCausalLM"
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# Multimodal wrappers whose language model specd serves: model_type -> tensor name prefix.
WRAPPER_PREFIXES = {"kimi_k25": "language_model."}
# Wrapper keys the language model inherits when its text_config lacks them.
INHERITED_KEYS = ("torch_dtype", "dtype", "eos_token_id", "quantization_config")
SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "greedy")
# transformers' DeepseekV3Config defaults (and the DeepSeek reference code's for the fields
# transformers does not have: scoring_func, topk_method, moe_layer_freq).
DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "attention_bias": False, "rope_interleave": True,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
}


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3).

    q_lora_rank: the rank of the low-rank query (q_a_proj -> q_a_layernorm -> q_b_proj), or
        None for a plain q_proj. kv_lora_rank: the latent c_kv per token. Per head, q and k
        have qk_nope_head_dim + qk_rope_head_dim dimensions (rope on the last part only, one
        rope key shared by all heads) and v has v_head_dim. attention_bias: biases on
        q_a_proj, kv_a_proj_with_mqa and o_proj. rope_interleave: rope pairs (2i, 2i + 1)
        (DeepSeek's checkpoints) instead of (i, i + d / 2).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and not (isinstance(self.q_lora_rank, int)
                                                 and self.q_lora_rank >= 1):
            raise ValueError(f"q_lora_rank must be a positive integer or null, "
                             f"got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Elements cached per token and layer: [kv_c_normed ‖ roped k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeConfig:
    """DeepSeek-V3 mixture of experts (router: workers/models/moe.py `route`).

    Layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0 (the DeepSeek
    reference code; transformers has no moe_layer_freq and every checkpoint sets 1), else a
    dense SwiGLU MLP of `intermediate_size`. Each routed expert and each of the
    n_shared_experts (fused into one MLP) has width moe_intermediate_size.
    Router: scores = scoring_func(logits); noaux_tc chooses with scores +
    e_score_correction_bias among the topk_group best of n_group groups (a group scores the
    sum of its top two), greedy with the plain top-k of the scores; the weights are the
    chosen scores, normalized when norm_topk_prob, times routed_scaling_factor.
    """

    num_routed_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool

    def __post_init__(self) -> None:
        positive = ("num_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "moe_layer_freq", "n_group", "topk_group")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor must be positive, "
                             f"got {self.routed_scaling_factor!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; "
                             f"supported: {', '.join(SCORING_FUNCS)}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; "
                             f"supported: {', '.join(TOPK_METHODS)}")
        if self.num_experts_per_tok > self.num_routed_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                             f"n_routed_experts ({self.num_routed_experts})")
        if self.topk_method == "noaux_tc":
            self._check_groups()

    def _check_groups(self) -> None:
        if self.num_routed_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts "
                             f"({self.num_routed_experts})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        per_group = self.num_routed_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(f"n_group {self.n_group} leaves {per_group} expert per group; a "
                             f"group scores the sum of its top two")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the "
                             f"experts of topk_group ({self.topk_group}) groups")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


def language_model_config(raw: dict[str, Any], where: Path) -> tuple[dict[str, Any], str]:
    """(the served model's config, the prefix of its tensor names): the wrapper's
    text_config and its prefix for Kimi-K2.5, else `raw` itself and ""."""
    prefix = WRAPPER_PREFIXES.get(str(raw.get("model_type")))
    if prefix is None:
        return raw, ""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{where}: model_type {raw['model_type']!r} needs a text_config object")
    inner = {k: raw[k] for k in INHERITED_KEYS if k in raw} | text
    if not inner.get("architectures"):
        if inner.get("model_type", "deepseek_v3") not in MLA_MODEL_TYPES:
            raise ValueError(f"{where}: text_config.model_type {inner.get('model_type')!r} is "
                             f"not supported; supported: {', '.join(MLA_MODEL_TYPES)}")
        inner["architectures"] = [MLA_ARCHITECTURE]
    if inner["architectures"][0] != MLA_ARCHITECTURE:
        raise ValueError(f"{where}: text_config.architectures {inner['architectures']!r} is "
                         f"not supported in a {raw['model_type']} model (only {MLA_ARCHITECTURE})")
    return inner, prefix


def parse_mla(raw: dict[str, Any], where: Path) -> MlaConfig:
    model_type = raw.get("model_type", "deepseek_v3")
    if model_type not in MLA_MODEL_TYPES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported for "
                         f"{MLA_ARCHITECTURE}; supported: {', '.join(MLA_MODEL_TYPES)}")
    v = _values(raw, ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                      "v_head_dim", "attention_bias", "rope_interleave"))
    try:
        return MlaConfig(q_lora_rank=v["q_lora_rank"], kv_lora_rank=v["kv_lora_rank"],
                         qk_nope_head_dim=v["qk_nope_head_dim"],
                         qk_rope_head_dim=v["qk_rope_head_dim"], v_head_dim=v["v_head_dim"],
                         attention_bias=bool(v["attention_bias"]),
                         rope_interleave=bool(v["rope_interleave"]))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def parse_moe(raw: dict[str, Any], where: Path) -> MoeConfig:
    v = _values(raw, ("n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                      "moe_intermediate_size", "first_k_dense_replace", "moe_layer_freq",
                      "routed_scaling_factor", "scoring_func", "topk_method", "n_group",
                      "topk_group", "norm_topk_prob"))
    try:
        return MoeConfig(
            num_routed_experts=v["n_routed_experts"], num_experts_per_tok=v["num_experts_per_tok"],
            num_shared_experts=v["n_shared_experts"] or 0,
            moe_intermediate_size=v["moe_intermediate_size"],
            first_k_dense_replace=v["first_k_dense_replace"] or 0,
            moe_layer_freq=v["moe_layer_freq"],
            routed_scaling_factor=float(v["routed_scaling_factor"]),
            scoring_func=v["scoring_func"], topk_method=v["topk_method"],
            # transformers treats a null group count as one group.
            n_group=v["n_group"] or 1, topk_group=v["topk_group"] or 1,
            norm_topk_prob=bool(v["norm_topk_prob"]))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def num_mtp_layers(raw: dict[str, Any]) -> int:
    """Multi-token-prediction layers stored after the last decoder layer (DeepSeek-V3's
    `model.layers.61`): not part of the causal LM, not served (transformers ignores them)."""
    value = raw.get("num_nextn_predict_layers", DEFAULTS["num_nextn_predict_layers"])
    return int(value or 0)


def _values(raw: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """raw's value of each key, transformers' default where the key is absent."""
    return {k: raw[k] if k in raw else DEFAULTS[k] for k in keys}
