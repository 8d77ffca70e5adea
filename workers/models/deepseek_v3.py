"""DeepSeek-V3 / Kimi-K2 on the causal-LM shell: multi-head latent attention (MLA) over a
paged latent cache, and mixture-of-experts layers after the first dense ones.

Module names follow the checkpoints (`model.layers.{i}.self_attn.kv_b_proj`, ...,
`model.layers.{i}.mlp.experts.{e}.gate_proj`) except that gate/up are fused into
`gate_up_proj` (STACKED_PARAMS) and the routed experts are stacked (workers/models/moe.py).

The cache holds one latent row per token, [kv_a_layernorm(c_kv) ‖ rope(k_pe)], shared by
every head (attention_backend.LATENT; workers/runner/latent_attention.py states the layout
and the two ways to attend it, expanded and absorbed). The layer projects q and the latent,
writes the latent, and hands the backend its projections: W_UK and W_UV, split from
kv_b_proj at load (`process_weights_after_loading`), for the absorbed path, and kv_b_proj
itself for the expanded one. The softmax scale is rope.mla_softmax_scale.

Tensor parallelism (workers/parallel/): a rank's config holds its query heads (q_b_proj,
kv_b_proj and o_proj split by head, the latent projections and the latent cache whole on
every rank), its part of the dense MLP and of each expert's width; or with expert
parallelism whole experts (`ExpertParallelMoE`). A MoE block sums its routed and shared
experts before the shell's all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from specd.workers.models.causal_lm import CausalLM, StackedParams
from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory, RMSNorm, apply_rotary
from specd.workers.models.moe import GatedMLP, MoE
from specd.workers.models.rope import apply_rotary_interleaved, mla_softmax_scale
from specd.workers.parallel.context import SINGLE_RANK, ParallelContext
from specd.workers.parallel.expert_parallel import ExpertParallelMoE
from specd.workers.runner.attention import AttentionMetadata
from specd.workers.runner.attention_backend import LATENT, LatentAttention

# (fused module, checkpoint module, shard index), as decoder.STACKED_PARAMS.
STACKED_PARAMS: StackedParams = (
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# transformers and DeepSeek's code build q_a_layernorm and kv_a_layernorm with the default
# eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MlaAttention(nn.Module):
    """x [N, hidden] -> [N, hidden]; writes the rows' latents into the layer's cache first.
    Its `absorb`, `unabsorb` and `expand` are latent_attention.LatentProjections."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    def __init__(self, cfg: ModelConfig, prefix: str, make_linear: LinearFactory,
                 attention: LatentAttention) -> None:
        super().__init__()
        self.attention = attention
        mla = cfg.mla
        if mla is None:
            raise ValueError(f"{cfg.architecture}: MLA attention needs an MlaConfig")
        self.num_heads, self.rank, self.v_dim = cfg.num_heads, mla.kv_lora_rank, mla.v_head_dim
        self.nope, self.rope = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.scale = mla_softmax_scale(mla.qk_head_dim, cfg.rope_scaling)
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary
        hidden, q_size, bias = cfg.hidden_size, cfg.num_heads * mla.qk_head_dim, mla.attention_bias
        self.has_q_lora = mla.q_lora_rank is not None
        if mla.q_lora_rank is None:
            self.q_proj = make_linear(hidden, q_size, False, (f"{prefix}.q_proj",))
        else:
            self.q_a_proj = make_linear(hidden, mla.q_lora_rank, bias, (f"{prefix}.q_a_proj",))
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = make_linear(mla.q_lora_rank, q_size, False, (f"{prefix}.q_b_proj",))
        self.kv_a_proj_with_mqa = make_linear(hidden, mla.latent_size, bias,
                                              (f"{prefix}.kv_a_proj_with_mqa",))
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = make_linear(self.rank, cfg.num_heads * (self.nope + self.v_dim), False,
                                     (f"{prefix}.kv_b_proj",))
        if not isinstance(getattr(self.kv_b_proj, "weight", None), torch.Tensor):
            raise ValueError(f"{prefix}.kv_b_proj is INT4 under the checkpoint's "
                             "quantization_config; its weight is split into W_UK and W_UV at "
                             "load, so it must stay dense (name it in the ignore list)")
        self.o_proj = make_linear(cfg.num_heads * self.v_dim, hidden, bias, (f"{prefix}.o_proj",))
        # The absorbed projections, split from kv_b_proj at load (not checkpoint tensors).
        self.register_buffer("w_uk", torch.empty(self.num_heads, self.nope, self.rank),
                             persistent=False)  # [H, nope, R]
        self.register_buffer("w_uv", torch.empty(self.num_heads, self.rank, self.v_dim),
                             persistent=False)  # [H, R, v]

    def process_weights_after_loading(self) -> None:
        """W_UK and W_UV from the loaded kv_b_proj, whose rows are per head [k_nope; v]."""
        weight = getattr(self.kv_b_proj, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError("kv_b_proj must be a dense linear (its weight is split at load)")
        per_head = weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        self.w_uk.copy_(per_head[:, :self.nope])
        self.w_uv.copy_(per_head[:, self.nope:].transpose(1, 2))

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if kv_cache.dim() != 3 or kv_cache.shape[-1] != self.rank + self.rope:
            raise ValueError(f"MLA needs a latent cache layer [num_blocks, block_size, "
                             f"{self.rank + self.rope}] (ModelConfig.kv_layer_shape), got "
                             f"{list(kv_cache.shape)}")
        n = x.shape[0]
        q_nope, q_pe = self._query(x).view(n, self.num_heads, -1).split([self.nope, self.rope],
                                                                      dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        q_pe = self.rotate(q_pe, *cos_sin)  # [N, H, P]
        k_pe = self.rotate(k_pe[:, None, :], *cos_sin)[:, 0]  # [N, P], one head for all
        self.attention.store(torch.cat((self.kv_a_layernorm(c), k_pe), dim=-1), kv_cache,
                             meta.slot_mapping)
        out = self.attention.attend(q_nope, q_pe, kv_cache, meta, self.scale, self)  # [N, H, v]
        return self.o_proj(out.reshape(n, self.num_heads * self.v_dim))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> q [N, H * (nope + rope)]."""
        if self.has_q_lora:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def expand(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents c [G, S, R] -> (k_nope [G, S, H, nope], v [G, S, H, v]) (kv_b_proj)."""
        kv = self.kv_b_proj(c).view(*c.shape[:-1], self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return k_nope, v

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [N, H, nope] -> the latent query q_nope·W_UK per head [N, H, R]."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)

    def unabsorb(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space [N, H, R] -> per-head values [N, H, v] (W_UV)."""
        return torch.bmm(out_latent.transpose(0, 1), self.w_uv).transpose(0, 1)


class DeepseekV3ForCausalLM(CausalLM[LatentAttention]):
    """DeepSeek-V3 / Kimi-K2's model (the shell's interface and contracts: causal_lm.py);
    the rotary embedding turns qk_rope_head_dim (YaRN included)."""

    kv_layout = LATENT
    stacked_params = STACKED_PARAMS

    def __init__(self, cfg: ModelConfig, make_linear: LinearFactory,
                 device: torch.device, par: ParallelContext = SINGLE_RANK) -> None:
        if cfg.mla is None or cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: DeepseekV3ForCausalLM needs an MlaConfig "
                             "and a MoeConfig")
        super().__init__(cfg, make_linear, device, par)

    def make_attention(self, cfg: ModelConfig, layer: int, prefix: str,
                       make_linear: LinearFactory, attention: LatentAttention) -> nn.Module:
        return MlaAttention(cfg, prefix, make_linear, attention)

    def make_mlp(self, cfg: ModelConfig, layer: int, prefix: str, make_linear: LinearFactory,
                 par: ParallelContext) -> nn.Module:
        """Dense for the first layers, then MoE (MoeConfig.is_moe_layer)."""
        moe = cfg.moe
        if moe is None:
            raise ValueError(f"{cfg.architecture}: needs a MoeConfig")
        if not moe.is_moe_layer(layer):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, prefix, make_linear)
        if par.expert_parallel:
            return ExpertParallelMoE(moe, cfg.hidden_size, prefix, make_linear, par)
        return MoE(moe, cfg.hidden_size, prefix, make_linear)

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture}: needs an MlaConfig")
        return cfg.mla.qk_rope_head_dim
