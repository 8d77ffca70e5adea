"""Attention of T query tokens per sequence over a paged KV cache, with a bit mask among them.

Memory layout:

* q [N, num_heads, head_dim]: the rows of B sequences laid out one after another; sequence b
  owns rows `query_start_loc[b]:query_start_loc[b+1]` (T_b rows; query_start_loc[B] == N).
* k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] (`kv_cache_layer[0]`,
  `kv_cache_layer[1]`, any strides): key position p of sequence b lives at
  `[block_tables[b, p // block_size], p % block_size]`. This step's K/V are already written.
* seq_lens int32 [B]: S_b, the KV length including the T_b new tokens; block_tables int32
  [B, max_blocks]; tree_mask int64 [N] or None.

Semantics (specd's shared contract): row i of sequence b sees every prefix key [0, S - T);
among the last T keys it sees key S - T + j iff j <= i (tree_mask None: causal, which covers
prefill chunks and decode) or iff bit j of tree_mask[row] is set (draft trees, T <= 64).
Grouped-query heads: head h reads KV head h // (num_heads / num_kv_heads). Softmax in fp32; a
row that sees no key at all (possible only with an empty mask and no prefix) outputs zeros.
q and the caches share one dtype: bf16, fp16 or fp32 (fp32 takes IEEE products, not TF32:
float32 is exact arithmetic on the GPU too, kernels/common.py).

Kernel: grid (B, num_kv_heads * M blocks, KV splits). The M dimension packs (query token,
head of the KV group) pairs, row r = t * group + g, so that one program reads each K/V tile
once for all heads sharing it (decode with GQA fills a 16-row tile). Each program runs an
online softmax first over its split of the prefix (no mask but the bound), then — in the last
split only — over the T new keys with the causal or tree mask. With several KV splits (few
programs, long prefixes: flash-decoding) each split writes its normalized output and log-sum-
exp, merged afterwards by one kernel (kernels/split_kv.py); with one split the kernel writes
the output directly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specd.kernels.common import INT32_MAX, device_num_sms, dot_acc, needs_emulation, round_to
from specd.kernels.split_kv import merge_splits

MAX_TREE_TOKENS = 64  # one int64 bit mask per query row
MAX_KV_SPLITS = 16
LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- reference


def tree_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, tree_mask: torch.Tensor | None,
                       scale: float, max_query_len: int) -> torch.Tensor:
    """Pure-torch attention with the module's semantics, one sequence at a time, in fp32."""
    del max_query_len  # the reference reads each sequence's length itself
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, s in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        t, prefix = hi - lo, s - (hi - lo)
        pos = torch.arange(s, device=q.device)
        blocks = block_tables[b, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[lo:hi].float(), k) * scale  # [H, T, S]
        rel = pos[None, :] - prefix  # [1, S]: < 0 prefix, [0, T) new keys
        row = torch.arange(t, device=q.device)[:, None]  # [T, 1]
        if tree_mask is None:
            new_seen = rel <= row
        else:
            bits = tree_mask[lo:hi].long()[:, None]  # [T, 1]
            new_seen = ((bits >> rel.clamp(0, MAX_TREE_TOKENS - 1)) & 1).bool()
        visible = (rel < 0) | new_seen  # [T, S]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)  # rows that see nothing
        out[lo:hi] = torch.einsum("hts,shd->thd", probs, v).to(q.dtype)
    return out


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _online_softmax_step(qk, visible, v, m_i, l_i, acc, EMULATE: tl.constexpr):
    """Fold one key tile (qk [BM, BN] in log2 units, v [BN, D]) into (m_i, l_i, acc)."""
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no rescale NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = dot_acc(round_to(p, v.dtype, EMULATE), v, acc * alpha[:, None], EMULATE)
    return m_new, l_i, acc


@triton.jit
def _load_kv_tile(cache_ptr, bt_row_ptr, pos, valid, kvh, offs_d, stride_b, stride_s,
                  stride_h, stride_d, BLOCK_SIZE):
    """Keys at positions pos [BN] through the block table -> [BN, D] (zeros where invalid)."""
    blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    base = blk * stride_b + (pos % BLOCK_SIZE) * stride_s + kvh * stride_h  # [BN]
    return tl.load(cache_ptr + base[:, None] + offs_d[None, :] * stride_d,
                   mask=valid[:, None], other=0.0)


@triton.jit
def _attend_keys(q, t, bits, m_i, l_i, acc, k_ptr, v_ptr, bt_row, lo, hi, prefix, kvh, offs_d,
                 block_size, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs,
                 stride_vh, stride_vd, sm_scale_log2, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, NEW_KEYS: tl.constexpr, HAS_TREE_MASK: tl.constexpr,
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
        k = _load_kv_tile(k_ptr, bt_row, pos, valid, kvh, offs_d, stride_kb, stride_ks,
                          stride_kh, stride_kd, block_size)
        v = _load_kv_tile(v_ptr, bt_row, pos, valid, kvh, offs_d, stride_vb, stride_vs,
                          stride_vh, stride_vd, block_size)
        qk = dot_acc(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), EMULATE)
        m_i, l_i, acc = _online_softmax_step(qk * sm_scale_log2, visible, v, m_i, l_i, acc,
                                             EMULATE)
    return m_i, l_i, acc


@triton.jit
def _tree_attention_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, mask_ptr, out_ptr, lse_ptr,
        sm_scale_log2, num_m_blocks, block_size,
        stride_qn, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd, stride_bt,
        stride_os, stride_on, stride_oh, stride_od, stride_ls, stride_ln, stride_lh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_TREE_MASK: tl.constexpr,
        EMULATE: tl.constexpr):
    """Grid (B, num_kv_heads * num_m_blocks, NUM_SPLITS); see the module docstring."""
    b = tl.program_id(0)
    kvh = tl.program_id(1) // num_m_blocks
    row0 = (tl.program_id(1) % num_m_blocks) * BLOCK_M
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    num_q = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - num_q
    if row0 < num_q * GROUP:
        offs_r = row0 + tl.arange(0, BLOCK_M)  # row r = token t * GROUP + head-in-group g
        row_ok = offs_r < num_q * GROUP
        t = offs_r // GROUP
        head = kvh * GROUP + offs_r % GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        q_rows = (q_start + t).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qn + head[:, None] * stride_qh
                    + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        bits = tl.zeros([BLOCK_M], tl.int64)
        if HAS_TREE_MASK:
            bits = tl.load(mask_ptr + q_rows, mask=row_ok, other=0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        # This split's share of the prefix, which every row sees whole.
        chunk = tl.cdiv(tl.cdiv(prefix, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        m_i, l_i, acc = _attend_keys(
            q, t, bits, m_i, l_i, acc, k_ptr, v_ptr, bt_row, lo, tl.minimum(prefix, lo + chunk),
            prefix, kvh, offs_d, block_size, stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd, sm_scale_log2, BLOCK_M, BLOCK_N,
            False, HAS_TREE_MASK, EMULATE)
        if split == NUM_SPLITS - 1:  # the T new keys, masked; causal rows stop at their own
            new_hi = seq_len
            if not HAS_TREE_MASK:
                new_hi = prefix + tl.minimum(num_q - 1, (row0 + BLOCK_M - 1) // GROUP) + 1
            m_i, l_i, acc = _attend_keys(
                q, t, bits, m_i, l_i, acc, k_ptr, v_ptr, bt_row, prefix, new_hi, prefix, kvh,
                offs_d, block_size, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb,
                stride_vs, stride_vh, stride_vd, sm_scale_log2, BLOCK_M, BLOCK_N, True,
                HAS_TREE_MASK, EMULATE)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows that saw nothing stay 0
        o_ptrs = (out_ptr + split * stride_os + q_rows[:, None] * stride_on
                  + head[:, None] * stride_oh + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, round_to(o, out_ptr.dtype.element_ty, EMULATE),
                 mask=row_ok[:, None])
        if NUM_SPLITS > 1:
            lse = tl.where(l_i == 0.0, float("-inf"),
                           m_i + tl.log2(tl.maximum(l_i, 1e-30)))  # log2 units
            tl.store(lse_ptr + split * stride_ls + q_rows * stride_ln + head * stride_lh, lse,
                     mask=row_ok)


# ----------------------------------------------------------------------------- launcher


def choose_num_kv_splits(num_programs: int, max_seq_len: int | None, num_sms: int) -> int:
    """KV splits so that about one wave of `num_sms` programs runs, each with >= 256 keys."""
    if num_programs >= num_sms:
        return 1
    splits = min(MAX_KV_SPLITS, triton.next_power_of_2(triton.cdiv(num_sms, num_programs)))
    if max_seq_len is not None:
        splits = min(splits, max(1, triton.next_power_of_2(triton.cdiv(max_seq_len, 256))))
    return splits


def _check_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, tree_mask: torch.Tensor | None,
                max_query_len: int) -> None:
    if q.dim() != 3 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16/bfloat16/float32 [N, num_heads, head_dim], got "
                         f"{q.dtype} {tuple(q.shape)}")
    num_heads, head_dim = q.shape[1:]
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.dtype != q.dtype or c.shape[3] != head_dim:
            raise ValueError(f"{name} must be {q.dtype} [num_blocks, block_size, num_kv_heads, "
                             f"{head_dim}], got {c.dtype} {tuple(c.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "differ")
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{k_cache.shape[2]}")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, t, shape in (("seq_lens", seq_lens, (num_seqs,)),
                           ("query_start_loc", query_start_loc, (num_seqs + 1,)),
                           ("block_tables", block_tables, (num_seqs, block_tables.shape[-1]))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be int32 {shape}, got {t.dtype} {tuple(t.shape)}")
    if tree_mask is not None:
        if tree_mask.dtype != torch.int64 or tuple(tree_mask.shape) != (q.shape[0],):
            raise ValueError(f"tree_mask must be int64 [{q.shape[0]}], got {tree_mask.dtype} "
                             f"{tuple(tree_mask.shape)}")
        if max_query_len > MAX_TREE_TOKENS:
            raise ValueError(f"a tree mask covers at most {MAX_TREE_TOKENS} query rows per "
                             f"sequence, got max_query_len {max_query_len}")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
               "seq_lens": seq_lens, "query_start_loc": query_start_loc}
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if tree_mask is not None and tree_mask.device != q.device:
        raise ValueError(f"tree_mask is on {tree_mask.device}, q on {q.device}")
    # Offsets inside one cache block and within q are int32; the block index is int64.
    if k_cache[0].numel() > INT32_MAX or q.numel() > INT32_MAX:
        raise ValueError("q or one KV block addresses past 2**31 elements")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"tree_attention needs CUDA tensors (q is on {q.device}); use "
                         "tree_attention_ref on the CPU or set TRITON_INTERPRET=1")


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, tree_mask: torch.Tensor | None,
                   scale: float, max_query_len: int, *, max_seq_len: int | None = None,
                   num_kv_splits: int | None = None) -> torch.Tensor:
    """Attention per the module docstring -> [N, num_heads, head_dim] in q.dtype.

    max_query_len: the largest T (sizes the grid; no device sync). max_seq_len (optional)
    bounds the KV splits; num_kv_splits overrides their choice (benchmarks and tests).
    Raises ValueError for operands outside the contract instead of launching.
    """
    _check_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree_mask,
                max_query_len)
    num_heads, head_dim = q.shape[1:]
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_m = min(64, max(16, triton.next_power_of_2(max_query_len * group)))
    num_m_blocks = triton.cdiv(max_query_len * group, block_m)
    num_programs = num_seqs * num_kv_heads * num_m_blocks
    splits = num_kv_splits or (choose_num_kv_splits(num_programs, max_seq_len,
                                                    device_num_sms(q.device))
                               if q.is_cuda else 1)
    out = torch.empty_like(q)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if splits == 1:
        partial, lse = out.unsqueeze(0), out.new_empty((1, 1, 1), dtype=torch.float32)
    else:
        partial = q.new_empty((splits, *q.shape), dtype=torch.float32)
        lse = q.new_empty((splits, q.shape[0], num_heads), dtype=torch.float32)
    grid = (num_seqs, num_kv_heads * num_m_blocks, splits)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        tree_mask if tree_mask is not None else seq_lens, partial, lse,
        scale * LOG2E, num_m_blocks, k_cache.shape[1],
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
        *partial.stride(), *lse.stride(),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=64 if head_dim <= 128 else 32,
        NUM_SPLITS=splits, HAS_TREE_MASK=tree_mask is not None,
        EMULATE=needs_emulation(q), num_warps=4, num_stages=2)
    if splits > 1:
        merge_splits(partial, lse, out)
    return out
