"""Model registry: architecture name (config.json's `architectures[0]`) -> model class.

Every class is a `CausalLM` (workers/models/causal_lm.py, the shell and its interface:
`forward`, `embed_tokens`, `compute_logits`, `copy_kv_slots`, `config`, `model.layers`,
`process_weights_after_loading`) over paged cache layers of `ModelConfig.kv_layer_shape`.
The Llama family (Llama, Mistral, Qwen2, Qwen3) is served by the dense decoder; DeepSeek-V3 /
Kimi-K2 by the MLA + MoE model. A new architecture is its own module and a line here
(docs/architecture.md, "Adding an architecture"); config.py's SUPPORTED_ARCHITECTURES names
what `ModelConfig` parses, and the registry serves exactly those.
"""

from __future__ import annotations

import torch

from specd.workers.models.causal_lm import CausalLM, StackedParams
from specd.workers.models.config import ModelConfig
from specd.workers.models.decoder import DecoderForCausalLM
from specd.workers.models.deepseek_v3 import DeepseekV3ForCausalLM
from specd.workers.models.layers import LinearFactory, dense_linear
from specd.workers.parallel.context import SINGLE_RANK, ParallelContext

__all__ = ["MODEL_CLASSES", "STACKED_PARAMS", "CausalLM", "build_meta_model"]

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "MistralForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}

# (fused module, checkpoint module, shard index) of each class: how checkpoint tensors stack.
STACKED_PARAMS: dict[type[CausalLM], StackedParams] = {
    cls: cls.stacked_params for cls in MODEL_CLASSES.values()}


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
