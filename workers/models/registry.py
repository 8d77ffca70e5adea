"""Model registry: architecture name (config.json's `architectures[0]`) -> model class.

The Llama family (Llama, Mistral, Qwen2, Qwen3) is served by the one dense decoder;
DeepSeek-V3 / Kimi-K2 by the MLA + MoE model. Both classes share one interface (`forward`,
`embed_tokens`, `compute_logits`, `copy_kv_slots`, `config`, `model.layers`) over paged
cache layers of `ModelConfig.kv_layer_shape` (per-head K/V, or one latent row per token);
`CausalLM` names either. A new family adds a module here, a line to `MODEL_CLASSES` and its
`STACKED_PARAMS`.
"""

from __future__ import annotations

from typing import TypeAlias

import torch

from specd.workers.models import decoder, deepseek_v3
from specd.workers.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specd.workers.models.decoder import DecoderForCausalLM
from specd.workers.models.deepseek_config import MLA_ARCHITECTURE
from specd.workers.models.deepseek_v3 import DeepseekV3ForCausalLM
from specd.workers.models.layers import LinearFactory, dense_linear
from specd.workers.parallel.context import SINGLE_RANK, ParallelContext

CausalLM: TypeAlias = DecoderForCausalLM | DeepseekV3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    name: DecoderForCausalLM for name in SUPPORTED_ARCHITECTURES if name != MLA_ARCHITECTURE
} | {MLA_ARCHITECTURE: DeepseekV3ForCausalLM}

# (fused module, checkpoint module, shard index) of each class: how checkpoint tensors stack.
STACKED_PARAMS: dict[type[CausalLM], tuple[tuple[str, str, int], ...]] = {
    DecoderForCausalLM: decoder.STACKED_PARAMS,
    DeepseekV3ForCausalLM: deepseek_v3.STACKED_PARAMS,
}


def build_meta_model(cfg: ModelConfig, device: torch.device,
                     make_linear: LinearFactory = dense_linear,
                     par: ParallelContext = SINGLE_RANK) -> CausalLM:
    """The model with every parameter on the meta device (no memory), ready for the loader;
    under tensor parallelism rank `par.rank`'s (cfg: that rank's `shard_model_config`)."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; "
                         f"supported: {', '.join(MODEL_CLASSES)}")
    with torch.device("meta"):
        return cls(cfg, make_linear, device, par)
