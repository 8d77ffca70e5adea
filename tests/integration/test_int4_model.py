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

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from specd.ipc.sampling import SamplingParams
from specd.workers.batch import ScheduledBatch, ScheduledSequence
from specd.workers.config import EngineConfig
from specd.workers.model_runner import ModelRunner, prepare_inputs
from specd.workers.quantization import Int4Linear
from specd.workers.sequence import Sequence

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import quantize as quantize_tool  # noqa: E402  (tools/ is not a package)

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
    """Hands out block ids from the top down, so sequences' blocks interleave."""

    def __init__(self) -> None:
        self.next_free = NUM_BLOCKS - 1

    def cover(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_ids) * BLOCK_SIZE < num_tokens:
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
            prepare_inputs(batch, BLOCK_SIZE, runner.device)))
    for seq, n in work:
        seq.num_computed_tokens += n
    return list(logits.split([n for _, n in work]))


def _oracle_logits(hf: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]


def test_int4_checkpoint_runs_like_compressed_tensors_decompression(int4_dir: Path) -> None:
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
    blocks = Blocks()
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
