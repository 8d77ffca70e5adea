"""Model registry: architecture name (config.json's `architectures[0]`) -> model class.

Every supported architecture is served by the one Llama-family decoder; a new family adds a
module here and a line to `MODEL_CLASSES`.
"""

from __future__ import annotations

import torch

from specd.workers.layers import LinearFactory, dense_linear
from specd.workers.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from specd.workers.models.decoder import DecoderForCausalLM

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    name: DecoderForCausalLM for name in SUPPORTED_ARCHITECTURES
}


def build_meta_model(cfg: ModelConfig, device: torch.device,
                     make_linear: LinearFactory = dense_linear) -> DecoderForCausalLM:
    """The model with every parameter on the meta device (no memory), ready for the loader."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; "
                         f"supported: {', '.join(MODEL_CLASSES)}")
    with torch.device("meta"):
        return cls(cfg, make_linear, device)
