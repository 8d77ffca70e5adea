"""The mixture of experts against transformers: the router (DeepseekV3TopkRouter for
noaux_tc, DeepseekV2TopkRouter for greedy softmax), the grouped experts (DeepseekV3Experts)
and the whole MoE block (DeepseekV3MoE), on random inputs in float32.

Tolerance: the router's ids must be equal as sets per token and its weights equal to 1e-6
(the same float32 operations, in the same order); the experts and the MoE block sum the
same products in a different order (sorted by expert, float32 accumulation), ~1e-7 on
outputs of ~1: atol 1e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specd.workers.models import moe as moe_module
from specd.workers.models.deepseek_config import MoeConfig
from specd.workers.models.moe import ExpertWeights, MoE, expert_target, experts_forward, route

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402

HIDDEN, EXPERTS, INTER = 32, 8, 16


def moe_config(**change: object) -> MoeConfig:
    fields: dict[str, object] = dict(
        num_routed_experts=EXPERTS, num_experts_per_tok=2, num_shared_experts=1,
        moe_intermediate_size=INTER, first_k_dense_replace=1, moe_layer_freq=1,
        routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
        topk_group=2, norm_topk_prob=True)
    return MoeConfig(**(fields | change))


def hf_config(cfg: MoeConfig) -> Any:
    return transformers.DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=cfg.num_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, n_group=cfg.n_group,
        topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor, moe_intermediate_size=INTER,
        n_shared_experts=cfg.num_shared_experts)


def hf_router(cfg: MoeConfig, bias: torch.Tensor, g: torch.Generator) -> Any:
    router = hf_v3.DeepseekV3TopkRouter(hf_config(cfg))
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.5)
        router.e_score_correction_bias.copy_(bias)
    return router


def assert_same_routing(got: tuple[torch.Tensor, torch.Tensor],
                        expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Same experts and weights per token, in any slot order (both use unsorted top-k)."""
    ids, weights = got
    hf_ids, hf_weights = expected
    order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("change", [
    {},  # 4 groups, the best 2 kept
    {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827},  # Kimi-K2
    {"norm_topk_prob": False, "num_experts_per_tok": 3},
    {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 4},
])
def test_noaux_router_matches_transformers(change: dict[str, object]) -> None:
    cfg = moe_config(**change)
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(EXPERTS, generator=g) * 0.3
    router = hf_router(cfg, bias, g)
    x = torch.randn(64, HIDDEN, generator=g)
    _, hf_weights, hf_ids = router(x)
    logits = x @ router.weight.T
    assert_same_routing(route(logits, bias, cfg), (hf_ids, hf_weights))


def test_dropped_groups_are_masked_with_minus_infinity_as_transformers() -> None:
    """With a negative correction bias every kept choice score is negative; masking the
    dropped groups with 0 (DeepSeek's reference code, SGLang) would choose a dropped
    expert. transformers masks with -inf and so does specd: the chosen experts all lie in
    the kept groups, and equal transformers'."""
    cfg = moe_config(n_group=4, topk_group=2)
    g = torch.Generator().manual_seed(1)
    bias = -2.0 - torch.rand(EXPERTS, generator=g)  # sigmoid + bias < -1 everywhere
    router = hf_router(cfg, bias, g)
    x = torch.randn(32, HIDDEN, generator=g)
    _, hf_weights, hf_ids = router(x)
    logits = x @ router.weight.T
    ids, weights = route(logits, bias, cfg)
    assert_same_routing((ids, weights), (hf_ids, hf_weights))
    # What 0-masking would choose differs from transformers on these inputs.
    choice = (logits.sigmoid() + bias).view(32, 4, 2)
    best_groups = choice.topk(2, dim=-1)[0].sum(-1).topk(2, dim=-1)[1]
    kept = torch.zeros(32, 4, dtype=torch.bool).scatter_(1, best_groups, True)
    zero_masked = choice.masked_fill(~kept[:, :, None], 0.0).view(32, EXPERTS)
    zero_ids = zero_masked.topk(2, dim=-1)[1]
    assert not torch.equal(zero_ids.sort(dim=-1)[0], ids.sort(dim=-1)[0])
    assert kept.view(32, 4, 1).expand(32, 4, 2).reshape(32, EXPERTS).gather(1, ids).all()


def test_greedy_softmax_router_matches_transformers_v2() -> None:
    cfg = moe_config(scoring_func="softmax", topk_method="greedy", norm_topk_prob=False,
                     routed_scaling_factor=1.5, num_experts_per_tok=3)
    hf_cfg = transformers.DeepseekV2Config(
        hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=3,
        topk_method="greedy", routed_scaling_factor=1.5)
    router = hf_v2.DeepseekV2TopkRouter(hf_cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
    x = torch.randn(40, HIDDEN, generator=g)
    _, hf_weights, hf_ids = router(x)
    assert_same_routing(route(x @ router.weight.T, None, cfg), (hf_ids, hf_weights))


def test_noaux_needs_the_correction_bias() -> None:
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        route(torch.zeros(2, EXPERTS), None, moe_config())


def random_experts(g: torch.Generator) -> ExpertWeights:
    return ExpertWeights(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.3,
                         torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.3)


def test_experts_forward_matches_transformers() -> None:
    g = torch.Generator().manual_seed(3)
    weights = random_experts(g)
    experts = hf_v3.DeepseekV3Experts(hf_config(moe_config()))
    with torch.no_grad():
        experts.gate_up_proj.copy_(weights.w13)
        experts.down_proj.copy_(weights.w2)
    x = torch.randn(37, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:3] for _ in range(37)])
    ids[:5] = 6  # some tokens send every slot to one expert; expert 7 may get none
    topk_weights = torch.rand(37, 3, generator=g)
    with torch.no_grad():
        expected = experts(x, ids, topk_weights)
    torch.testing.assert_close(experts_forward(x, ids, topk_weights, weights), expected,
                               atol=1e-5, rtol=0)


def test_experts_forward_runs_each_used_expert_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One gate/up and one down matmul per expert that received pairs, over all its rows
    (no loop over tokens), and the same result as the per-token sum."""
    rows: list[int] = []
    functional = torch.nn.functional

    class CountingF:
        silu = staticmethod(functional.silu)

        @staticmethod
        def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            rows.append(x.shape[0])
            return functional.linear(x, w)

    monkeypatch.setattr(moe_module, "F", CountingF)
    g = torch.Generator().manual_seed(4)
    weights = random_experts(g)
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [3, 0]])
    x = torch.randn(4, HIDDEN, generator=g)
    out = experts_forward(x, ids, torch.ones(4, 2), weights)
    assert rows == [3, 3, 3, 3, 2, 2]  # experts 0, 3, 5: (gate/up, down) each
    manual = torch.zeros(4, HIDDEN)
    for t in range(4):
        for e in ids[t].tolist():
            gate, up = (x[t] @ weights.w13[e].T).chunk(2)
            manual[t] += (functional.silu(gate) * up) @ weights.w2[e].T
    torch.testing.assert_close(out, manual, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shared", [1, 2])
def test_moe_block_matches_transformers(shared: int) -> None:
    cfg = moe_config(num_shared_experts=shared)
    torch.manual_seed(5)
    hf = hf_v3.DeepseekV3MoE(hf_config(cfg))
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        hf.gate.e_score_correction_bias.copy_(torch.randn(EXPERTS) * 0.2)
    ours = MoE(cfg, HIDDEN, "mlp", lambda i, o, b, n: torch.nn.Linear(i, o, bias=b))
    shared_mlp = ours.shared_experts
    assert shared_mlp is not None
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        assert ours.gate.e_score_correction_bias is not None
        ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        ours.experts.w13.copy_(hf.experts.gate_up_proj)
        ours.experts.w2.copy_(hf.experts.down_proj)
        shared_mlp.gate_up_proj.weight.copy_(torch.cat([hf.shared_experts.gate_proj.weight,
                                                        hf.shared_experts.up_proj.weight]))
        shared_mlp.down_proj.weight.copy_(hf.shared_experts.down_proj.weight)
        x = torch.randn(2, 11, HIDDEN)
        expected = hf(x)
        got = ours(x.view(-1, HIDDEN)).view(2, 11, HIDDEN)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_router_stays_float32_when_the_model_is_cast() -> None:
    moe = MoE(moe_config(), HIDDEN, "mlp", lambda i, o, b, n: torch.nn.Linear(i, o, bias=b))
    moe.to(torch.bfloat16)
    assert moe.gate.weight.dtype == torch.float32
    assert moe.gate.e_score_correction_bias is not None
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.w13.dtype == torch.bfloat16
    ids, weights = moe.gate(torch.randn(3, HIDDEN, dtype=torch.bfloat16))
    assert weights.dtype == torch.float32 and ids.shape == (3, 2)


def test_expert_checkpoint_names_map_to_stacked_shards() -> None:
    prefix = "model.layers.4.mlp.experts"
    assert expert_target(f"{prefix}.7.gate_proj.weight") == (f"{prefix}.w13", 14)
    assert expert_target(f"{prefix}.7.up_proj.weight") == (f"{prefix}.w13", 15)
    assert expert_target(f"{prefix}.7.down_proj.weight") == (f"{prefix}.w2", 7)
    assert expert_target("model.layers.4.mlp.shared_experts.gate_proj.weight") is None


def test_int4_expert_checkpoint_names_map_to_stacked_shards() -> None:
    prefix = "model.layers.4.mlp.experts"
    assert expert_target(f"{prefix}.7.up_proj.weight_packed") == (f"{prefix}.w13_packed", 15)
    assert expert_target(f"{prefix}.7.gate_proj.weight_zero_point") == (
        f"{prefix}.w13_zero_point", 14)
    assert expert_target(f"{prefix}.7.down_proj.weight_shape") == (f"{prefix}.w2_shape", 7)
    assert expert_target(f"{prefix}.7.down_proj.weight_g_idx") is None  # refused by the loader


# ----------------------------------------------------------------------------- INT4 experts

KIMI_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*")


def _dense(i: int, o: int, b: bool, n: tuple[str, ...]) -> torch.nn.Module:
    return torch.nn.Linear(i, o, bias=b)


def test_experts_are_int4_exactly_when_the_quantization_config_quantizes_them() -> None:
    from specd.workers.models.moe import RoutedExperts, build_routed_experts
    from specd.workers.models.moe_int4 import Int4RoutedExperts
    from specd.workers.models.quant_config import QuantConfig
    from specd.workers.models.quantization import make_linear_factory

    cfg = moe_config(moe_intermediate_size=32)
    kimi = make_linear_factory(QuantConfig(group_size=32, ignore=KIMI_IGNORE), _dense)
    assert isinstance(build_routed_experts(cfg, HIDDEN, "m.experts", _dense), RoutedExperts)
    int4 = build_routed_experts(cfg, HIDDEN, "m.experts", kimi)
    assert isinstance(int4, Int4RoutedExperts) and int4.w13_zero_point is None
    ignored = make_linear_factory(QuantConfig(group_size=32, ignore=("re:.*experts.*",)), _dense)
    assert isinstance(build_routed_experts(cfg, HIDDEN, "m.experts", ignored), RoutedExperts)
    mixed = make_linear_factory(QuantConfig(group_size=32, ignore=("m.experts.3.down_proj",)),
                                _dense)
    with pytest.raises(ValueError, match="quantizes m.experts.0.gate_proj but not "
                                         "m.experts.3.down_proj"):
        build_routed_experts(cfg, HIDDEN, "m.experts", mixed)
    asym = make_linear_factory(QuantConfig(group_size=None, symmetric=False), _dense)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(12\) to be a multiple of 8"):
        build_routed_experts(moe_config(moe_intermediate_size=12), HIDDEN, "m.experts", asym)
    with pytest.raises(ValueError, match="group_size 32 does not divide moe_intermediate_size"):
        build_routed_experts(moe_config(moe_intermediate_size=48), HIDDEN, "m.experts", kimi)


def test_int4_experts_load_per_expert_tensors_and_compute_their_dequantized_swiglu() -> None:
    """Each expert's gate/up/down compressed by compressed-tensors' compressor and loaded
    tensor by tensor: the INT4 experts compute what dense experts holding compressed-tensors'
    decompression (fp32 scales: exact) compute."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from specd.workers.models.moe_int4 import Int4RoutedExperts
    from specd.workers.models.quantization import quantize_rtn

    inter = 32
    gen = torch.Generator().manual_seed(5)
    scheme = QuantizationScheme(targets=["Linear"], format="pack-quantized", weights=(
        QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                         group_size=32)))
    experts = Int4RoutedExperts(EXPERTS, HIDDEN, inter, "m.experts", 32, True).float()
    w13 = torch.empty(EXPERTS, 2 * inter, HIDDEN)
    w2 = torch.empty(EXPERTS, HIDDEN, inter)
    for e in range(EXPERTS):
        for proj, shape, dest in (("gate", (inter, HIDDEN), w13[e, :inter]),
                                  ("up", (inter, HIDDEN), w13[e, inter:]),
                                  ("down", (HIDDEN, inter), w2[e])):
            weight = torch.randn(*shape, generator=gen)
            scale = quantize_rtn(weight, 32)[1]
            compressed = PackedQuantizationCompressor.compress(
                {"weight": weight, "weight_scale": scale}, scheme)
            dest.copy_(PackedQuantizationCompressor.decompress(
                {**compressed, "weight_scale": scale.float()}, scheme)["weight"])
            for kind, tensor in compressed.items():
                name, shard = expert_target(f"m.experts.{e}.{proj}_proj.{kind}") or ("", 0)
                experts.load_shard(name.rpartition(".")[2], shard, tensor)
    x = torch.randn(9, HIDDEN, generator=gen)
    ids = torch.randint(EXPERTS, (9, 2), generator=gen)
    weights = torch.rand(9, 2, generator=gen)
    torch.testing.assert_close(experts_forward(x, ids, weights, experts.weights()),
                               experts_forward(x, ids, weights, ExpertWeights(w13, w2)),
                               atol=1e-5, rtol=0)


def test_int4_experts_refuse_tensors_that_do_not_fit_naming_them() -> None:
    from specd.workers.models.moe_int4 import Int4RoutedExperts

    experts = Int4RoutedExperts(EXPERTS, HIDDEN, 32, "m.experts", 32, True)
    with pytest.raises(ValueError, match=r"m.experts.2.up_proj.weight_shape is \[32, 64\], "
                                         r"expected \[32, 32\]"):
        experts.load_shard("w13_shape", 5, torch.tensor([32, 64]))
    with pytest.raises(ValueError, match="m.experts.1.down_proj.weight_packed must be int32"):
        experts.load_shard("w2_packed", 1, torch.zeros(HIDDEN, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"m.experts.0.gate_proj.weight_scale has shape \[32, 2\]"):
        experts.load_shard("w13_scale", 0, torch.zeros(32, 2))
