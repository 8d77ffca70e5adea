"""Which attention a layer runs: one backend per cache layout, chosen once per model.

A paged cache holds, per layer, either per-head K/V (`[2, num_blocks, block_size, kv_heads,
head_dim]`, attention.py) or MLA's latent rows (`[num_blocks, block_size, R + P]`,
latent_attention.py); `ModelConfig.kv_layer_shape` gives the shape. Each layout is a
`KvLayout`: its attention backend on each kind of device, and how its slots are copied
(speculative KV compaction):

    layout     on CUDA (Triton kernels)                 on the CPU (torch, the metadata's groups)
    PER_HEAD   kernels/tree_attention.py                attention.paged_attention_cpu
    LATENT     kernels/mla_attention.py, every row      per query group: expanded when causal
               absorbed (q_nope·W_UK in, ·W_UV out)     with >= 16 rows a sequence, else absorbed

`KvLayout.attention(device)` is the one choice (`attention.uses_kernels`, which also decides
whether the metadata carries CPU groups). A model makes it in its constructor
(causal_lm.CausalLM, for the device it runs on) and hands the backend to every attention
layer, which calls its `store` and `attend` and never looks at the device; the EAGLE-3 head
does the same for its per-head cache (workers/spec/draft_model.py). Backends hold no state
but an immutable setting, so one instance serves every layer and model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from specd.workers.runner.attention import (
    AttentionMetadata,
    QueryGroup,
    copy_kv_slots,
    paged_attention_cpu,
    store_kv,
    uses_kernels,
)
from specd.workers.runner.latent_attention import (
    LatentProjections,
    absorbed_group,
    copy_latent_slots,
    expanded_group,
    store_latent,
)

# CPU: causal query groups with at least this many rows per sequence take the expanded path.
EXPAND_MIN_QUERY_LEN = 16


class PerHeadAttention(ABC):
    """Paged attention over a per-head K/V cache layer [2, num_blocks, block_size, kv_heads,
    head_dim], with attention.py's visibility (prefix, then causal or tree bits)."""

    def store(self, k: torch.Tensor, v: torch.Tensor, kv_cache_layer: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Write this step's k, v [N, kv_heads, head_dim] into their slots (before attend)."""
        store_kv(k, v, kv_cache_layer, slot_mapping)

    @abstractmethod
    def attend(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """q [N, num_heads, head_dim] -> [N, num_heads, head_dim]; head h reads KV head
        h // (num_heads / kv_heads)."""


class TritonPerHeadAttention(PerHeadAttention):
    def attend(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        from specd.kernels.tree_attention import tree_attention

        return tree_attention(q, kv_cache_layer[0], kv_cache_layer[1], meta.block_tables,
                              meta.seq_lens, meta.query_start_loc, meta.tree_mask, scale,
                              meta.max_query_len, max_seq_len=meta.max_seq_len)


class TorchPerHeadAttention(PerHeadAttention):
    def attend(self, q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        return paged_attention_cpu(q, kv_cache_layer, meta, scale)


class LatentAttention(ABC):
    """Paged attention over MLA's latent cache layer [num_blocks, block_size, R + P]
    (latent_attention.py), with the per-head path's visibility."""

    def store(self, latent: torch.Tensor, kv_cache_layer: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Write this step's latent rows [N, R + P] into their slots (before attend)."""
        store_latent(latent, kv_cache_layer, slot_mapping)

    @abstractmethod
    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache_layer: torch.Tensor,
               meta: AttentionMetadata, scale: float, mla: LatentProjections) -> torch.Tensor:
        """q_nope [N, H, nope], q_pe [N, H, P] (roped) -> [N, H, v], through the layer's
        projections `mla`."""


class TritonLatentAttention(LatentAttention):
    """Every row absorbed, attended by the Triton kernel (its docstring states the contract)."""

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache_layer: torch.Tensor,
               meta: AttentionMetadata, scale: float, mla: LatentProjections) -> torch.Tensor:
        from specd.kernels.mla_attention import mla_attention

        out = mla_attention(mla.absorb(q_nope), q_pe, kv_cache_layer, meta.block_tables,
                            meta.seq_lens, meta.query_start_loc, meta.tree_mask, scale,
                            meta.max_query_len, max_seq_len=meta.max_seq_len)
        return mla.unabsorb(out)


@dataclass(frozen=True)
class TorchLatentAttention(LatentAttention):
    """One attention per CPU query group: expanded for causal groups of at least
    `expand_min_query_len` rows per sequence (prefill), absorbed otherwise (decode, tree
    verification, short chunks)."""

    expand_min_query_len: int = EXPAND_MIN_QUERY_LEN

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache_layer: torch.Tensor,
               meta: AttentionMetadata, scale: float, mla: LatentProjections) -> torch.Tensor:
        if not meta.groups:
            raise ValueError("attention metadata has no CPU groups (it was built for CUDA)")
        if len(meta.groups) == 1 and meta.groups[0].is_all_rows:
            return self._attend_group(q_nope, q_pe, kv_cache_layer, meta.groups[0], meta,
                                      scale, mla)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], mla.v_dim)
        for group in meta.groups:
            out[group.rows] = self._attend_group(q_nope[group.rows], q_pe[group.rows],
                                                 kv_cache_layer, group, meta, scale, mla)
        return out

    def _attend_group(self, q_nope: torch.Tensor, q_pe: torch.Tensor,
                      kv_cache_layer: torch.Tensor, group: QueryGroup, meta: AttentionMetadata,
                      scale: float, mla: LatentProjections) -> torch.Tensor:
        # A group's stage_plan (the per-head CPU decode's kept K/V) is ignored: latents are
        # gathered from the cache every step.
        if meta.tree_mask is None and group.num_query_rows >= self.expand_min_query_len:
            return expanded_group(q_nope, q_pe, kv_cache_layer, group, scale, mla)
        out = absorbed_group(mla.absorb(q_nope), q_pe, kv_cache_layer, group, scale)
        return mla.unabsorb(out)


BackendT = TypeVar("BackendT", PerHeadAttention, LatentAttention)


@dataclass(frozen=True)
class KvLayout(Generic[BackendT]):
    """One paged-cache layout: its attention backend per kind of device, and how its slots
    are copied (every layer's slots `src` to `dst`, int64 [M] each)."""

    name: str
    on_cuda: BackendT  # the Triton kernels
    on_cpu: BackendT  # the torch paths (the engine runs on cpu or cuda)
    copy_slots: Callable[[Sequence[torch.Tensor], torch.Tensor, torch.Tensor], None]

    def attention(self, device: torch.device) -> BackendT:
        """The backend a model on `device` runs (module docstring)."""
        return self.on_cuda if uses_kernels(device) else self.on_cpu


PER_HEAD: KvLayout[PerHeadAttention] = KvLayout(
    "per-head K/V", TritonPerHeadAttention(), TorchPerHeadAttention(), copy_kv_slots)
LATENT: KvLayout[LatentAttention] = KvLayout(
    "MLA latent rows", TritonLatentAttention(), TorchLatentAttention(), copy_latent_slots)
