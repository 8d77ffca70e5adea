"""Paged attention over MLA's latent cache: the torch paths (the CPU's).

Cache layout, per layer: `[num_blocks, block_size, R + P]` (R = kv_lora_rank, P =
qk_rope_head_dim), one row per token = [kv_a_layernorm(c_kv) ‖ rope(k_pe)], shared by every
head (`ModelConfig.kv_layer_shape`), never the expanded K/V; slots as in attention.py.
Visibility is the per-head path's (AttentionMetadata: prefix plus causal or tree bits), and
the queries arrive per head as q_nope [N, H, nope] and the roped q_pe [N, H, P].

Two ways to attend one CPU query group, with the same softmax scale:

* absorbed (`absorbed_group`): q_nope·W_UK gives a latent query per head, attention runs over
  [c ‖ k_pe] with V = c (one KV head), and the result·W_UV per head is the output; the role
  of kernels/mla_attention.py's `mla_attention_ref`, and of the kernel on CUDA;
* expanded (`expanded_group`): the group's latents are up-projected with kv_b_proj to
  per-head k_nope and v, k_pe is broadcast over heads, and ordinary attention runs with q/k
  dim nope + P, v dim v_head_dim.

The projections (W_UK, W_UV, kv_b_proj) are the layer's, reached through `LatentProjections`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from specd.workers.runner.attention import QueryGroup


class LatentProjections(Protocol):
    """What latent attention needs of an MLA layer: its heads' value width and projections."""

    v_dim: int  # v_head_dim

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [N, H, nope] -> the latent query q_nope·W_UK per head [N, H, R]."""
        ...

    def unabsorb(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space [N, H, R] -> per-head values [N, H, v] (W_UV)."""
        ...

    def expand(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents c [G, S, R] -> (k_nope [G, S, H, nope], v [G, S, H, v]) (kv_b_proj)."""
        ...


def store_latent(latent: torch.Tensor, kv_cache_layer: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write this step's latents [N, kv_lora_rank + rope] into their slots."""
    kv_cache_layer.view(-1, latent.shape[-1]).index_copy_(0, slot_mapping, latent)


def copy_latent_slots(kv_caches: Sequence[torch.Tensor], src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
    """Copy the latent rows of cache slots `src_slots` to `dst_slots` (int64 [M] each,
    slot = block * block_size + offset) in every layer [blocks, block_size, latent]."""
    for layer in kv_caches:
        flat = layer.view(-1, layer.shape[-1])  # [slots, kv_lora_rank + rope]
        flat[dst_slots] = flat[src_slots]


def absorbed_group(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache_layer: torch.Tensor,
                   group: QueryGroup, scale: float) -> torch.Tensor:
    """Absorbed attention of one CPU query group: q_latent [G * T, H, R], q_pe [G * T, H, P]
    -> [G * T, H, R].

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


def expanded_group(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache_layer: torch.Tensor,
                   group: QueryGroup, scale: float, mla: LatentProjections) -> torch.Tensor:
    """Ordinary attention of one group over its up-projected latents: q_nope [G * T, H,
    nope], q_pe [G * T, H, P] -> [G * T, H, v]."""
    g, t = group.num_seqs, group.num_query_rows
    heads, rope = q_pe.shape[1:]
    latents = _gather(kv_cache_layer, group)  # [G, S_pad, R + P]
    width = latents.shape[1]
    c, k_pe = latents.split([latents.shape[-1] - rope, rope], dim=-1)
    k_nope, v = mla.expand(c)  # [G, S_pad, H, *]
    k = torch.cat((k_nope, k_pe[:, :, None, :].expand(g, width, heads, rope)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1).view(g, t, heads, -1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=group.mask,
                                         scale=scale)  # [G, H, T, v]
    return out.transpose(1, 2).reshape(g * t, heads, mla.v_dim)


def _gather(kv_cache_layer: torch.Tensor, group: QueryGroup) -> torch.Tensor:
    """The group's latent rows, whole blocks: [G, max_blocks * block_size, R + P]."""
    blocks = kv_cache_layer.index_select(0, group.key_blocks)
    return blocks.view(group.num_seqs, -1, kv_cache_layer.shape[-1])
