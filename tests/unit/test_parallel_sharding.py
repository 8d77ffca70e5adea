"""What each rank holds (workers/parallel/sharding.py, expert_parallel.py, the loader),
checked in one process without a process group: the ranks' slices put side by side are
the checkpoint's tensors, a rank reads only its part of the file, and expert-parallel
ranks' partial MoE outputs add up to the whole MoE's."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specd.workers.config import FIXTURE_DIR, FIXTURE_MOE_DIR
from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import dense_linear
from specd.workers.models.loader import load_model
from specd.workers.models.moe import MoE
from specd.workers.parallel.context import ParallelContext
from specd.workers.parallel.expert_parallel import ExpertParallelMoE
from specd.workers.parallel.sharding import (
    WHOLE,
    TensorSlice,
    shard_model_config,
    tensor_slice,
)

CPU = torch.device("cpu")


def ranks(world: int, expert_parallel: bool = False) -> list[ParallelContext]:
    return [ParallelContext(r, world, expert_parallel) for r in range(world)]


def test_column_row_and_replicated_tensors_are_sliced_as_the_layout_says() -> None:
    cfg = ModelConfig.from_dir(FIXTURE_DIR)
    rank1 = ParallelContext(1, 2)
    attn = "model.layers.0.self_attn"
    assert tensor_slice(f"{attn}.q_proj.weight", [256, 256], cfg, rank1) == TensorSlice(0, 128, 128)
    assert tensor_slice(f"{attn}.o_proj.weight", [256, 256], cfg, rank1) == TensorSlice(1, 128, 128)
    assert tensor_slice("model.layers.0.mlp.down_proj.weight", [256, 688], cfg,
                        rank1) == TensorSlice(1, 344, 344)
    assert tensor_slice("lm_head.weight", [4096, 256], cfg, rank1) == TensorSlice(0, 2048, 2048)
    assert tensor_slice("model.norm.weight", [256], cfg, rank1) == WHOLE
    # A row-parallel bias is added once: rank 0 holds it, the others zeros.
    assert tensor_slice(f"{attn}.o_proj.bias", [256], cfg, rank1).zeros
    assert tensor_slice(f"{attn}.o_proj.bias", [256], cfg, ParallelContext(0, 2)) == WHOLE
    # One rank: every tensor whole.
    assert tensor_slice(f"{attn}.q_proj.weight", [256, 256], cfg, ParallelContext()) == WHOLE


def test_mla_latent_projections_and_router_are_replicated_experts_split_or_placed() -> None:
    cfg = ModelConfig.from_dir(FIXTURE_MOE_DIR)
    tp, ep = ParallelContext(1, 2), ParallelContext(1, 2, expert_parallel=True)
    attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
    for name in (f"{attn}.q_a_proj.weight", f"{attn}.kv_a_proj_with_mqa.weight",
                 f"{mlp}.gate.weight", f"{mlp}.gate.e_score_correction_bias"):
        assert tensor_slice(name, [64, 128], cfg, tp) == WHOLE, name
    assert tensor_slice(f"{attn}.kv_b_proj.weight", [256, 64], cfg, tp) == TensorSlice(0, 128, 128)
    assert tensor_slice(f"{mlp}.experts.0.down_proj.weight", [128, 96], cfg,
                        tp) == TensorSlice(1, 48, 48)
    # Expert parallelism: rank 1 of 2 holds experts 4..7 whole and reads no other.
    assert tensor_slice(f"{mlp}.experts.5.down_proj.weight", [128, 96], cfg, ep) == WHOLE
    assert tensor_slice(f"{mlp}.experts.3.down_proj.weight", [128, 96], cfg, ep).skip
    # The shared experts are split like a dense MLP either way.
    assert tensor_slice(f"{mlp}.shared_experts.up_proj.weight", [96, 128], cfg,
                        ep) == TensorSlice(0, 48, 48)


def test_a_size_that_does_not_divide_a_dimension_is_refused_by_name() -> None:
    cfg = ModelConfig.from_dir(FIXTURE_DIR)  # 4 heads, 2 KV heads
    local = shard_model_config(cfg, ParallelContext(0, 2))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 344)
    with pytest.raises(ValueError, match="num_attention_heads"):
        shard_model_config(cfg, ParallelContext(0, 3))
    # 12 heads over 4 ranks divide, 3 K/V heads neither divide 4 nor are divided by it.
    odd = dataclasses.replace(cfg, num_heads=12, num_kv_heads=3)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        shard_model_config(odd, ParallelContext(0, 4))


def test_with_more_ranks_than_kv_heads_each_rank_holds_the_head_its_queries_share() -> None:
    """4 ranks, 4 query heads, 2 K/V heads: rank r holds query head r and K/V head r // 2
    (query heads 0-1 share K/V head 0, 2-3 head 1)."""
    cfg = ModelConfig.from_dir(FIXTURE_DIR)
    assert shard_model_config(cfg, ParallelContext(3, 4)).num_kv_heads == 1
    d = cfg.head_dim
    for rank, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        par = ParallelContext(rank, 4)
        for proj in ("k_proj", "v_proj"):
            assert tensor_slice(f"model.layers.0.self_attn.{proj}.weight", [2 * d, 256], cfg,
                                par) == TensorSlice(0, head * d, d)
        assert tensor_slice("model.layers.0.self_attn.q_proj.weight", [4 * d, 256], cfg,
                            par) == TensorSlice(0, rank * d, d)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_rank_shards_side_by_side_are_the_checkpoint(expert_parallel: bool) -> None:
    cfg = ModelConfig.from_dir(FIXTURE_MOE_DIR)
    shards = [load_model(cfg, CPU, torch.float32, dense_linear, par)
              for par in ranks(2, expert_parallel)]
    full = {k: v.float() for k, v in load_file(FIXTURE_MOE_DIR / "model.safetensors").items()}
    params = [dict(s.named_parameters()) for s in shards]
    attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
    pairs = {
        f"{attn}.q_b_proj.weight": 0, f"{attn}.kv_b_proj.weight": 0,
        f"{attn}.o_proj.weight": 1, "lm_head.weight": 0, "model.embed_tokens.weight": 0,
        "model.layers.0.mlp.down_proj.weight": 1,
    }
    for name, dim in pairs.items():
        assert torch.equal(torch.cat([p[name] for p in params], dim=dim), full[name]), name
    assert torch.equal(params[1][f"{attn}.kv_a_proj_with_mqa.weight"],
                       full[f"{attn}.kv_a_proj_with_mqa.weight"])
    w2 = [p[f"{mlp}.experts.w2"] for p in params]
    if expert_parallel:  # rank 1's first local expert is expert 4, whole
        assert w2[1].shape == (4, 128, 96)
        assert torch.equal(w2[1][0], full[f"{mlp}.experts.4.down_proj.weight"])
    else:  # every expert on both ranks, its intermediate dimension split
        assert w2[1].shape == (8, 128, 48)
        assert torch.equal(torch.cat([w[6] for w in w2], dim=1),
                           full[f"{mlp}.experts.6.down_proj.weight"])


def test_expert_parallel_partial_outputs_add_up_to_the_whole_moe() -> None:
    """Each rank's dispatch and combine over its experts, summed over ranks (what the
    all-reduce does), equals the routed experts of the whole MoE."""
    cfg = ModelConfig.from_dir(FIXTURE_MOE_DIR)
    whole = load_model(cfg, CPU, torch.float32)
    moe = whole.model.layers[2].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ids, weights = moe.gate(x)
    expected = moe.experts(x, ids, weights)
    total = torch.zeros_like(expected)
    for par in ranks(2, expert_parallel=True):
        shard = load_model(cfg, CPU, torch.float32, dense_linear, par)
        part = shard.model.layers[2].mlp
        assert isinstance(part, ExpertParallelMoE)
        total += part.dispatch_combine(x, ids, weights)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)


def test_a_rank_reads_about_half_the_bytes(caplog: pytest.LogCaptureFixture) -> None:
    """Loading logs each rank's progress with the bytes it read: at size 2 about half the
    checkpoint (the replicated norms and latent projections are read by both)."""
    cfg = ModelConfig.from_dir(FIXTURE_DIR)
    caplog.set_level("INFO", logger="specd.loader")
    load_model(cfg, CPU, torch.float32, dense_linear, ParallelContext(1, 2))
    records = [r for r in caplog.records if getattr(r, "event", "") == "rank_load_progress"]
    fields = [(r.__dict__["rank"], r.__dict__["files_done"], r.__dict__["files"])
              for r in records]  # extra fields of the record
    assert fields == [(1, 1, 1)]
    checkpoint = sum(t.numel() * t.element_size()
                     for t in load_file(FIXTURE_DIR / "model.safetensors").values())
    assert 0.45 * checkpoint < records[0].__dict__["bytes_read"] < 0.55 * checkpoint


def test_a_tensor_missing_from_the_checkpoint_fails_only_the_rank_that_needs_it(
        tmp_path: Path) -> None:
    """Expert parallelism: without expert 6's down_proj, rank 1 (experts 4..7) refuses
    naming the parameter and shard, rank 0 (experts 0..3) loads."""
    tensors = load_file(FIXTURE_MOE_DIR / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.6.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(FIXTURE_MOE_DIR / "config.json", tmp_path / "config.json")
    cfg = ModelConfig.from_dir(tmp_path)
    rank0, rank1 = ranks(2, expert_parallel=True)
    load_model(cfg, CPU, torch.float32, dense_linear, rank0)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.w2 \(shard 2\)"):
        load_model(cfg, CPU, torch.float32, dense_linear, rank1)
