"""DeepSeek-V3 / Kimi-K2: multi-head latent attention (MLA) over a paged latent cache, and
mixture-of-experts layers after the first dense ones.

Module names follow the checkpoints (`model.layers.{i}.self_attn.kv_b_proj`, ...,
`model.layers.{i}.mlp.experts.{e}.gate_proj`) except that gate/up are fused into
`gate_up_proj` (STACKED_PARAMS) and the routed experts are stacked (workers/models/moe.py).

The paged cache holds, per layer, one row per token: `[num_blocks, block_size,
kv_lora_rank + qk_rope_head_dim]` = [kv_a_layernorm(c_kv) ‖ rope(k_pe)], shared by every
head (`ModelConfig.kv_layer_shape`), never the expanded K/V. Attention reads it two ways,
with the same softmax scale (rope.mla_softmax_scale) and the same visibility
(AttentionMetadata: prefix plus causal or tree bits):

* expanded (CPU prefill groups of at least `expand_min_query_len` causal rows): the
  sequence's latents are up-projected with kv_b_proj to per-head k_nope and v, k_pe is
  broadcast over heads, and ordinary attention runs with q/k dim nope + rope, v dim v_head_dim;
* absorbed (decode, tree verification, short chunks; every row on CUDA): q_nope·W_UK gives
  a latent query per head, attention runs over [c ‖ k_pe] with V = c (one KV head), and
  the result·W_UV per head goes to o_proj. W_UK and W_UV are split from kv_b_proj at load
  (`split_kv_b`).

Tensor parallelism (workers/parallel/): a rank builds the model from its own `ModelConfig`
(`shard_model_config`): its query heads (q_b_proj, kv_b_proj and o_proj split by head, the
latent projections and the latent cache whole on every rank), its part of the dense MLP and
of each expert's width; or with expert parallelism whole experts (`ExpertParallelMoE`).
The attention block's and the MLP/MoE block's outputs are all-reduced once each (routed
and shared experts summed first); the embedding is vocab-parallel, the logits gathered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory, RMSNorm, RotaryEmbedding, apply_rotary
from specd.workers.models.moe import GatedMLP, MoE
from specd.workers.models.rope import apply_rotary_interleaved, mla_softmax_scale
from specd.workers.parallel.context import SINGLE_RANK, ParallelContext
from specd.workers.parallel.expert_parallel import ExpertParallelMoE
from specd.workers.parallel.vocab import make_embedding
from specd.workers.runner.attention import AttentionMetadata, QueryGroup

# (fused module, checkpoint module, shard index), as decoder.STACKED_PARAMS.
STACKED_PARAMS = (
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# CPU: causal query groups with at least this many rows per sequence take the expanded path.
EXPAND_MIN_QUERY_LEN = 16
# transformers and DeepSeek's code build q_a_layernorm and kv_a_layernorm with the default
# eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def store_latent(latent: torch.Tensor, kv_cache_layer: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write this step's latents [N, kv_lora_rank + rope] into their slots."""
    kv_cache_layer.view(-1, latent.shape[-1]).index_copy_(0, slot_mapping, latent)


def mla_attention_cuda(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache_layer: torch.Tensor,
                       meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Absorbed attention of every row with the Triton kernel: q_latent [N, H, R], q_pe
    [N, H, P] -> [N, H, R] (kernels/mla_attention.py states the contract)."""
    from specd.kernels.mla_attention import mla_attention

    return mla_attention(q_latent, q_pe, kv_cache_layer, meta.block_tables, meta.seq_lens,
                         meta.query_start_loc, meta.tree_mask, scale, meta.max_query_len,
                         max_seq_len=meta.max_seq_len)


def latent_attention_group(q_latent: torch.Tensor, q_pe: torch.Tensor,
                           kv_cache_layer: torch.Tensor, group: QueryGroup,
                           scale: float) -> torch.Tensor:
    """Absorbed attention of one CPU query group (the role of kernels/mla_attention.py's
    `mla_attention_ref`): q_latent [G * T, H, R], q_pe [G * T, H, P] -> [G * T, H, R].

    One KV head: each sequence's T * H (token, head) rows attend its gathered latent rows
    [S_pad, R + P] as keys and their first R values as values, in one masked SDPA.
    """
    g, t = group.num_seqs, group.num_query_rows
    heads, rank = q_latent.shape[1:]
    latents = _gather(kv_cache_layer, group)  # [G, S_pad, R + P]
    q = torch.cat((q_latent, q_pe), dim=-1).view(g, t * heads, -1)  # rows (token, head)
    width = latents.shape[1]
    mask = group.mask[:, 0, :, None, :].expand(g, t, heads, width).reshape(g, t * heads, width)
    out = F.scaled_dot_product_attention(q, latents, latents[..., :rank], attn_mask=mask,
                                         scale=scale)  # [G, T * H, R]
    return out.reshape(g * t, heads, rank)


def _gather(kv_cache_layer: torch.Tensor, group: QueryGroup) -> torch.Tensor:
    """The group's latent rows, whole blocks: [G, max_blocks * block_size, R + P]."""
    blocks = kv_cache_layer.index_select(0, group.key_blocks)
    return blocks.view(group.num_seqs, -1, kv_cache_layer.shape[-1])


class MlaAttention(nn.Module):
    """x [N, hidden] -> [N, hidden]; writes the rows' latents into the layer's cache."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    def __init__(self, cfg: ModelConfig, prefix: str, make_linear: LinearFactory) -> None:
        super().__init__()
        mla = cfg.mla
        if mla is None:
            raise ValueError(f"{cfg.architecture}: MLA attention needs an MlaConfig")
        self.num_heads, self.rank, self.v_dim = cfg.num_heads, mla.kv_lora_rank, mla.v_head_dim
        self.nope, self.rope = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.scale = mla_softmax_scale(mla.qk_head_dim, cfg.rope_scaling)
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary
        self.expand_min_query_len = EXPAND_MIN_QUERY_LEN
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

    def split_kv_b(self) -> None:
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
        store_latent(torch.cat((self.kv_a_layernorm(c), k_pe), dim=-1), kv_cache,
                     meta.slot_mapping)
        out = self._attend(q_nope, q_pe, kv_cache, meta)  # [N, H, v]
        return self.o_proj(out.reshape(n, self.num_heads * self.v_dim))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> q [N, H * (nope + rope)]."""
        if self.has_q_lora:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q_nope [N, H, nope], q_pe [N, H, P] (roped) -> [N, H, v]: the Triton kernel on
        CUDA, one expanded or absorbed attention per query group on the CPU."""
        if q_nope.is_cuda:
            q_latent = self._absorb(q_nope)
            return self._unabsorb(mla_attention_cuda(q_latent, q_pe, kv_cache, meta, self.scale))
        if not meta.groups:
            raise ValueError("attention metadata has no CPU groups (it was built for CUDA)")
        if len(meta.groups) == 1 and meta.groups[0].is_all_rows:
            return self._attend_group(q_nope, q_pe, kv_cache, meta.groups[0], meta)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        for group in meta.groups:
            out[group.rows] = self._attend_group(q_nope[group.rows], q_pe[group.rows],
                                                 kv_cache, group, meta)
        return out

    def _attend_group(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      group: QueryGroup, meta: AttentionMetadata) -> torch.Tensor:
        # A group's stage_plan (the dense CPU decode's kept K/V) is ignored: latents are
        # gathered from the cache every step.
        if meta.tree_mask is None and group.num_query_rows >= self.expand_min_query_len:
            return self._expanded(q_nope, q_pe, kv_cache, group)
        out = latent_attention_group(self._absorb(q_nope), q_pe, kv_cache, group, self.scale)
        return self._unabsorb(out)

    def _absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [N, H, nope] -> the latent query q_nope·W_UK per head [N, H, R]."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)

    def _unabsorb(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space [N, H, R] -> per-head values [N, H, v] (W_UV)."""
        return torch.bmm(out_latent.transpose(0, 1), self.w_uv).transpose(0, 1)

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  group: QueryGroup) -> torch.Tensor:
        """Ordinary attention of one group over its up-projected latents -> [G * T, H, v]."""
        g, t, heads = group.num_seqs, group.num_query_rows, self.num_heads
        latents = _gather(kv_cache, group)  # [G, S_pad, R + P]
        width = latents.shape[1]
        c, k_pe = latents.split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c).view(g, width, heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [G, S_pad, H, *]
        k = torch.cat((k_nope, k_pe[:, :, None, :].expand(g, width, heads, self.rope)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).view(g, t, heads, -1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=group.mask,
                                             scale=self.scale)  # [G, H, T, v]
        return out.transpose(1, 2).reshape(g * t, heads, self.v_dim)


class DecoderLayer(nn.Module):
    """x += MLA(norm(x)); x += MLP(norm(x)), the MLP dense or MoE (MoeConfig.is_moe_layer)."""

    def __init__(self, cfg: ModelConfig, layer: int, make_linear: LinearFactory,
                 par: ParallelContext) -> None:
        super().__init__()
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: needs a MoeConfig")
        prefix = f"model.layers.{layer}"
        self.par = par
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MlaAttention(cfg, f"{prefix}.self_attn", make_linear)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module
        if not cfg.moe.is_moe_layer(layer):
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, f"{prefix}.mlp",
                                make_linear)
        elif par.expert_parallel:
            self.mlp = ExpertParallelMoE(cfg.moe, cfg.hidden_size, f"{prefix}.mlp", make_linear,
                                         par)
        else:
            self.mlp = MoE(cfg.moe, cfg.hidden_size, f"{prefix}.mlp", make_linear)

    def forward(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """h: the residual stream [N, hidden] -> the block's output, same shape."""
        # Row-parallel o_proj, down_proj and experts leave partial sums: one all-reduce each
        # (a MoE block's routed and shared outputs are summed before it).
        h = h + self.par.all_reduce(self.self_attn(self.input_layernorm(h), cos_sin, kv_cache,
                                                   meta))
        return h + self.par.all_reduce(self.mlp(self.post_attention_layernorm(h)))


class DeepseekV3Model(nn.Module):
    """Embedding, the blocks and the final norm (transformers' `model.` submodule)."""

    def __init__(self, cfg: ModelConfig, make_linear: LinearFactory,
                 par: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size, par)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, make_linear, par) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """The whole model, with DecoderForCausalLM's interface (forward, embed_tokens,
    compute_logits). Build it under `torch.device("meta")`, fill it with the loader, which
    then calls `process_weights_after_loading`. The rotary frequencies (over
    qk_rope_head_dim, YaRN included) live on `device`. `par`: the rank's place under tensor
    parallelism, `cfg` then the rank's own config (module docstring)."""

    def __init__(self, cfg: ModelConfig, make_linear: LinearFactory,
                 device: torch.device, par: ParallelContext = SINGLE_RANK) -> None:
        super().__init__()
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture}: DeepseekV3ForCausalLM needs an MlaConfig")
        self.config = cfg
        self.par = par
        self.model = DeepseekV3Model(cfg, make_linear, par)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else make_linear(cfg.hidden_size, cfg.vocab_size // par.world_size,
                                         False, ("lm_head",)))
        self.rotary = RotaryEmbedding(cfg.mla.qk_rope_head_dim, cfg.rope_theta,
                                      cfg.rope_scaling, device)

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, MlaAttention):
                module.split_kv_b()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], meta: AttentionMetadata,
                capture_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions int64 [N], kv_caches one latent layer each
        (`ModelConfig.kv_layer_shape`) -> (hidden [N, hidden] after the final norm, aux
        [N, len(capture_layers) * hidden] or None), capture_layers numbered as in
        DecoderForCausalLM.forward (0 = embeddings, k = after block k - 1)."""
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
        """Copy the latent rows of cache slots `src_slots` to `dst_slots` (int64 [M] each,
        slot = block * block_size + offset) in every layer [blocks, block_size, latent]."""
        for layer in kv_caches:
            flat = layer.view(-1, layer.shape[-1])  # [slots, kv_lora_rank + rope]
            flat[dst_slots] = flat[src_slots]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] (after the final norm) -> logits [M, vocab] (every rank's
        vocabulary range gathered)."""
        if self.lm_head is None:
            return self.par.gather_last(F.linear(hidden, self.model.embed_tokens.weight))
        return self.par.gather_last(self.lm_head(hidden))
