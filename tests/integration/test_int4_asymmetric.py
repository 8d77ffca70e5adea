"""W4A16 checkpoints as published with zero points (asymmetric) and channel-wise scales,
written by compressed-tensors' own compressor (tests/integration/ct_asymmetric.py), served by
specd and compared with transformers.

Oracle (`decompressed_oracle`): transformers' model (LlamaForCausalLM, DeepseekV3ForCausalLM)
over weights that compressed-tensors decompresses from the checkpoint's tensors, with the
scales in fp32 so that (q - z) * scale is exact; fp32 on both sides, so the differences are
summation order (ATOL 1e-4 as test_int4_model; a zero point ignored or read from the wrong
row moves logits by 1e-2 or more). Why not transformers' own loader: in transformers 5.24
with compressed-tensors 0.20.1 it refuses asymmetric pack-quantized linears unless told to
dequantize at load (`CompressedTensorsConfig(dequantize=True)`, whose weights are the
decompression rounded to the scale's bf16: the dense test checks that they are the oracle's
weights so rounded), and it cannot load asymmetric MoE experts at all (its expert
decompression drops `weight_zero_point`; compressed-tensors asserts).

The runs above take the CPU path (the kernels' torch references); the last test runs the
fused MoE Triton kernel under the interpreter on the experts exactly as the loader stacked
them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.config import FIXTURE_MOE_DIR, EngineConfig
from specd.workers.engine.sequence import Sequence
from specd.workers.models.moe_int4 import Int4RoutedExperts
from specd.workers.models.quantization import Int4Linear
from specd.workers.runner.model_runner import ModelRunner
from tests.integration.ct_asymmetric import ct_scheme, decompressed_oracle, write_checkpoint
from tests.integration.test_int4_model import (
    ATOL,
    BLOCK_SIZE,
    NUM_BLOCKS,
    SMALL,
    Blocks,
    _oracle_logits,
    _run_step,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

# (group size or None for channel-wise scales, symmetric)
SCHEMES = {"group32-asym": (32, False), "channel-asym": (None, False),
           "channel-sym": (None, True)}
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
ROUTED_EXPERT = re.compile(r".*\.experts\.\d+\.(gate|up|down)_proj$")


def _runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(model_dir), dtype="float32",
                                    block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS))


def _compare(runner: ModelRunner, oracle: Any) -> None:
    """Prefill three prompts, then three paged decode steps; logits equal within ATOL."""
    vocab = runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(1)
    seqs = [Sequence(f"r{i}", torch.randint(vocab, (n,), generator=gen).tolist(),
                     SamplingParams()) for i, n in enumerate((11, 3, 6))]
    blocks = Blocks(runner)
    for seq, got in zip(seqs, _run_step(runner, [(s, s.num_tokens) for s in seqs], blocks),
                        strict=True):
        torch.testing.assert_close(got, _oracle_logits(oracle, seq.all_token_ids), atol=ATOL,
                                   rtol=0)
    for step in range(3):
        for i, seq in enumerate(seqs):
            seq.output_token_ids.append((5 * step + 11 * i) % vocab)
        for seq, got in zip(seqs, _run_step(runner, [(s, 1) for s in seqs], blocks), strict=True):
            torch.testing.assert_close(got[0], _oracle_logits(oracle, seq.all_token_ids)[-1],
                                       atol=ATOL, rtol=0)


@pytest.mark.parametrize("scheme", ["group32-asym", "channel-asym"])
def test_asymmetric_dense_checkpoint_runs_like_transformers(scheme: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    write_checkpoint(tmp_path / "bf16", tmp_path / "int4", ct_scheme(*SCHEMES[scheme]),
                     ["lm_head"], lambda module: ".layers." in module)
    runner = _runner(tmp_path / "int4")
    qkv = runner.model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, Int4Linear) and qkv.weight_zero_point is not None
    assert qkv.group_size == SCHEMES[scheme][0]
    oracle = decompressed_oracle(tmp_path / "bf16", tmp_path / "int4")
    _compare(runner, oracle)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "int4", dtype=torch.float32,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        exact = oracle.get_submodule(name).weight
        assert torch.equal(loaded.get_submodule(name).weight, exact.bfloat16().float()), name


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_moe_experts_with_zero_points_or_channel_scales_run_like_compressed_tensors(
        scheme: str, tmp_path: Path) -> None:
    write_checkpoint(FIXTURE_MOE_DIR, tmp_path / "int4", ct_scheme(*SCHEMES[scheme]),
                     KIMI_IGNORE, lambda module: ROUTED_EXPERT.match(module) is not None)
    runner = _runner(tmp_path / "int4")
    experts = runner.model.get_submodule("model.layers.1.mlp.experts")
    assert isinstance(experts, Int4RoutedExperts)
    assert (experts.w13_zero_point is None) == SCHEMES[scheme][1]
    assert experts.group_size == SCHEMES[scheme][0]
    _compare(runner, decompressed_oracle(FIXTURE_MOE_DIR, tmp_path / "int4"))


@pytest.mark.parametrize("scheme", ["group32-asym", "channel-asym"])
def test_fused_kernel_reads_the_loaded_experts_as_the_reference_does(scheme: str,
                                                                     tmp_path: Path) -> None:
    """The experts as the loader stacked them are a valid operand of the Triton kernel
    (TRITON_INTERPRET=1 here): bf16 tokens through kernel and reference agree within the
    kernel tests' tolerance (tests/kernels/test_moe_w4a16.py: 2 eps of bf16, relative)."""
    from specd.kernels.moe_w4a16 import fused_moe, fused_moe_ref

    write_checkpoint(FIXTURE_MOE_DIR, tmp_path / "int4", ct_scheme(*SCHEMES[scheme]),
                     KIMI_IGNORE, lambda module: ROUTED_EXPERT.match(module) is not None)
    experts = _runner(tmp_path / "int4").model.get_submodule("model.layers.2.mlp.experts")
    assert isinstance(experts, Int4RoutedExperts)
    weights = experts.weights()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, weights.hidden_size, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(weights.num_experts, generator=gen)[:2] for _ in range(7)])
    pair_weights = torch.rand(7, 2, generator=gen)
    ref = fused_moe_ref(x, ids, pair_weights, weights).float()
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(fused_moe(x, ids, pair_weights, weights).float(), ref,
                               rtol=2 * eps, atol=2 * eps * float(ref.abs().max()))
