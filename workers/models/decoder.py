"""The Llama family on the causal-LM shell: Llama (incl. Llama-3 rope scaling, tied
embeddings), Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm per head).

The architectures differ only in flags of `ModelConfig` (`qkv_bias`, `o_bias`, `qk_norm`,
`rope_scaling`, `tie_word_embeddings`), so one attention block and one MLP serve them all,
over a per-head K/V cache. Module names follow the checkpoints except that q/k/v are fused
into `qkv_proj` and gate/up into `gate_up_proj`; `STACKED_PARAMS` tells the loader how the
shards map. Under tensor parallelism a rank's config holds its heads, K/V heads and MLP
width (workers/parallel/sharding.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.models.causal_lm import CausalLM, StackedParams
from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory, RMSNorm, apply_rotary
from specd.workers.parallel.context import ParallelContext
from specd.workers.runner.attention import AttentionMetadata
from specd.workers.runner.attention_backend import PER_HEAD, PerHeadAttention

STACKED_PARAMS: StackedParams = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class Attention(nn.Module):
    """x [N, hidden] -> [N, hidden]; writes the rows' K/V into the layer's cache first."""

    def __init__(self, cfg: ModelConfig, prefix: str, make_linear: LinearFactory,
                 attention: PerHeadAttention) -> None:
        super().__init__()
        self.attention = attention
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
        self.attention.store(k, v, kv_cache, meta.slot_mapping)
        out = self.attention.attend(q, kv_cache, meta, self.scale)  # [N, heads, head_dim]
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))

    def project(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> q [N, heads, d], k and v [N, kv_heads, d] (normed, rotated)."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is None or self.k_norm is None:
            # q's and k's heads side by side rotate in one pass (half the rotary's ops).
            qk_size = self.shard_sizes[0] + self.shard_sizes[1]
            qk = apply_rotary(qkv[:, :qk_size].reshape(n, -1, self.head_dim), *cos_sin)
            v = qkv[:, qk_size:].view(n, self.num_kv_heads, self.head_dim)
            return qk[:, :self.num_heads], qk[:, self.num_heads:], v
        q, k, v = qkv.split(self.shard_sizes, dim=-1)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        v = v.view(n, self.num_kv_heads, self.head_dim)
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


class DecoderForCausalLM(CausalLM[PerHeadAttention]):
    """The Llama family's model (the shell's interface and contracts: causal_lm.py)."""

    kv_layout = PER_HEAD
    stacked_params = STACKED_PARAMS

    def make_attention(self, cfg: ModelConfig, layer: int, prefix: str,
                       make_linear: LinearFactory, attention: PerHeadAttention) -> nn.Module:
        return Attention(cfg, prefix, make_linear, attention)

    def make_mlp(self, cfg: ModelConfig, layer: int, prefix: str, make_linear: LinearFactory,
                 par: ParallelContext) -> nn.Module:
        return MLP(cfg, prefix, make_linear)

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        return cfg.head_dim
