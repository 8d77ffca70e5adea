"""One decoder for the Llama family: Llama (incl. Llama-3 rope scaling, tied embeddings),
Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm per head).

The architectures differ only in flags of `ModelConfig` (`qkv_bias`, `o_bias`, `qk_norm`,
`rope_scaling`, `tie_word_embeddings`), so one block serves them all. Module names follow
the checkpoints (`model.layers.{i}.self_attn...`) except that q/k/v are fused into `qkv_proj`
and gate/up into `gate_up_proj`; `STACKED_PARAMS` tells the loader how the shards map.

Tokens from every sequence of a step are one flat batch `[N, ...]`; attention reads and
writes the paged KV cache through `AttentionMetadata`.

Tensor parallelism (workers/parallel/): a rank builds the model from its own `ModelConfig`
(`shard_model_config`: its heads, K/V heads and MLP width), so the blocks are unchanged;
each block's output is all-reduced (`ParallelContext.all_reduce`, nothing at size 1), the
embedding is vocab-parallel and the logits are gathered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory, RMSNorm, RotaryEmbedding, apply_rotary
from specd.workers.parallel.context import SINGLE_RANK, ParallelContext
from specd.workers.parallel.vocab import make_embedding
from specd.workers.runner.attention import AttentionMetadata, paged_attention, store_kv

# (fused module, checkpoint module, shard index): how checkpoint tensors stack into fused ones.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, make_linear: LinearFactory) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.shard_sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        self.qkv_proj = make_linear(cfg.hidden_size, sum(self.shard_sizes), cfg.qkv_bias,
                                    tuple(f"{prefix}.{n}_proj" for n in "qkv"))
        self.o_proj = make_linear(cfg.q_size, cfg.hidden_size, cfg.o_bias, (f"{prefix}.o_proj",))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project(x, cos_sin)
        store_kv(k, v, kv_cache, meta.slot_mapping)
        out = paged_attention(q, kv_cache, meta, self.scale)  # [N, heads, head_dim]
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))

    def project(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> q [N, heads, d], k and v [N, kv_heads, d] (normed, rotated)."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.shard_sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin), v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, make_linear: LinearFactory) -> None:
        super().__init__()
        self.shard_sizes = (cfg.intermediate_size, cfg.intermediate_size)
        self.gate_up_proj = make_linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias,
                                        (f"{prefix}.gate_proj", f"{prefix}.up_proj"))
        self.down_proj = make_linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias,
                                     (f"{prefix}.down_proj",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, make_linear: LinearFactory,
                 par: ParallelContext) -> None:
        super().__init__()
        self.par = par
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", make_linear)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, f"{prefix}.mlp", make_linear)

    def forward(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """h: the residual stream [N, hidden] -> the block's output, same shape."""
        # Row-parallel o_proj and down_proj leave partial sums: one all-reduce each.
        h = h + self.par.all_reduce(self.self_attn(self.input_layernorm(h), cos_sin, kv_cache,
                                                   meta))
        return h + self.par.all_reduce(self.mlp(self.post_attention_layernorm(h)))


class DecoderModel(nn.Module):
    """Embedding, the blocks and the final norm (transformers' `model.` submodule)."""

    def __init__(self, cfg: ModelConfig, make_linear: LinearFactory,
                 par: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size, par)
        self.layers = nn.ModuleList(DecoderLayer(cfg, f"model.layers.{i}", make_linear, par)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """The whole model. Build it under `torch.device("meta")` and fill it with the loader.

    `device` is where the rotary frequencies live (they are no parameter and are computed
    here, so that a meta build does not lose them). `par`: the rank's place under tensor
    parallelism, `cfg` then the rank's own config (module docstring).
    """

    def __init__(self, cfg: ModelConfig, make_linear: LinearFactory,
                 device: torch.device, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        self.config = cfg
        self.par = par
        self.model = DecoderModel(cfg, make_linear, par)
        # A tied model has no lm_head of its own: logits use the embedding matrix. Under
        # tensor parallelism each rank's lm_head holds its vocabulary range (column-parallel).
        self.lm_head = (None if cfg.tie_word_embeddings
                        else make_linear(cfg.hidden_size, cfg.vocab_size // par.world_size,
                                         False, ("lm_head",)))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], meta: AttentionMetadata,
                capture_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions int64 [N] -> (hidden [N, hidden] after the final norm,
        aux [N, len(capture_layers) * hidden] or None).

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

    @staticmethod
    def copy_kv_slots(kv_caches: Sequence[torch.Tensor], src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
        """Copy the K and V of cache slots `src_slots` to `dst_slots` (int64 [M] each, slot =
        block * block_size + offset) in every layer [2, blocks, block_size, kv_heads, d]."""
        for layer in kv_caches:
            flat = layer.view(2, -1, *layer.shape[-2:])  # [2, slots, kv_heads, d]
            flat[:, dst_slots] = flat[:, src_slots]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] (after the final norm) -> logits [M, vocab] (every rank's
        vocabulary range gathered)."""
        if self.lm_head is None:
            return self.par.gather_last(F.linear(hidden, self.model.embed_tokens.weight))
        return self.par.gather_last(self.lm_head(hidden))
