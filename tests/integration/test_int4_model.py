"""INT4 models end to end: tools/quantize.py, then specd's loader and paged model, against
transformers + compressed-tensors loading the same INT4 checkpoint as the oracle.

Tiny random models (transformers' config classes, `save_pretrained` in bf16) are quantized
by the tool; specd loads the result with `Int4Linear` layers (fused q/k/v and gate/up built
from INT4 shards) and runs paged prefill and decode steps. transformers loads the same
directory through its compressed-tensors integration, which decompresses the weights with
compressed-tensors' own code. Tolerance: fp32 on both sides, and both dequantize to the same
fp32 weights (the bf16 scale times a 4-bit integer is exact in fp32), so the differences are
fp32 summation order, as in test_model_parity (ATOL 1e-4; a wrong nibble, group or shard
moves logits by 1e-2 or more).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from specd.ipc.sampling import SamplingParams
from specd.workers.config import FIXTURE_DIR, EngineConfig
from specd.workers.engine.batch import ScheduledBatch, ScheduledSequence
from specd.workers.engine.sequence import Sequence
from specd.workers.models.quantization import Int4Linear
from specd.workers.runner.model_runner import ModelRunner, prepare_inputs
from tools import quantize as quantize_tool

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 64
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen2-qkv-bias": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3-head-dim-32": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def int4_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    with torch.no_grad():  # random biases and norms, so that a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    assert quantize_tool.main([str(root / "bf16"), str(root / "int4"), "--group-size",
                               "32"]) == 0
    return root / "int4"


class Blocks:
    """Hands out a runner's block ids from the top down, so sequences' blocks interleave."""

    def __init__(self, runner: ModelRunner) -> None:
        self.block_size = runner.config.block_size
        self.next_free = runner.num_kv_blocks - 1

    def cover(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_ids) * self.block_size < num_tokens:
            if self.next_free < 0:
                raise ValueError("the test ran out of KV blocks")
            seq.block_ids.append(self.next_free)
            self.next_free -= 1


def _run_step(runner: ModelRunner, work: list[tuple[Sequence, int]], blocks: Blocks
              ) -> list[torch.Tensor]:
    """One paged step of `n` new tokens per sequence -> each sequence's logits [n, vocab]."""
    for seq, n in work:
        blocks.cover(seq, seq.num_computed_tokens + n)
    batch = ScheduledBatch([ScheduledSequence(seq, n) for seq, n in work])
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.forward(
            prepare_inputs(batch, blocks.block_size, runner.device)))
    for seq, n in work:
        seq.num_computed_tokens += n
    return list(logits.split([n for _, n in work]))


def _oracle_logits(hf: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]


def test_int4_checkpoint_runs_like_compressed_tensors_decompression(int4_dir: Path) -> None:
    pytest.importorskip("compressed_tensors")  # transformers' INT4 loading goes through it
    runner = ModelRunner(EngineConfig(model=str(int4_dir), dtype="float32",
                                      block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS))
    layers = dict(runner.model.named_modules())
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj",
                 "model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.down_proj"):
        assert isinstance(layers[name], Int4Linear), name
    assert not isinstance(runner.model.lm_head, Int4Linear)  # in the ignore list
    assert isinstance(runner.model.lm_head, nn.Module)
    hf = transformers.AutoModelForCausalLM.from_pretrained(int4_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(97, (n,), generator=gen).tolist() for n in (11, 3, 6)]
    seqs = [Sequence(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    blocks = Blocks(runner)
    for seq, got in zip(seqs, _run_step(runner, [(s, s.num_tokens) for s in seqs], blocks),
                        strict=True):
        torch.testing.assert_close(got, _oracle_logits(hf, seq.all_token_ids), atol=ATOL,
                                   rtol=0)
    for step in range(3):  # paged decode over the INT4 layers
        for i, seq in enumerate(seqs):
            seq.output_token_ids.append((5 * step + 11 * i) % 97)
        for seq, got in zip(seqs, _run_step(runner, [(s, 1) for s in seqs], blocks), strict=True):
            torch.testing.assert_close(got[0], _oracle_logits(hf, seq.all_token_ids)[-1],
                                       atol=ATOL, rtol=0)



@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="TRITON_INTERPRET=1: set TRITON_INTERPRET=0 to compile for the GPU")
def test_int4_model_on_cuda_matches_the_cpu_path(int4_dir: Path) -> None:
    """On CUDA the INT4 layers run the Triton GEMM and attention the Triton tree kernel, in
    bf16; the CPU runs the torch references in fp32. bf16 activations through two layers
    move logits of size ~1 by a few 1e-2, while a wrong kernel moves them by O(1)."""
    runners = [ModelRunner(EngineConfig(model=str(int4_dir), device=device, dtype=dtype,
                                        block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS))
               for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16"))]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(97, (n,), generator=gen).tolist() for n in (13, 1, 6)]
    outputs = []
    for runner in runners:
        seqs = [Sequence(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
        blocks = Blocks(runner)
        steps = [torch.cat(_run_step(runner, [(s, s.num_tokens) for s in seqs], blocks))]
        for step in range(3):
            for i, seq in enumerate(seqs):
                seq.output_token_ids.append((3 * step + 7 * i) % 97)
            steps.append(torch.cat(_run_step(runner, [(s, 1) for s in seqs], blocks)))
        outputs.append(torch.cat(steps).float().cpu())
    torch.testing.assert_close(outputs[1], outputs[0], atol=0.1, rtol=0.05)

# ----------------------------------------------------------------------------- the fixture

# Measured on the fixture (group 32; down_proj kept bf16, 688 being no multiple of 32) with
# fixture_agreement(..., num_prompts=8, new_tokens=32): teacher-forced 0.996 (255 of 256),
# free-running 0.883 of positions, 7 of 8 continuations identical, mean common prefix 28.3.
# The test runs a smaller sample; the floor leaves margin below the measured figure.
MIN_TEACHER_FORCED_AGREEMENT = 0.9


def _greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations (argmax of the runner's logits), all prompts batched."""
    seqs = [Sequence(f"g{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    blocks = Blocks(runner)
    logits = _run_step(runner, [(s, s.num_tokens) for s in seqs], blocks)
    for _ in range(new_tokens):
        for seq, lg in zip(seqs, logits, strict=True):
            seq.output_token_ids.append(int(lg[-1].argmax()))
        logits = _run_step(runner, [(s, 1) for s in seqs], blocks)
    return [s.output_token_ids for s in seqs]


def _teacher_forced(runner: ModelRunner, prompts: list[list[int]],
                    continuations: list[list[int]]) -> list[list[int]]:
    """The runner's argmax at each continuation position, given the reference prefix."""
    seqs = [Sequence(f"t{i}", p + c, SamplingParams()) for i, (p, c)
            in enumerate(zip(prompts, continuations, strict=True))]
    logits = _run_step(runner, [(s, s.num_tokens) for s in seqs], Blocks(runner))
    return [lg[len(p) - 1:-1].argmax(-1).tolist() for p, lg in zip(prompts, logits, strict=True)]


def fixture_agreement(fixture_dir: Path, int4_dir: Path, num_prompts: int,
                      new_tokens: int) -> dict[str, float]:
    """Greedy token agreement of the INT4 build with the bf16 model over the first
    `num_prompts` held-out prompts: teacher-forced (INT4 argmax after the bf16 prefix) and
    free-running (position by position, common prefix, identical continuations)."""
    from specd.tokenizer import Tokenizer

    lines = (fixture_dir / "heldout_prompts.jsonl").read_text().splitlines()[:num_prompts]
    tokenizer = Tokenizer.from_dir(fixture_dir)
    prompts = [tokenizer.encode(json.loads(line)["prompt"]) for line in lines]
    runners = [ModelRunner(EngineConfig(model=str(d), dtype="float32", block_size=16,
                                        num_kv_blocks=num_prompts * 64))
               for d in (fixture_dir, int4_dir)]
    dense_out, int4_out = (_greedy(r, prompts, new_tokens) for r in runners)
    forced = _teacher_forced(runners[1], prompts, dense_out)
    total = num_prompts * new_tokens
    prefix = [next((i for i, (a, b) in enumerate(zip(d, q, strict=True)) if a != b), len(d))
              for d, q in zip(dense_out, int4_out, strict=True)]
    return {
        "teacher_forced": sum(a == b for d, f in zip(dense_out, forced, strict=True)
                              for a, b in zip(d, f, strict=True)) / total,
        "free_running_positional": sum(a == b for d, q in zip(dense_out, int4_out, strict=True)
                                       for a, b in zip(d, q, strict=True)) / total,
        "mean_common_prefix": sum(prefix) / len(prefix),
        "identical_sequences": sum(p == new_tokens for p in prefix) / len(prefix),
    }


@pytest.mark.slow
def test_fixture_int4_build_agrees_with_bf16(tmp_path: Path) -> None:
    if not (FIXTURE_DIR / "model.safetensors").is_file():
        pytest.skip("the fixture model is not trained yet (workers/fixture/model.safetensors)")
    # The fixture's intermediate size (688) is no multiple of 32: down_proj stays bf16.
    assert quantize_tool.main([str(FIXTURE_DIR), str(tmp_path / "int4"), "--group-size", "32",
                               "--ignore", r"re:.*mlp\.down_proj"]) == 0
    agreement = fixture_agreement(FIXTURE_DIR, tmp_path / "int4", num_prompts=4, new_tokens=24)
    assert agreement["teacher_forced"] >= MIN_TEACHER_FORCED_AGREEMENT, agreement
