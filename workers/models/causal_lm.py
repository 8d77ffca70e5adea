"""The causal-LM shell every architecture shares; an architecture supplies its blocks.

    h = embed_tokens(input_ids)                          # vocab-parallel under TP
    for each layer:                                      # DecoderLayer
        h = h + all_reduce(self_attn(input_layernorm(h), cos_sin, kv_cache, meta))
        h = h + all_reduce(mlp(post_attention_layernorm(h)))
    hidden = norm(h); logits = lm_head(hidden) or hidden·embed_tokensᵀ (tied), gathered

An architecture is a subclass (decoder.py: the Llama family; deepseek_v3.py: MLA + MoE) that
declares its cache layout (`kv_layout`: attention_backend.PER_HEAD or LATENT) and the fused
checkpoint tensors the loader stacks (`stacked_params`), and makes, per layer, its attention
block (`make_attention`, given the layout's backend for the model's device) and its MLP or
MoE block (`make_mlp`), and names the rotary width (`rotary_dim`). The shell owns the rest:
embedding, the layer loop with the residual stream and the all-reduces, the final norm, the
logits, the hidden states captured for the EAGLE-3 head, the KV slot copy, and the hook after
loading.

Module names follow the checkpoints (`model.embed_tokens`, `model.layers.{i}.self_attn...`,
`model.layers.{i}.mlp...`, `model.norm`, `lm_head`): parameter names are checkpoint names,
save for the fusions `stacked_params` lists. A block's call contract:

    self_attn(x [N, hidden], cos_sin, kv_cache layer, meta) -> [N, hidden]   (writes the
        step's rows into kv_cache first; cos_sin: `RotaryEmbedding.cos_sin` of the positions)
    mlp(x [N, hidden]) -> [N, hidden]

Both outputs are partial sums under tensor parallelism (row-parallel o_proj, down_proj and
experts): the shell all-reduces each once (nothing at size 1). A rank builds its model from
its own `ModelConfig` (workers/parallel/sharding.py), so the blocks are one-process code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory, RMSNorm, RotaryEmbedding
from specd.workers.parallel.context import SINGLE_RANK, ParallelContext
from specd.workers.parallel.vocab import make_embedding
from specd.workers.runner.attention import AttentionMetadata
from specd.workers.runner.attention_backend import KvLayout

# (fused module, checkpoint module, shard index): how checkpoint tensors stack into fused ones.
StackedParams = tuple[tuple[str, str, int], ...]
AttentionT = TypeVar("AttentionT")


class DecoderLayer(nn.Module):
    """One pre-norm block over the residual stream (module docstring)."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module,
                 par: ParallelContext) -> None:
        super().__init__()
        self.par = par
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """h: the residual stream [N, hidden] -> the block's output, same shape."""
        h = h + self.par.all_reduce(self.self_attn(self.input_layernorm(h), cos_sin, kv_cache,
                                                   meta))
        return h + self.par.all_reduce(self.mlp(self.post_attention_layernorm(h)))


class DecoderModel(nn.Module):
    """Embedding, the blocks and the final norm (transformers' `model.` submodule)."""

    def __init__(self, cfg: ModelConfig, layers: list[DecoderLayer],
                 par: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size, par)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module, ABC, Generic[AttentionT]):
    """The whole model. Build it under `torch.device("meta")` and fill it with the loader,
    which then calls `process_weights_after_loading`.

    `device` is where the model runs: its attention backend is chosen from it (once, here)
    and the rotary frequencies live on it (they are no parameter and are computed here, so
    that a meta build does not lose them). `par`: the rank's place under tensor parallelism,
    `cfg` then the rank's own config.
    """

    kv_layout: ClassVar[KvLayout[Any]]
    stacked_params: ClassVar[StackedParams]

    def __init__(self, cfg: ModelConfig, make_linear: LinearFactory,
                 device: torch.device, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        self.config = cfg
        self.par = par
        attention: AttentionT = self.kv_layout.attention(device)
        layers = []
        for i in range(cfg.num_layers):
            prefix = f"model.layers.{i}"
            layers.append(DecoderLayer(
                cfg, self.make_attention(cfg, i, f"{prefix}.self_attn", make_linear, attention),
                self.make_mlp(cfg, i, f"{prefix}.mlp", make_linear, par), par))
        self.model = DecoderModel(cfg, layers, par)
        # A tied model has no lm_head of its own: logits use the embedding matrix. Under
        # tensor parallelism each rank's lm_head holds its vocabulary range (column-parallel).
        self.lm_head = (None if cfg.tie_word_embeddings
                        else make_linear(cfg.hidden_size, cfg.vocab_size // par.world_size,
                                         False, ("lm_head",)))
        self.rotary = RotaryEmbedding(self.rotary_dim(cfg), cfg.rope_theta, cfg.rope_scaling,
                                      device)

    # --- what an architecture supplies ---

    @abstractmethod
    def make_attention(self, cfg: ModelConfig, layer: int, prefix: str,
                       make_linear: LinearFactory, attention: AttentionT) -> nn.Module:
        """Layer `layer`'s attention block, its modules named under `prefix`; it attends
        through `attention`, the backend of `kv_layout` for the model's device."""

    @abstractmethod
    def make_mlp(self, cfg: ModelConfig, layer: int, prefix: str, make_linear: LinearFactory,
                 par: ParallelContext) -> nn.Module:
        """Layer `layer`'s MLP or MoE block, its modules named under `prefix`."""

    @staticmethod
    @abstractmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        """The width the rotary embedding turns (head_dim, or MLA's qk_rope_head_dim)."""

    # --- the interface the runner, backends, graphs, spec worker and TP use ---

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], meta: AttentionMetadata,
                capture_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions int64 [N], kv_caches one layer each of `kv_layout`
        (`ModelConfig.kv_layer_shape`) -> (hidden [N, hidden] after the final norm, aux
        [N, len(capture_layers) * hidden] or None).

        capture_layers uses transformers' `output_hidden_states` numbering: 0 is the
        embedding output, k is the residual stream after block k - 1 (before the final norm).
        """
        h = self.embed_tokens(input_ids)  # [N, hidden]
        cos_sin = self.rotary.cos_sin(positions, h.dtype)
        captured = [h] if 0 in capture_layers else []
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos_sin, kv_caches[i], meta)
            if i + 1 in capture_layers:
                captured.append(h)
        aux = torch.cat(captured, dim=-1) if capture_layers else None
        return self.model.norm(h), aux

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> embeddings [N, hidden]."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] (after the final norm) -> logits [M, vocab] (every rank's
        vocabulary range gathered)."""
        if self.lm_head is None:
            return self.par.gather_last(F.linear(hidden, self.model.embed_tokens.weight))
        return self.par.gather_last(self.lm_head(hidden))

    @classmethod
    def copy_kv_slots(cls, kv_caches: Sequence[torch.Tensor], src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
        """Copy what cache slots `src_slots` hold to `dst_slots` (int64 [M] each, slot =
        block * block_size + offset) in every layer, as `kv_layout` lays them out."""
        cls.kv_layout.copy_slots(kv_caches, src_slots, dst_slots)

    def process_weights_after_loading(self) -> None:
        """Once every parameter is loaded: each block with a `process_weights_after_loading`
        of its own derives what it keeps beside the checkpoint's tensors (MLA: W_UK, W_UV)."""
        for module in self.modules():
            finish = getattr(module, "process_weights_after_loading", None)
            if module is not self and finish is not None:
                finish()
