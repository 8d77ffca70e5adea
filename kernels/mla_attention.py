"""Absorbed MLA attention (DeepSeek-V3, Kimi-K2) over a paged latent cache, with draft-tree masks.

Memory layout (R = kv_lora_rank, P = qk_rope_head_dim; 512 and 64 for DeepSeek-V3 and Kimi-K2):

* kv_cache [num_blocks, block_size, R + P], one layer, any strides: one row per token, the
  normalized latent c (first R values) followed by the roped k_pe (last P values), shared by
  all heads (one KV head). Position p of sequence b lives at
  `[block_tables[b, p // block_size], p % block_size]`; this step's rows are written before
  attention, e.g. `kv_cache.view(-1, R + P).index_copy_(0, slot_mapping, cat([c, k_pe], -1))`.
* q_latent [N, H, R]: q_nope multiplied by W_UK per head (absorbed); q_pe [N, H, P]: roped.
  Two tensors with any strides, so that the caller passes its bmm output and a view of
  q_b_proj's output as they are, without concatenating them into [N, H, R + P].
* block_tables int32 [B, max_blocks], seq_lens int32 [B] (S_b, the KV length including the
  T_b new tokens), query_start_loc int32 [B + 1] (sequence b owns query rows
  `query_start_loc[b]:query_start_loc[b+1]`), tree_mask int64 [N] or None, max_query_len:
  exactly tree_attention's arguments, i.e. the fields of workers.attention.AttentionMetadata.
* out [N, H, R] in the queries' dtype: softmax(scores) . c, which the caller multiplies by
  W_UV per head.
* q_latent, q_pe and kv_cache share one dtype: bf16, fp16 or fp32 (fp32 takes IEEE products,
  not TF32); accumulation is fp32. R and P are powers of two, 16 <= R <= 1024, 16 <= P <= 256.

Semantics: score(row, key) = softmax_scale * (q_latent . c + q_pe . k_pe), with the model's
softmax_scale ((qk_nope + qk_rope)^-0.5 times YaRN's mscale^2; not (R + P)^-0.5). Visibility
is tree_attention's contract: row i of sequence b sees every prefix key [0, S - T); among the
last T keys it sees key S - T + j iff j <= i (tree_mask None: causal, which covers plain decode
with T = 1 and chains) or iff bit j of tree_mask[row] is set (draft trees, T <= 64). Softmax
in fp32; a row that sees no key (only with an empty mask and no prefix) outputs zeros.

Kernel: grid (B, M blocks, KV splits). The M dimension of sequence b packs its T_b * H
(query token, head) pairs, row r = t * H + h, so that one tile of latent rows, loaded once,
serves every head and every query token of the block (MQA with one KV head). A block holds
at most 64 rows, and at most 32 at R = 512 to bound the fp32 accumulator; a sequence with more
rows (64 heads, or several tokens) spans several programs, each reading its latents. Per key tile:
scores = q_latent . c^T + q_pe . k_pe^T (two fp32-accumulated dots over one row load), an
online softmax, and acc += p . c with the same c tile as V. Prefix keys are split over the
KV splits (flash-decoding) and merged by log-sum-exp; the last split also folds in the T new
keys under the causal rule or the tree bits.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from specd.kernels.common import INT32_MAX, device_num_sms, dot_acc, needs_emulation, round_to
from specd.kernels.split_kv import merge_splits
from specd.kernels.tree_attention import (
    LOG2E,
    MAX_TREE_TOKENS,
    _online_softmax_step,
    choose_num_kv_splits,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- reference


def _visible_keys(t: int, s: int, bits: torch.Tensor | None,
                  device: torch.device) -> torch.Tensor:
    """bool [T, S]: the keys each of a sequence's T rows sees (module docstring); bits: the
    rows' tree masks, int64 [T], or None for causal rows."""
    rel = torch.arange(s, device=device)[None, :] - (s - t)  # < 0 prefix, [0, T) new keys
    if bits is None:
        new_seen = rel <= torch.arange(t, device=device)[:, None]
    else:
        new_seen = ((bits.long()[:, None] >> rel.clamp(0, MAX_TREE_TOKENS - 1)) & 1).bool()
    return (rel < 0) | new_seen


def mla_attention_ref(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, tree_mask: torch.Tensor | None,
                      softmax_scale: float, max_query_len: int) -> torch.Tensor:
    """Pure-torch MLA attention with the module's semantics -> [N, H, R] in q_latent.dtype.

    One sequence at a time, in fp32 (float64 for float64 inputs); reads seq_lens and
    query_start_loc on the host.
    """
    del max_query_len  # each sequence's length is read from query_start_loc
    rank, block_size = q_latent.shape[-1], kv_cache.shape[1]
    compute = torch.promote_types(q_latent.dtype, torch.float32)
    out = torch.zeros_like(q_latent)
    starts = query_start_loc.tolist()
    for b, s in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        pos = torch.arange(s, device=kv_cache.device)
        blocks = block_tables[b, pos // block_size].long()
        rows = kv_cache[blocks, pos % block_size].to(compute)  # [S, R + P]
        c, k_pe = rows[:, :rank], rows[:, rank:]
        scores = (torch.einsum("thr,sr->hts", q_latent[lo:hi].to(compute), c)
                  + torch.einsum("thp,sp->hts", q_pe[lo:hi].to(compute), k_pe))  # [H, T, S]
        bits = tree_mask[lo:hi] if tree_mask is not None else None
        visible = _visible_keys(hi - lo, s, bits, scores.device)  # [T, S]
        probs = torch.softmax((scores * softmax_scale).masked_fill(~visible, float("-inf")),
                              dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)  # rows that see nothing
        out[lo:hi] = torch.einsum("hts,sr->thr", probs, c).to(out.dtype)
    return out


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _load_latent_tile(cache_ptr, bt_row_ptr, pos, valid, offs_r, offs_p, block_size,
                      stride_cb, stride_cs, stride_cd, RANK: tl.constexpr):
    """Cache rows at positions pos [BN] through the block table -> c [BN, R], k_pe [BN, P]
    (zeros where invalid)."""
    blk = tl.load(bt_row_ptr + pos // block_size, mask=valid, other=0).to(tl.int64)
    row = cache_ptr + blk * stride_cb + (pos % block_size) * stride_cs  # [BN] pointers
    c = tl.load(row[:, None] + offs_r[None, :] * stride_cd, mask=valid[:, None], other=0.0)
    k_pe = tl.load(row[:, None] + (RANK + offs_p[None, :]) * stride_cd, mask=valid[:, None],
                   other=0.0)
    return c, k_pe


@triton.jit
def _attend_latents(q_lat, q_pe, t, bits, m_i, l_i, acc, cache_ptr, bt_row, lo, hi, prefix,
                    offs_r, offs_p, block_size, stride_cb, stride_cs, stride_cd, scale_log2,
                    RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    NEW_KEYS: tl.constexpr, HAS_TREE_MASK: tl.constexpr,
                    EMULATE: tl.constexpr):
    """Fold keys [lo, hi) into the online softmax. NEW_KEYS: they are this step's keys (index
    j = pos - prefix), seen per the causal rule (j <= t) or the row's tree bits."""
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        visible = tl.broadcast_to(valid[None, :], (BLOCK_M, BLOCK_N))
        if NEW_KEYS:
            j = pos - prefix
            if HAS_TREE_MASK:
                jj = tl.minimum(j, 63).to(tl.int64)
                visible = visible & (((bits[:, None] >> jj[None, :]) & 1) != 0)
            else:
                visible = visible & (j[None, :] <= t[:, None])
        c, k_pe = _load_latent_tile(cache_ptr, bt_row, pos, valid, offs_r, offs_p, block_size,
                                    stride_cb, stride_cs, stride_cd, RANK)
        qk = dot_acc(q_lat, tl.trans(c), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), EMULATE)
        qk = dot_acc(q_pe, tl.trans(k_pe), qk, EMULATE)  # [BM, BN]
        m_i, l_i, acc = _online_softmax_step(qk * scale_log2, visible, c, m_i, l_i, acc,
                                             EMULATE)
    return m_i, l_i, acc


@triton.jit
def _mla_attention_kernel(
        q_lat_ptr, q_pe_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, mask_ptr, out_ptr,
        lse_ptr, scale_log2, block_size,
        stride_qn, stride_qh, stride_qd, stride_pn, stride_ph, stride_pd,
        stride_cb, stride_cs, stride_cd, stride_bt,
        stride_os, stride_on, stride_oh, stride_od, stride_ls, stride_ln, stride_lh,
        NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        HAS_TREE_MASK: tl.constexpr, EMULATE: tl.constexpr):
    """Grid (B, M blocks, NUM_SPLITS); see the module docstring."""
    b = tl.program_id(0)
    row0 = tl.program_id(1) * BLOCK_M
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    num_q = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - num_q
    if row0 < num_q * NUM_HEADS:
        offs_m = row0 + tl.arange(0, BLOCK_M)  # row = token t * NUM_HEADS + head
        row_ok = offs_m < num_q * NUM_HEADS
        t = offs_m // NUM_HEADS
        head = offs_m % NUM_HEADS
        offs_r = tl.arange(0, RANK)
        offs_p = tl.arange(0, ROPE_DIM)
        q_rows = (q_start + t).to(tl.int64)
        q_lat = tl.load(q_lat_ptr + q_rows[:, None] * stride_qn + head[:, None] * stride_qh
                        + offs_r[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        q_pe = tl.load(q_pe_ptr + q_rows[:, None] * stride_pn + head[:, None] * stride_ph
                       + offs_p[None, :] * stride_pd, mask=row_ok[:, None], other=0.0)
        bits = tl.zeros([BLOCK_M], tl.int64)
        if HAS_TREE_MASK:
            bits = tl.load(mask_ptr + q_rows, mask=row_ok, other=0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, RANK], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        # This split's share of the prefix, which every row sees whole.
        chunk = tl.cdiv(tl.cdiv(prefix, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        m_i, l_i, acc = _attend_latents(
            q_lat, q_pe, t, bits, m_i, l_i, acc, cache_ptr, bt_row, lo,
            tl.minimum(prefix, lo + chunk), prefix, offs_r, offs_p, block_size, stride_cb,
            stride_cs, stride_cd, scale_log2, RANK, BLOCK_M, BLOCK_N, False, HAS_TREE_MASK,
            EMULATE)
        if split == NUM_SPLITS - 1:  # the T new keys, masked; causal rows stop at their own
            new_hi = seq_len
            if not HAS_TREE_MASK:
                new_hi = prefix + tl.minimum(num_q - 1, (row0 + BLOCK_M - 1) // NUM_HEADS) + 1
            m_i, l_i, acc = _attend_latents(
                q_lat, q_pe, t, bits, m_i, l_i, acc, cache_ptr, bt_row, prefix, new_hi, prefix,
                offs_r, offs_p, block_size, stride_cb, stride_cs, stride_cd, scale_log2, RANK,
                BLOCK_M, BLOCK_N, True, HAS_TREE_MASK, EMULATE)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows that saw nothing stay 0
        o_ptrs = (out_ptr + split * stride_os + q_rows[:, None] * stride_on
                  + head[:, None] * stride_oh + offs_r[None, :] * stride_od)
        tl.store(o_ptrs, round_to(o, out_ptr.dtype.element_ty, EMULATE), mask=row_ok[:, None])
        if NUM_SPLITS > 1:
            lse = tl.where(l_i == 0.0, float("-inf"),
                           m_i + tl.log2(tl.maximum(l_i, 1e-30)))  # log2 units
            tl.store(lse_ptr + split * stride_ls + q_rows * stride_ln + head * stride_lh, lse,
                     mask=row_ok)


# ----------------------------------------------------------------------------- launcher


def choose_block_m(rows_per_seq: int, rank: int) -> int:
    """Rows (query token, head) per program: enough for a sequence's rows, at most 64, and at
    most 16k fp32 accumulator elements (32 rows at R = 512). An untuned guess until
    tools/bench_kernels.py has run on the GPU."""
    return max(16, min(triton.next_power_of_2(rows_per_seq), 64, 16384 // rank))


def _inner_offset(t: torch.Tensor) -> int:
    """The largest element offset inside one t[i] (strides are non-negative in torch)."""
    return sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:], strict=True) if n > 0)


def _check_dims(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor) -> None:
    if q_latent.dim() != 3 or q_latent.dtype not in _DTYPES:
        raise ValueError("q_latent must be float16/bfloat16/float32 [N, num_heads, "
                         f"kv_lora_rank], got {q_latent.dtype} {tuple(q_latent.shape)}")
    n, heads, rank = q_latent.shape
    if q_pe.dim() != 3 or q_pe.dtype != q_latent.dtype or q_pe.shape[:2] != (n, heads):
        raise ValueError(f"q_pe must be {q_latent.dtype} [{n}, {heads}, qk_rope_head_dim], "
                         f"got {q_pe.dtype} {tuple(q_pe.shape)}")
    rope = q_pe.shape[2]
    for name, dim, top in (("kv_lora_rank", rank, 1024), ("qk_rope_head_dim", rope, 256)):
        if dim < 16 or dim > top or dim & (dim - 1):
            raise ValueError(f"{name} must be a power of two in [16, {top}], got {dim}")
    if (kv_cache.dim() != 3 or kv_cache.dtype != q_latent.dtype
            or kv_cache.shape[2] != rank + rope):
        raise ValueError(f"kv_cache must be {q_latent.dtype} [num_blocks, block_size, "
                         f"{rank + rope}], got {kv_cache.dtype} {tuple(kv_cache.shape)}")


def _check_metadata(n: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, tree_mask: torch.Tensor | None,
                    max_query_len: int) -> None:
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, t, shape in (("seq_lens", seq_lens, (num_seqs,)),
                           ("query_start_loc", query_start_loc, (num_seqs + 1,)),
                           ("block_tables", block_tables, (num_seqs, block_tables.shape[-1]))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be int32 {shape}, got {t.dtype} {tuple(t.shape)}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be contiguous along blocks, got strides "
                         f"{block_tables.stride()}")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if tree_mask is not None:
        if tree_mask.dtype != torch.int64 or tuple(tree_mask.shape) != (n,):
            raise ValueError(f"tree_mask must be int64 [{n}], got {tree_mask.dtype} "
                             f"{tuple(tree_mask.shape)}")
        if max_query_len > MAX_TREE_TOKENS:
            raise ValueError(f"a tree mask covers at most {MAX_TREE_TOKENS} query rows per "
                             f"sequence, got max_query_len {max_query_len}")


def _check_args(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, tree_mask: torch.Tensor | None,
                softmax_scale: float, max_query_len: int) -> None:
    _check_dims(q_latent, q_pe, kv_cache)
    _check_metadata(q_latent.shape[0], block_tables, seq_lens, query_start_loc, tree_mask,
                    max_query_len)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale}")
    tensors = {"q_pe": q_pe, "kv_cache": kv_cache, "block_tables": block_tables,
               "seq_lens": seq_lens, "query_start_loc": query_start_loc, "tree_mask": tree_mask}
    for name, t in tensors.items():
        if t is not None and t.device != q_latent.device:
            raise ValueError(f"{name} is on {t.device}, q_latent on {q_latent.device}")
    # Offsets within one cache block and within one query row are int32; the block index and
    # the query row are int64.
    if max(_inner_offset(kv_cache), _inner_offset(q_latent), _inner_offset(q_pe)) > INT32_MAX:
        raise ValueError("one KV block or query row addresses past 2**31 elements")
    if q_latent.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"mla_attention needs CUDA tensors (q_latent is on "
                         f"{q_latent.device}); use mla_attention_ref on the CPU or set "
                         "TRITON_INTERPRET=1")


def mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, tree_mask: torch.Tensor | None,
                  softmax_scale: float, max_query_len: int, *, max_seq_len: int | None = None,
                  num_kv_splits: int | None = None) -> torch.Tensor:
    """MLA attention per the module docstring -> [N, H, kv_lora_rank] in q_latent.dtype.

    max_query_len: the largest T (sizes the grid; no device sync). max_seq_len (optional)
    bounds the KV splits; num_kv_splits overrides their choice (benchmarks and tests).
    Raises ValueError for operands outside the contract instead of launching.
    """
    _check_args(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, tree_mask,
                softmax_scale, max_query_len)
    n, heads, rank = q_latent.shape
    num_seqs = seq_lens.shape[0]
    block_m = choose_block_m(max_query_len * heads, rank)
    num_m_blocks = triton.cdiv(max_query_len * heads, block_m)
    splits = num_kv_splits or (choose_num_kv_splits(num_seqs * num_m_blocks, max_seq_len,
                                                    device_num_sms(q_latent.device))
                               if q_latent.is_cuda else 1)
    out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
    if n == 0 or num_seqs == 0:
        return out
    if splits == 1:
        partial, lse = out.unsqueeze(0), out.new_empty((1, 1, 1), dtype=torch.float32)
    else:
        partial = out.new_empty((splits, *out.shape), dtype=torch.float32)
        lse = out.new_empty((splits, n, heads), dtype=torch.float32)
    # fp32 operands take the IEEE fp32 product (not TF32) through the emulation path of dot_acc.
    emulate = needs_emulation(q_latent)
    _mla_attention_kernel[(num_seqs, num_m_blocks, splits)](
        q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc,
        tree_mask if tree_mask is not None else seq_lens, partial, lse,
        softmax_scale * LOG2E, kv_cache.shape[1],
        *q_latent.stride(), *q_pe.stride(), *kv_cache.stride(), block_tables.stride(0),
        *partial.stride(), *lse.stride(),
        NUM_HEADS=heads, RANK=rank, ROPE_DIM=q_pe.shape[2], BLOCK_M=block_m,
        BLOCK_N=64 if rank <= 128 else 32, NUM_SPLITS=splits,
        HAS_TREE_MASK=tree_mask is not None, EMULATE=emulate,
        num_warps=8 if block_m * rank >= 16384 else 4, num_stages=2)
    if splits > 1:
        merge_splits(partial, lse, out)
    return out
