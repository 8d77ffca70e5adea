"""`specctl plan` (workers/plan/deployment.py, workers/plan/weights.py, daemon/ctl/plan.py).

Oracles: the tensors the engine actually builds and loads (parameters and buffers of the
target and the EAGLE-3 head, each storage counted once; the KV tensors it allocates), a
Kimi-K2-shaped model built on the meta device (every parameter's bytes without memory), and
per-GPU figures for Kimi-K2 INT4 on 8 H200s worked out by hand from its published config.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file
from torch import nn

import specd
from specd.daemon.ctl.cli import cli
from specd.workers.config import FIXTURE_DIR, FIXTURE_MOE_DIR, FIXTURES
from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import PackedLinear, TransposedLinear, dense_linear
from specd.workers.models.linear_factory import linear_factory
from specd.workers.models.loader import load_model
from specd.workers.models.quantization import linear_factory_for
from specd.workers.models.registry import MODEL_CLASSES, build_meta_model
from specd.workers.parallel.context import ParallelContext
from specd.workers.parallel.sharding import shard_model_config
from specd.workers.plan.deployment import Plan, PlanOptions, make_plan
from specd.workers.runner.kv_cache import allocate_kv_cache
from specd.workers.spec.draft_model import load_draft_head

GIB = 2**30
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
KIMI_QUANTIZATION: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32, "dynamic": False, "actorder": None}}},
    "ignore": KIMI_IGNORE,
}
# Kimi-K2's published config.json values (K2-Instruct's rope: yarn, factor 32).
KIMI_K2: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
    "hidden_size": 7168, "num_hidden_layers": 61, "first_k_dense_replace": 1,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.827, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "moe_layer_freq": 1, "num_attention_heads": 64,
    "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 163840, "max_position_embeddings": 131072, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
    "bos_token_id": 163584, "eos_token_id": 163585, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "attention_bias": False,
    "quantization_config": KIMI_QUANTIZATION,
}


def _write_config(root: Path, config: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture()
def kimi_dir(tmp_path: Path) -> Path:
    return _write_config(tmp_path / "kimi-k2", KIMI_K2)


def _storage_bytes(*modules: nn.Module, exclude: set[int] | None = None) -> int:
    """Bytes of every parameter and buffer, each storage once (a shared one counts once); a
    weight the CPU backend packed for oneDNN (an opaque tensor, no storage) counts what was
    loaded into it: its elements."""
    seen = set(exclude or ())
    total = 0
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_mkldnn:
                total += t.numel() * t.element_size()
            elif t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def _ptrs(module: nn.Module) -> set[int]:
    return {t.data_ptr() for t in [*module.parameters(), *module.buffers()] if not t.is_mkldnn}


def _weight_bytes(linear: nn.Module) -> int:
    """A dense linear's weight bytes, packed (PackedLinear), transposed or neither."""
    if isinstance(linear, PackedLinear):
        weight = linear.packed_weight
    else:
        assert isinstance(linear, (nn.Linear, TransposedLinear))
        weight = linear.weight
    return weight.numel() * weight.element_size()


def _plan(fixture: str, **options: Any) -> Plan:
    """The plan of an embedded model with its own head, on 1 GiB GPUs."""
    model_dir, draft_dir = FIXTURES[fixture]
    return make_plan(model_dir, draft_dir, PlanOptions(gpu_memory_bytes=GIB, **options))


def _part(plan: Plan, kind: str) -> int:
    return sum(p.bytes for p in plan.parts if p.kind.startswith(kind + " ("))


def _run(*args: str) -> Result:
    return CliRunner().invoke(cli, ["plan", *args])


# ---- N = 1 against the engine ---------------------------------------------------------


@pytest.mark.parametrize("model", ["fixture", "fixture-moe"])
def test_plan_weights_and_kv_equal_what_the_engine_loads_and_allocates(model: str) -> None:
    engine = specd.Engine(model, dtype="float32")
    runner, worker = engine.core.runner, engine.core.worker
    plan = _plan(model, dtype="float32")

    target = runner.model
    head_bytes = _storage_bytes(worker.head, exclude=_ptrs(target))
    assert plan.weight_bytes == _storage_bytes(target) + head_bytes
    assert _part(plan, "draft head") == head_bytes
    assert _part(plan, "embedding") == target.model.embed_tokens.weight.nbytes
    assert _part(plan, "lm_head") == _weight_bytes(target.lm_head)
    tokens = runner.num_kv_blocks * engine.config.block_size
    assert plan.kv_bytes_per_token * tokens == sum(t.nbytes for t in runner.kv_caches)
    assert plan.draft_kv_bytes_per_token * tokens == worker.draft_kv.nbytes
    if model == "fixture-moe":
        layers = target.model.layers
        moe_layers = [layer.mlp for layer in layers if hasattr(layer.mlp, "experts")]
        assert _part(plan, "routed experts") == sum(_storage_bytes(m.experts) for m in moe_layers)
        assert _part(plan, "router") == sum(_storage_bytes(m.gate) for m in moe_layers)
        assert _part(plan, "absorbed W_UK/W_UV") == sum(
            a.w_uk.nbytes + a.w_uv.nbytes for a in (layer.self_attn for layer in layers))


def test_bfloat16_plan_keeps_the_router_in_float32_as_the_loader_does() -> None:
    cfg = ModelConfig.from_dir(FIXTURE_MOE_DIR)
    target = load_model(cfg, torch.device("cpu"), torch.bfloat16)
    head = load_draft_head(FIXTURES["fixture-moe"][1], target.model.embed_tokens.weight,
                           dtype=torch.bfloat16)
    plan = _plan("fixture-moe", dtype="bfloat16")

    assert plan.weight_bytes == _storage_bytes(target, head)
    router = [p for p in plan.parts if p.kind.startswith("router")]
    assert [p.kind for p in router] == ["router (float32)"]
    assert router[0].bytes == sum(_storage_bytes(layer.mlp.gate) for layer in
                                  target.model.layers if hasattr(layer.mlp, "gate"))


@pytest.fixture(scope="module")
def int4_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense fixture quantized by tools/quantize.py: INT4 decoder linears (group 32) but
    down_proj, whose 688 inputs are not whole groups, and lm_head, kept bf16."""
    from tools import quantize as quantize_tool

    dst = tmp_path_factory.mktemp("int4") / "fixture-int4"
    assert quantize_tool.main([str(FIXTURE_DIR), str(dst), "--group-size", "32",
                              "--ignore", "re:.*down_proj"]) == 0
    return dst


def test_int4_plan_equals_the_int4_linears_the_loader_builds(int4_fixture: Path) -> None:
    cfg = ModelConfig.from_dir(int4_fixture)
    factory = linear_factory_for(cfg.quantization_config, dense_linear)
    target = load_model(cfg, torch.device("cpu"), torch.bfloat16, factory)
    plan = make_plan(int4_fixture, None, PlanOptions(gpu_memory_bytes=GIB))

    assert plan.weight_bytes == _storage_bytes(target)
    assert [p.kind for p in plan.parts if "INT4" in p.kind] == ["attention (INT4)",
                                                                 "MLP (INT4 + bfloat16)"]
    assert _part(plan, "lm_head") == _weight_bytes(target.lm_head)  # ignored: stays bf16


@pytest.fixture(scope="module")
def int4_moe_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MoE fixture quantized by tools/quantize.py's MoE recipe (Kimi's layout: routed
    experts INT4, group 32, symmetric; the rest bf16)."""
    from tools import quantize as quantize_tool

    dst = tmp_path_factory.mktemp("int4-moe") / "fixture-moe-int4"
    assert quantize_tool.main([str(FIXTURE_MOE_DIR), str(dst), "--recipe", "moe"]) == 0
    return dst


def _assert_plan_equals_loaded(model_dir: Path, num_moe_layers: int) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    factory = linear_factory_for(cfg.quantization_config, dense_linear)
    target = load_model(cfg, torch.device("cpu"), torch.bfloat16, factory)
    plan = make_plan(model_dir, None, PlanOptions(gpu_memory_bytes=GIB))
    layers = [layer.mlp.experts for layer in target.model.layers
              if hasattr(layer.mlp, "experts")]
    assert [p.kind for p in plan.parts if "INT4" in p.kind] == ["routed experts (INT4)"]
    assert _part(plan, "routed experts") == _storage_bytes(*layers)
    assert plan.weight_bytes == _storage_bytes(target)
    assert len(layers) == num_moe_layers


def test_int4_moe_plan_equals_the_int4_experts_the_loader_builds(
        int4_moe_fixture: Path) -> None:
    _assert_plan_equals_loaded(int4_moe_fixture, 3)


@pytest.mark.parametrize("group_size", [32, None], ids=["group32", "channel"])
def test_asymmetric_int4_experts_count_their_zero_points(group_size: int | None,
                                                         tmp_path: Path) -> None:
    """Checkpoints written by compressed-tensors' own compressor (zero points packed along
    the output rows; channel-wise: one scale per row)."""
    pytest.importorskip("compressed_tensors")
    from tests.integration.ct_asymmetric import ct_scheme, write_checkpoint

    expert = re.compile(r".*\.experts\.\d+\.(gate|up|down)_proj$")
    write_checkpoint(FIXTURE_MOE_DIR, tmp_path / "int4", ct_scheme(group_size, False),
                     KIMI_IGNORE, lambda m: expert.match(m) is not None)
    _assert_plan_equals_loaded(tmp_path / "int4", 3)


# ---- the full Kimi-K2 shape -------------------------------------------------------------


def test_unquantized_kimi_k2_plan_equals_the_model_built_on_the_meta_device(
        tmp_path: Path) -> None:
    config = {k: v for k, v in KIMI_K2.items() if k != "quantization_config"}
    model_dir = _write_config(tmp_path / "kimi-bf16", config)
    model = build_meta_model(ModelConfig.from_dir(model_dir), torch.device("cpu"))
    model.to(torch.bfloat16)  # the loader's cast; the router keeps float32
    expected = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])

    plan = make_plan(model_dir, None, PlanOptions(gpu_memory_bytes=GIB))

    assert plan.weight_bytes == expected
    assert 1.026e12 < sum(p.numel() for p in model.parameters()) < 1.027e12  # "1.03T"


def test_kimi_k25_wrapper_plans_its_language_model_with_the_prefixed_names(
        kimi_dir: Path, tmp_path: Path) -> None:
    """Kimi-K2.5: the language model's config is text_config and its tensors (and the names
    the quantization config matches) sit under `language_model.`; the rest is not served."""
    text = {k: v for k, v in KIMI_K2.items() if k != "quantization_config"}
    quantization = {**KIMI_QUANTIZATION, "ignore": [
        "language_model.lm_head", *KIMI_IGNORE[1:], "re:vision_tower.*"]}
    wrapper = _write_config(tmp_path / "kimi-k25", {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "quantization_config": quantization})
    options = PlanOptions(gpu_memory_bytes=141 * GIB, tensor_parallel_size=8)
    cfg = ModelConfig.from_dir(wrapper)
    par = ParallelContext(0, 8)
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](shard_model_config(cfg, par),
                                                linear_factory(cfg), torch.device("cpu"), par)
    model.to(torch.bfloat16)

    plan = make_plan(wrapper, None, options)

    assert plan.weight_bytes == sum(t.numel() * t.element_size()
                                    for t in [*model.parameters(), *model.buffers()])
    assert plan.weight_bytes == make_plan(kimi_dir, None, options).weight_bytes


def test_kimi_k2_int4_on_8_h200_fits_with_the_hand_worked_per_gpu_figures(kimi_dir: Path) -> None:
    result = _run(str(kimi_dir), "--tensor-parallel-size", "8", "--gpu-memory-gib", "141",
                  "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    weights = {kind.rpartition(" (")[0]: part["bytes"] for kind, part in plan["weights"].items()}

    # The TP8 figures worked out by hand (GB = 1e9 B), to two decimals; the router is float32
    # here (the engine keeps it so), twice its bf16 0.33 GB.
    hand_gb = {"routed experts": 71.35, "attention, replicated": 1.85, "attention, split": 1.31,
               "dense MLP": 0.10, "shared experts": 0.66, "router": 0.66,
               "absorbed W_UK/W_UV": 0.13}
    for kind, gb in hand_gb.items():
        assert weights[kind] / 1e9 == pytest.approx(gb, abs=0.006), kind
    assert (weights["embedding"] + weights["lm_head"]) / 1e9 == pytest.approx(0.59, abs=0.006)
    assert plan["weight_bytes"] / 1e9 == pytest.approx(76.3 + 0.33, abs=0.02)
    assert plan["kv_bytes_per_token"] == 70_272  # 61 layers x 576 x 2 B, whole on each rank
    assert plan["fits"] is True
    # By hand: 607 k tokens per GPU at 141e9 B, 733 k at 150.8e9 B; 141 GiB is 151.4e9 B
    # with an 8 GiB (not 8 GB) reserve and the float32 router.
    assert 607_000 <= plan["kv_tokens"] <= 733_000
    assert plan["serve_command"] == (
        f"specd --model {kimi_dir} --device cuda --tensor-parallel-size 8 --dtype bfloat16 "
        f"--block-size 16 --num-kv-blocks {plan['num_kv_blocks']}")
    assert plan["num_kv_blocks"] * 16 == plan["kv_tokens"]


def test_kimi_k2_table_names_each_kind_and_the_verdict(kimi_dir: Path) -> None:
    result = _run(str(kimi_dir), "-tp", "8", "--gpu-memory-gib", "141")
    assert result.exit_code == 0, result.output
    for text in ("routed experts (INT4)", "each expert's width split 8 ways",
                 "attention, replicated (bfloat16)", "vocabulary split 8 ways (20480 rows each)",
                 "70272 bytes per token", "verdict      fits:", "serve with   specd --model"):
        assert text in result.output, text


def test_expert_parallel_holds_48_whole_experts_and_the_same_bytes_per_gpu(
        kimi_dir: Path) -> None:
    options = {"gpu_memory_bytes": 141 * GIB, "tensor_parallel_size": 8}
    tp = make_plan(kimi_dir, None, PlanOptions(**options))
    ep = make_plan(kimi_dir, None, PlanOptions(**options, expert_parallel=True))
    experts = [p for p in ep.parts if p.kind.startswith("routed experts")]
    assert experts[0].placement == "48 whole experts per rank"
    # By hand, EP8 experts + TP8 attention hold the same bytes per GPU, but for each expert's
    # three weight_shape tensors (int64 [2]), which every rank keeps for all 384 under TP.
    shapes = (384 - 48) * 3 * 16 * 60
    assert _part(tp, "routed experts") - _part(ep, "routed experts") == shapes
    assert ep.weight_bytes == tp.weight_bytes - shapes


def test_kimi_k2_on_four_gpus_does_not_fit(kimi_dir: Path) -> None:
    result = _run(str(kimi_dir), "-tp", "4", "--gpu-memory-gib", "141", "--json")
    plan = json.loads(result.output)
    assert result.exit_code == 0
    assert plan["fits"] is False and plan["serve_command"] is None
    assert plan["verdict"].startswith("does not fit: weights and reserve exceed")


# ---- splitting ----------------------------------------------------------------------------


def test_two_ranks_halve_the_split_weights_and_keep_the_replicated_ones() -> None:
    one, two = _plan("fixture", dtype="float32"), _plan("fixture", dtype="float32",
                                                       tensor_parallel_size=2)
    for kind in ("attention", "MLP", "embedding", "lm_head"):
        assert _part(two, kind) * 2 == _part(one, kind), kind
    assert _part(two, "norms") == _part(one, "norms")
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token  # 1 of 2 KV heads per rank


@pytest.mark.parametrize(("model", "n", "expert_parallel"), [
    ("fixture", 2, False), ("fixture", 4, False), ("fixture-moe", 2, False),
    ("fixture-moe", 2, True), ("fixture-moe", 4, True)])
def test_plan_equals_the_shard_rank_zero_loads(model: str, n: int,
                                               expert_parallel: bool) -> None:
    """The loader reads rank 0's slices in this process (no process group)."""
    cfg = ModelConfig.from_dir(FIXTURES[model][0])
    shard = load_model(cfg, torch.device("cpu"), torch.bfloat16, dense_linear,
                       ParallelContext(0, n, expert_parallel))
    plan = make_plan(cfg.model_dir, None, PlanOptions(
        gpu_memory_bytes=GIB, tensor_parallel_size=n, expert_parallel=expert_parallel))
    assert plan.weight_bytes == _storage_bytes(shard)
    tokens = 5 * 16
    kv = allocate_kv_cache(shard_model_config(cfg, ParallelContext(0, n, expert_parallel)),
                           5, 16, torch.bfloat16, torch.device("cpu"))
    assert plan.kv_bytes_per_token * tokens == sum(t.nbytes for t in kv)


def test_int4_moe_plan_equals_the_shard_rank_zero_loads(int4_moe_fixture: Path) -> None:
    cfg = ModelConfig.from_dir(int4_moe_fixture)
    shard = load_model(cfg, torch.device("cpu"), torch.bfloat16, linear_factory(cfg),
                       ParallelContext(0, 2, expert_parallel=True))
    plan = make_plan(int4_moe_fixture, None, PlanOptions(
        gpu_memory_bytes=GIB, tensor_parallel_size=2, expert_parallel=True))
    assert plan.weight_bytes == _storage_bytes(shard)


def test_int4_experts_split_into_partial_groups_are_refused_as_the_loader_refuses_them(
        int4_moe_fixture: Path) -> None:
    """The fixture's experts are 96 wide, 3 groups of 32: two ranks would hold 48 each."""
    cfg = ModelConfig.from_dir(int4_moe_fixture)
    with pytest.raises(ValueError, match="group_size 32 does not divide") as refused:
        load_model(cfg, torch.device("cpu"), torch.bfloat16, linear_factory(cfg),
                   ParallelContext(0, 2))
    result = _run(str(int4_moe_fixture), "-tp", "2", "--gpu-memory-gib", "1")
    assert result.exit_code == 2
    assert str(refused.value) == ("model.layers.1.mlp.experts: group_size 32 does not divide "
                                  "moe_intermediate_size 48")
    assert str(refused.value) in result.output


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp8", "ep8"])
def test_kimi_k2_int4_plan_equals_rank_zero_built_on_the_meta_device(
        kimi_dir: Path, expert_parallel: bool) -> None:
    cfg = ModelConfig.from_dir(kimi_dir)
    par = ParallelContext(0, 8, expert_parallel)
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](shard_model_config(cfg, par),
                                                linear_factory(cfg), torch.device("cpu"), par)
    model.to(torch.bfloat16)
    plan = make_plan(kimi_dir, None, PlanOptions(gpu_memory_bytes=141 * GIB,
                                                 tensor_parallel_size=8,
                                                 expert_parallel=expert_parallel))
    assert plan.weight_bytes == sum(t.numel() * t.element_size()
                                    for t in [*model.parameters(), *model.buffers()])


def test_draft_head_is_whole_on_rank_zero_with_a_copy_of_the_embedding_when_split() -> None:
    one, two = _plan("fixture"), _plan("fixture", tensor_parallel_size=2)
    cfg = ModelConfig.from_dir(FIXTURE_DIR)
    embedding = cfg.vocab_size * cfg.hidden_size * 2  # bf16
    assert _part(two, "draft head") == _part(one, "draft head") + embedding
    assert two.draft_kv_bytes_per_token == one.draft_kv_bytes_per_token


def test_a_head_with_its_own_embedding_counts_it_as_the_head_loader_keeps_it(
        tmp_path: Path) -> None:
    """The head's tensors (with an embedding of its own) stored as a pickled state dict: the
    plan reads the names only, and loading keeps the head's embedding beside the target's."""
    source = FIXTURES["fixture"][1]
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    shutil.copy(source / "config.json", head_dir / "config.json")
    tensors = load_file(str(source / "model.safetensors"))
    cfg = ModelConfig.from_dir(FIXTURE_DIR)
    tensors["model.embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size)
    torch.save(tensors, head_dir / "pytorch_model.bin")
    target_embedding = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    head = load_draft_head(head_dir, target_embedding, dtype=torch.bfloat16)

    plan = make_plan(FIXTURE_DIR, head_dir, PlanOptions(gpu_memory_bytes=GIB))

    assert _part(plan, "draft head") == _storage_bytes(head, exclude={
        target_embedding.data_ptr()})
    assert "the draft head carries its own embedding" in plan.assumptions


# ---- errors -------------------------------------------------------------------------------


def test_a_directory_without_config_json_is_a_usage_error_naming_the_file(
        tmp_path: Path) -> None:
    result = _run(str(tmp_path), "--gpu-memory-gib", "80")
    assert result.exit_code == 2
    assert f"{tmp_path / 'config.json'}: not found" in result.output


def test_more_ranks_than_kv_heads_share_each_kv_head_as_the_engine_does() -> None:
    # The fixture has 4 q heads and 2 KV heads: at 4 ranks each holds one q head and the
    # KV head it uses, each KV head on 2 ranks (the bytes: the rank-0 shard test above).
    one, four = _plan("fixture", dtype="float32"), _plan("fixture", dtype="float32",
                                                        tensor_parallel_size=4)
    assert four.kv_bytes_per_token * 2 == one.kv_bytes_per_token
    result = _run("fixture", "-tp", "4", "--gpu-memory-gib", "80")
    assert result.exit_code == 0, result.output
    assert "q heads split 4 ways, each KV head on 2 ranks" in result.output
    assert "K and V of 1 of 2 KV heads per layer on each rank, each on 2 ranks" in result.output


def test_ranks_neither_dividing_nor_a_multiple_of_the_kv_heads_are_refused(
        tmp_path: Path) -> None:
    config = {**json.loads((FIXTURE_DIR / "config.json").read_text()),
              "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 16}
    message = "tensor_parallel_size 6 is neither a divisor nor a multiple of " \
              "num_key_value_heads (4)"
    result = _run(str(_write_config(tmp_path / "m", config)), "-tp", "6",
                  "--gpu-memory-gib", "80")
    assert result.exit_code == 2
    assert message in result.output
    cfg = ModelConfig.from_dir(tmp_path / "m")
    with pytest.raises(ValueError, match="neither a divisor nor a multiple of "
                                         r"num_key_value_heads \(4\)"):
        shard_model_config(cfg, ParallelContext(0, 6))


def test_ranks_that_do_not_divide_the_heads_are_refused_naming_them() -> None:
    result = _run("fixture", "-tp", "3", "--gpu-memory-gib", "80")
    assert result.exit_code == 2
    assert "tensor_parallel_size 3 does not divide num_attention_heads (4)" in result.output


def test_expert_parallel_ranks_that_do_not_divide_the_experts_are_refused(
        tmp_path: Path) -> None:
    config = {**KIMI_K2, "n_routed_experts": 380}
    result = _run(str(_write_config(tmp_path / "m", config)), "-tp", "8", "--expert-parallel",
                  "--gpu-memory-gib", "141")
    assert result.exit_code == 2
    assert "tensor_parallel_size 8 does not divide n_routed_experts (380)" in result.output


def test_int4_experts_split_into_partial_groups_at_32_ranks_are_refused_naming_them(
        tmp_path: Path) -> None:
    config = copy.deepcopy(KIMI_K2)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    result = _run(str(_write_config(tmp_path / "m", config)), "-tp", "32",
                  "--gpu-memory-gib", "141")
    assert result.exit_code == 2
    assert "model.layers.1.mlp.experts: group_size 128 does not divide " \
           "moe_intermediate_size 64" in result.output


def test_embedded_model_names_resolve_with_their_own_heads() -> None:
    result = _run("fixture-moe", "--gpu-memory-gib", "1", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["model"] == str(FIXTURE_MOE_DIR)
    assert plan["draft_model"] == str(FIXTURES["fixture-moe"][1])
    assert "draft head (bfloat16)" in plan["weights"]
