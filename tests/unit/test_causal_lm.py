"""The causal-LM shell (workers/models/causal_lm.py) and the one choice of attention per
cache layout (workers/runner/attention_backend.py).

An architecture is its blocks: a class that only names its layout and makes its attention
and MLP computes what the decoder computes when the blocks compute the same (compared bit
for bit, float32, one paged prefill and one decode step on the CPU).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specd.workers.config import FIXTURE_DIR
from specd.workers.models.causal_lm import CausalLM
from specd.workers.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specd.workers.models.decoder import STACKED_PARAMS as DECODER_STACKED
from specd.workers.models.decoder import Attention, DecoderForCausalLM
from specd.workers.models.layers import LinearFactory, dense_linear
from specd.workers.models.moe import GatedMLP
from specd.workers.models.registry import MODEL_CLASSES, STACKED_PARAMS, build_meta_model
from specd.workers.parallel.context import ParallelContext
from specd.workers.runner.attention import build_attention_metadata
from specd.workers.runner.attention_backend import (
    LATENT,
    PER_HEAD,
    PerHeadAttention,
    TorchLatentAttention,
    TorchPerHeadAttention,
    TritonLatentAttention,
    TritonPerHeadAttention,
)

CPU = torch.device("cpu")
DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "intermediate_size": 96, "moe_intermediate_size": 32, "vocab_size": 97,
    "max_position_embeddings": 512, "q_lora_rank": 24, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
}


def test_the_registry_serves_exactly_the_architectures_the_config_parses() -> None:
    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)
    for cls in MODEL_CLASSES.values():
        assert issubclass(cls, CausalLM)
        assert STACKED_PARAMS[cls] is cls.stacked_params


def test_each_cache_layout_runs_the_kernels_on_cuda_and_torch_elsewhere() -> None:
    # Choosing reads only the device's type: no CUDA is needed to check it.
    for device in (torch.device("cuda"), torch.device("cuda", 1)):
        assert isinstance(PER_HEAD.attention(device), TritonPerHeadAttention)
        assert isinstance(LATENT.attention(device), TritonLatentAttention)
    assert isinstance(PER_HEAD.attention(CPU), TorchPerHeadAttention)
    assert isinstance(LATENT.attention(CPU), TorchLatentAttention)


def test_every_layer_attends_through_the_backend_its_model_chose(tmp_path: Path) -> None:
    dense = build_meta_model(ModelConfig.from_dir(FIXTURE_DIR), CPU)
    mla = build_meta_model(ModelConfig.from_dict(DEEPSEEK, tmp_path), CPU)
    assert all(layer.self_attn.attention is PER_HEAD.on_cpu for layer in dense.model.layers)
    assert all(layer.self_attn.attention is LATENT.on_cpu for layer in mla.model.layers)
    assert type(mla.model.layers[0].mlp).__name__ == "GatedMLP"  # first_k_dense_replace
    assert type(mla.model.layers[1].mlp).__name__ == "MoE"


class SharedMlpDecoder(CausalLM[PerHeadAttention]):
    """A Llama whose MLP is the MoE module's shared-expert MLP (same math, same names)."""

    kv_layout = PER_HEAD
    stacked_params = DECODER_STACKED

    def make_attention(self, cfg: ModelConfig, layer: int, prefix: str,
                       make_linear: LinearFactory, attention: PerHeadAttention) -> nn.Module:
        return Attention(cfg, prefix, make_linear, attention)

    def make_mlp(self, cfg: ModelConfig, layer: int, prefix: str, make_linear: LinearFactory,
                 par: ParallelContext) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, prefix, make_linear)

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        return cfg.head_dim


def test_an_architecture_made_of_the_same_blocks_computes_the_same() -> None:
    cfg = ModelConfig.from_dir(FIXTURE_DIR)
    torch.manual_seed(0)
    reference = DecoderForCausalLM(cfg, dense_linear, CPU).eval()
    other = SharedMlpDecoder(cfg, dense_linear, CPU).eval()
    assert other.state_dict().keys() == reference.state_dict().keys()
    other.load_state_dict(reference.state_dict())
    prompt = torch.randint(cfg.vocab_size, (7,))
    caches = {m: [torch.zeros(cfg.kv_layer_shape(4, 4)) for _ in range(cfg.num_layers)]
              for m in ("reference", "other")}
    for ids, start in ((prompt, 0), (prompt[-1:], 7)):  # a prefill, then one decode step
        n = len(ids)
        meta = build_attention_metadata([n], [start + n], [[2, 0, 3]], 4, CPU)
        positions = torch.arange(start, start + n)
        with torch.inference_mode():
            want, want_aux = reference(ids, positions, caches["reference"], meta, (0, 2))
            got, got_aux = other(ids, positions, caches["other"], meta, (0, 2))
            assert torch.equal(other.compute_logits(got), reference.compute_logits(want))
        assert want_aux is not None and got_aux is not None and torch.equal(got_aux, want_aux)
        assert torch.equal(got, want)
    assert all(torch.equal(a, b)
               for a, b in zip(caches["reference"], caches["other"], strict=True))
