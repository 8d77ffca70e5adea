"""DeepSeek-V3 / Kimi-K2 configuration and rope: what is read, what is refused, and YaRN
against transformers' own functions (`_compute_yarn_parameters`, DeepseekV3Attention's
softmax scale, `apply_rotary_pos_emb_interleave`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from specd.workers.models.config import ModelConfig, RopeScaling
from specd.workers.models.deepseek_config import MlaConfig, MoeConfig
from specd.workers.models.layers import RotaryEmbedding
from specd.workers.models.rope import apply_rotary_interleaved, mla_softmax_scale, yarn_parameters

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import _compute_yarn_parameters  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

CPU = torch.device("cpu")
# A small DeepSeek-V3 as config.json carries it (the legacy rope_scaling layout, as the
# published DeepSeek-V3 and Kimi-K2 configs).
DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4,
    "num_key_value_heads": 4, "intermediate_size": 96, "moe_intermediate_size": 32,
    "vocab_size": 97, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 4, "topk_group": 2,
    "norm_topk_prob": True, "rope_theta": 10000.0, "num_nextn_predict_layers": 1,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "eos_token_id": 1,
}


def parse(tmp_path: Path, config: dict[str, Any]) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelConfig.from_dir(tmp_path)


def test_deepseek_fields(tmp_path: Path) -> None:
    cfg = parse(tmp_path, DEEPSEEK)
    assert cfg.architecture == "DeepseekV3ForCausalLM"
    assert cfg.mla == MlaConfig(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                                qk_rope_head_dim=8, v_head_dim=16, attention_bias=False,
                                rope_interleave=True)
    assert cfg.moe == MoeConfig(
        num_routed_experts=8, num_experts_per_tok=2, num_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1, moe_layer_freq=1,
        routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
        topk_group=2, norm_topk_prob=True)
    assert cfg.rope_scaling == RopeScaling("yarn", 40.0, original_max_position_embeddings=4096,
                                           mscale=1.0, mscale_all_dim=1.0)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 4, 24)  # kv heads nominal
    assert (cfg.weight_prefix, cfg.num_mtp_layers, cfg.eos_token_ids) == ("", 1, (1,))


def test_kv_elements_per_token_is_layers_times_latent(tmp_path: Path) -> None:
    cfg = parse(tmp_path, DEEPSEEK)
    assert cfg.kv_elements_per_token == 5 * (32 + 8)
    assert cfg.kv_layer_shape(10, 16) == (10, 16, 40)
    # The published Kimi-K2 / DeepSeek-V3 shapes: 61 layers of 512 + 64 (note 2.6).
    assert parse(tmp_path, DEEPSEEK | {"num_hidden_layers": 61, "kv_lora_rank": 512,
                                       "qk_rope_head_dim": 64}).kv_elements_per_token == 35136


def test_dense_kv_elements_are_k_and_v(tmp_path: Path) -> None:
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
             "vocab_size": 97, "max_position_embeddings": 64}
    cfg = parse(tmp_path, llama)
    assert (cfg.mla, cfg.moe) == (None, None)
    assert cfg.kv_elements_per_token == 2 * 3 * 2 * 16
    assert cfg.kv_layer_shape(10, 16) == (2, 10, 16, 2, 16)


def test_transformers_defaults_fill_absent_fields(tmp_path: Path) -> None:
    absent = ("scoring_func", "topk_method", "moe_layer_freq", "norm_topk_prob",
              "num_nextn_predict_layers")
    cfg = parse(tmp_path, {k: v for k, v in DEEPSEEK.items() if k not in absent})
    assert cfg.moe is not None and cfg.moe.scoring_func == "sigmoid"
    assert (cfg.moe.topk_method, cfg.moe.moe_layer_freq) == ("noaux_tc", 1)
    assert cfg.moe.norm_topk_prob and cfg.num_mtp_layers == 1


def test_null_q_lora_rank_and_kimi_model_type(tmp_path: Path) -> None:
    cfg = parse(tmp_path, DEEPSEEK | {"model_type": "kimi_k2", "q_lora_rank": None,
                                      "n_group": 1, "topk_group": 1})
    assert cfg.mla is not None and cfg.mla.q_lora_rank is None
    assert cfg.moe is not None and (cfg.moe.n_group, cfg.moe.topk_group) == (1, 1)


def test_moe_layers_follow_first_k_dense_and_freq() -> None:
    moe = MoeConfig(8, 2, 1, 32, first_k_dense_replace=1, moe_layer_freq=2,
                    routed_scaling_factor=1.0, scoring_func="softmax", topk_method="greedy",
                    n_group=1, topk_group=1, norm_topk_prob=False)
    assert [moe.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]


def test_kimi_k25_wrapper_serves_its_language_model(tmp_path: Path) -> None:
    text = {k: v for k, v in DEEPSEEK.items() if k not in ("architectures", "eos_token_id")}
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text | {"model_type": "kimi_k2"}, "vision_config": {},
               "eos_token_id": 163585}
    cfg = parse(tmp_path, wrapper)
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.weight_prefix == "language_model."
    assert cfg.eos_token_ids == (163585,) and cfg.mla is not None


@pytest.mark.parametrize(("change", "message"), [
    ({"scoring_func": "sqrtsoftplus"}, "scoring_func 'sqrtsoftplus' is not supported"),
    ({"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy'"),
    ({"model_type": "deepseek_v32"}, "model_type 'deepseek_v32' is not supported"),
    ({"n_group": 3}, r"n_group \(3\) must divide n_routed_experts \(8\)"),
    ({"topk_group": 5}, r"topk_group \(5\) exceeds n_group \(4\)"),
    ({"num_experts_per_tok": 6, "topk_group": 1}, "exceeds the experts of topk_group"),
    ({"n_group": 8, "topk_group": 2}, "leaves 1 expert per group"),
    ({"q_lora_rank": 0}, "q_lora_rank must be a positive integer or null"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor must be positive"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}},
     "unsupported rope type 'llama3'; supported: default, yarn"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}},
     "yarn rope scaling key 'low_freq_factor' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_unimplemented_values_are_refused_by_name(tmp_path: Path, change: dict[str, Any],
                                                  message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(tmp_path, DEEPSEEK | change)


def test_wrapper_of_another_language_model_is_refused(tmp_path: Path) -> None:
    wrapper = {"model_type": "kimi_k25", "text_config": {"architectures": ["LlamaForCausalLM"]}}
    with pytest.raises(ValueError, match="text_config.architectures.*only DeepseekV3ForCausalLM"):
        parse(tmp_path, wrapper)


# ----------------------------------------------------------------------------- YaRN

YARN_CASES = {
    # DeepSeek-V3's published values.
    "deepseek": {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    # mscale != mscale_all_dim: cos/sin scaled by their ratio, the softmax by mscale_all_dim's.
    "mscale-ratio": {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
    # Kimi-K2: beta_fast == beta_slow collapses the ramp (transformers' +0.001).
    "kimi": {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    # Qwen-style: no mscale at all (cos/sin scaled by mscale(factor)), untruncated range.
    "qwen": {"factor": 4.0, "original_max_position_embeddings": 128, "truncate": False},
    "attention-factor": {"factor": 4.0, "original_max_position_embeddings": 128,
                         "attention_factor": 1.25, "beta_fast": 16, "beta_slow": 2},
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_matches_transformers(tmp_path: Path, case: str) -> None:
    rope = {"rope_type": "yarn", "rope_theta": 50000.0} | YARN_CASES[case]
    hf = transformers.DeepseekV3Config(
        **{k: v for k, v in DEEPSEEK.items() if k in transformers.DeepseekV3Config.__annotations__
           and k not in ("rope_scaling", "rope_theta")}, rope_parameters=dict(rope))
    expected_inv_freq, expected_factor = _compute_yarn_parameters(hf)
    cfg = parse(tmp_path, json.loads(hf.to_json_string()) | {"architectures": DEEPSEEK[
        "architectures"]})
    assert cfg.rope_scaling is not None and cfg.mla is not None
    inv_freq, factor = yarn_parameters(cfg.mla.qk_rope_head_dim, cfg.rope_theta,
                                       cfg.rope_scaling, CPU)
    assert torch.equal(inv_freq, expected_inv_freq)
    assert factor == expected_factor
    attention = hf_ds.DeepseekV3Attention(hf, layer_idx=0)
    assert mla_softmax_scale(cfg.mla.qk_head_dim, cfg.rope_scaling) == attention.scaling


def test_published_softmax_scales() -> None:
    """Note 1.3: 192^-0.5 * mscale(factor, 1)^2 for factors 32, 64, 40."""
    for factor, expected in ((32, 0.13086), (64, 0.14468), (40, 0.13523)):
        scaling = RopeScaling("yarn", float(factor), mscale=1.0, mscale_all_dim=1.0)
        assert mla_softmax_scale(192, scaling) == pytest.approx(expected, abs=5e-6)
    assert mla_softmax_scale(192, None) == 192 ** -0.5
    assert math.isclose(mla_softmax_scale(192, RopeScaling("yarn", 40.0)), 192 ** -0.5)


def test_dense_rotary_applies_yarn_cos_sin_scaling() -> None:
    """The dense rotary embedding takes YaRN's frequencies and multiplies cos/sin by the
    attention factor, as transformers' rotary embeddings do."""
    scaling = RopeScaling("yarn", 4.0, original_max_position_embeddings=128)
    rotary = RotaryEmbedding(32, 10000.0, scaling, CPU)
    inv_freq, factor = yarn_parameters(32, 10000.0, scaling, CPU)
    positions = torch.tensor([0, 5, 300])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    freqs = positions.float()[:, None] * inv_freq
    assert factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    torch.testing.assert_close(cos[:, 0], freqs.cos() * factor, rtol=0, atol=0)
    torch.testing.assert_close(sin[:, 0], freqs.sin() * factor, rtol=0, atol=0)


def test_interleaved_rotary_matches_transformers() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 3, 8, generator=g), torch.randn(5, 1, 8, generator=g)
    freqs = torch.rand(5, 4, generator=g) * 3  # [N, d / 2]
    cos, sin = freqs.cos(), freqs.sin()
    emb_cos, emb_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # transformers'
    # transformers works on [batch, heads, seq, d] with cos/sin [batch, seq, d].
    hf_q, hf_k = hf_ds.apply_rotary_pos_emb_interleave(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb_cos[None], emb_sin[None])
    assert torch.equal(apply_rotary_interleaved(q, cos[:, None], sin[:, None]),
                       hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary_interleaved(k, cos[:, None], sin[:, None]),
                       hf_k[0].transpose(0, 1))
