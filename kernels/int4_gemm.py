"""W4A16 matrix product over the compressed-tensors `pack-quantized` layout: y = x @ dequant(W).T.

Memory layout (one quantized linear with weight W [N = out, K = in]):

* `weight_packed` int32 [N, K/8]: symmetric int4 values q in [-8, 7] stored as u = q + 8 in
  [0, 15], eight per word along K, element k = 8j + i in bits [4i, 4i + 4) of word j (least
  significant nibble first). Viewed as uint8 [N, K/2] on a little-endian host, byte b holds
  k = 2b in its low nibble and k = 2b + 1 in its high nibble.
* `weight_scale` bf16 (or fp16/fp32) [N, K/group_size]: one scale per group of `group_size`
  consecutive K positions (strategy "group"; group sizes 32, 64, 128), or [N, 1], one scale
  per output row (strategy "channel", `group_size=None`: one group spanning K).
* `weight_zero_point` int32 [ceil(N/8), K/group_size] (or [ceil(N/8), 1]), asymmetric weights
  only: zero points z in [-8, 7] stored as z + 8 like the weights, but packed along **N**
  (compressed-tensors' `pack_to_int32(zero_point, 4, packed_dim=0)`): the zero point of row
  n = 8j + i, group g is nibble i of word [j, g].
* W[n, k] = (q[n, k] - z[n, g]) * scale[n, g] with g = k // group_size, and z = 0 when there
  is no zero point (symmetric). Stored nibbles give q - z = u - u_z, u_z = 8 when symmetric.

Semantics (what the kernels and `int4_gemm_ref` compute): the dequantized weight is computed in
float32 (exact: a 4-bit integer times a 16-bit float fits in fp32) and rounded once to the
activation dtype; products are accumulated in float32; the result is rounded to the activation
dtype. x is [M, K] fp16, bf16 or fp32 (fp32: IEEE products, not TF32, so float32 is exact
arithmetic on the GPU too; kernels/common.py) with any strides; y is a new contiguous [M, N]
tensor.

Two kernels, chosen by `choose_config` from M and the shape, never by the caller:

* split-K (M <= 64, decode and verification): grid (N tiles, K splits, M tiles). Each program
  streams a [BLOCK_K, BLOCK_N] slab of weights for its K range; with BLOCK_M == 1 it is a GEMV
  (broadcast multiply and a reduction over K), otherwise a `tl.dot` on a zero-padded M tile.
  With more than one split, each split writes fp32 partials [SPLIT_K, M, N] summed afterwards
  (deterministic, no atomics).
* tiled (M > 64): a classic `tl.dot` GEMM over (M, N) tiles in grouped order for L2 reuse,
  dequantizing each weight tile in registers.

The GEMV (BLOCK_M == 1) loads each packed word of its tile once and each scale once (a tile
of BLOCK_K values of K spans TILE_GROUPS whole groups, or lies inside one group), expanding the
eight nibbles of a word in registers: its working set is [TILE_GROUPS, GROUP_WORDS, 8,
BLOCK_N]. The `tl.dot` paths (split-K with BLOCK_M > 1, tiled, and the fused MoE) dequantize a
[BLOCK_K, BLOCK_N] tile reading each packed word once per nibble position (eight loads of the
same word hit L1); when BLOCK_K divides group_size one scale (and zero point) per output column
covers a K block, otherwise each K row reads its group's. Channel-wise scales run as one group of
next_power_of_2(K) >= K columns, so every K block reads scale column 0. K is masked to its
length, so any BLOCK_K works. The kernels take any strides; they read fastest when
`weight_packed` and `weight_scale` are stored N-contiguous (`column_major`: the same [N, X]
values, stride (1, N)), because a warp then reads consecutive output columns of one packed row,
as GPTQ/AWQ-layout kernels do. `Int4Linear` keeps its tensors that way; the checkpoint's
K-contiguous layout works too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specd.kernels.common import (
    INT32_MAX,
    device_num_sms,
    dot_acc,
    max_offset,
    needs_emulation,
    round_to,
)
from specd.kernels.int4_layout import (
    SUPPORTED_ACT_DTYPES,
    check_quantized_weight,
    dequantize_int4,
)

SPLIT_K_MAX_M = 64  # rows up to which the split-K / GEMV kernel is used


# ----------------------------------------------------------------------------- reference


def int4_gemm_ref(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                  group_size: int | None,
                  weight_zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch y = x @ dequant(W).T with the kernels' semantics (module docstring).

    x [M, K] (any float dtype), weight_packed int32 [N, K/8], weight_scale [N, K/group_size]
    ([N, 1] with group_size None), weight_zero_point int32 [ceil(N/8), K/group_size] or None
    -> y [M, N] in x.dtype. Runs on any device; this is the CPU path of the engine.
    """
    w = dequantize_int4(weight_packed, weight_scale, group_size, x.shape[-1], x.dtype,
                        weight_zero_point)
    return (x.float() @ w.float().t()).to(x.dtype)


@triton.jit
def _zero_nibbles(z_ptr, offs_n, group, mask, stride_zn, stride_zg):
    """Stored zero points u_z = z + 8 of rows offs_n ([1, BLOCK_N]) in groups `group` (a
    scalar or [BLOCK_K, 1]): nibble n % 8 of word [n // 8, group]."""
    words = tl.load(z_ptr + (offs_n[None, :] // 8) * stride_zn + group * stride_zg, mask=mask,
                    other=0)
    return (words >> ((offs_n[None, :] % 8) * 4)) & 0xF


@triton.jit
def dequant_tile(w_ptr, s_ptr, z_ptr, k0, K, offs_n, mask_n, stride_wn, stride_wk, stride_sn,
                 stride_sg, stride_zn, stride_zg, GROUP_SIZE: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_ZP: tl.constexpr, OUT_DTYPE: tl.constexpr,
                 EMULATE: tl.constexpr):
    """W[offs_n, k0:k0+BLOCK_K] as a [BLOCK_K, BLOCK_N] tile in OUT_DTYPE: zeros past N;
    rows past K are finite and meet zero activations (callers mask x there).

    k0 is a multiple of BLOCK_K. When BLOCK_K divides GROUP_SIZE the tile lies in one group:
    one scale (and zero point) per column; otherwise each K row reads its group's (repeats
    hit L1). Without HAS_ZP the stored zero point is the constant 8 (symmetric); z_ptr and
    its strides are then unused.
    """
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_k[:, None] < K) & mask_n[None, :]
    words = tl.load(w_ptr + offs_n[None, :] * stride_wn + (offs_k[:, None] // 8) * stride_wk,
                    mask=mask, other=0)  # [BLOCK_K, BLOCK_N] int32, each word read 8 times
    u = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
    if BLOCK_K <= GROUP_SIZE:
        group = k0 // GROUP_SIZE
        scale = tl.load(s_ptr + offs_n[None, :] * stride_sn + group * stride_sg,
                        mask=mask_n[None, :], other=0.0)  # [1, BLOCK_N]
        if HAS_ZP:
            q = u - _zero_nibbles(z_ptr, offs_n, group, mask_n[None, :], stride_zn, stride_zg)
        else:
            q = u - 8
    else:
        groups = offs_k[:, None] // GROUP_SIZE  # [BLOCK_K, 1]
        scale = tl.load(s_ptr + offs_n[None, :] * stride_sn + groups * stride_sg, mask=mask,
                        other=0.0)
        if HAS_ZP:
            q = u - _zero_nibbles(z_ptr, offs_n, groups, mask, stride_zn, stride_zg)
        else:
            q = u - 8
    return round_to(q.to(tl.float32) * scale.to(tl.float32), OUT_DTYPE, EMULATE)


@triton.jit
def _gemv_step(acc, x_ptr, stride_xk, w_ptr, s_ptr, z_ptr, k0, K, offs_n, mask_n, stride_wn,
               stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE: tl.constexpr,
               TILE_GROUPS: tl.constexpr, GROUP_WORDS: tl.constexpr, HAS_ZP: tl.constexpr,
               ACT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """acc [TILE_GROUPS, GROUP_WORDS, 8, BLOCK_N] fp32 + W[n, k] * x[k] elementwise for the
    BLOCK_K = TILE_GROUPS * GROUP_WORDS * 8 positions k of K from k0 (k0 a multiple of
    BLOCK_K): word w of group g holds k = k0 + 8 * (g * GROUP_WORDS + w) + i in nibble i. Each
    packed word [g, w, n] and each scale [g, n] of the tile is loaded once; W is dequantized
    in fp32 and rounded once to ACT_DTYPE (module docstring). Positions past K add zero."""
    g = tl.arange(0, TILE_GROUPS)[:, None, None]  # [G, 1, 1]
    w = tl.arange(0, GROUP_WORDS)[None, :, None]  # [1, W, 1]
    word = k0 // 8 + g * GROUP_WORDS + w  # [G, W, 1] word index along K
    word_ok = (word * 8 < K) & mask_n[None, None, :]  # [G, W, N]
    words = tl.load(w_ptr + offs_n[None, None, :] * stride_wn + word * stride_wk,
                    mask=word_ok, other=0)  # [G, W, N] int32, each word once
    group = k0 // GROUP_SIZE + tl.arange(0, TILE_GROUPS)  # [G]
    group_ok = (group[:, None] * GROUP_SIZE < K) & mask_n[None, :]  # [G, N]
    scale = tl.load(s_ptr + offs_n[None, :] * stride_sn + group[:, None] * stride_sg,
                    mask=group_ok, other=0.0)  # [G, N], each scale once
    nibble = tl.arange(0, 8)[None, None, :, None]  # [1, 1, 8, 1]
    u = (words[:, :, None, :] >> (nibble * 4)) & 0xF  # [G, W, 8, N]
    if HAS_ZP:
        zero = _zero_nibbles(z_ptr, offs_n, group[:, None], group_ok, stride_zn, stride_zg)
        q = u - zero[:, None, None, :]
    else:
        q = u - 8
    weight = round_to(q.to(tl.float32) * scale.to(tl.float32)[:, None, None, :], ACT_DTYPE,
                      EMULATE)
    offs_k = k0 + (g * GROUP_WORDS + w) * 8 + tl.arange(0, 8)[None, None, :]  # [G, W, 8]
    x = tl.load(x_ptr + offs_k * stride_xk, mask=offs_k < K, other=0.0)
    return acc + weight.to(tl.float32) * x.to(tl.float32)[:, :, :, None]


@triton.jit
def _int4_splitk_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, k_blocks_per_split,
                        stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg,
                        stride_zn, stride_zg, stride_os, stride_om, stride_on,
                        GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZP: tl.constexpr,
                        EMULATE: tl.constexpr, TILE_GROUPS: tl.constexpr,
                        GROUP_WORDS: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M)); out is [SPLIT_K, M, N] (strided).
    TILE_GROUPS * GROUP_WORDS * 8 == BLOCK_K: the GEMV's tile of whole groups (`_gemv_step`)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    act_dtype = x_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    kb_start = pid_k * k_blocks_per_split
    kb_end = tl.minimum(kb_start + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
    if BLOCK_M == 1:
        # GEMV: the activations broadcast against the weight slab, accumulated elementwise
        # and reduced over K once at the end (no per-step shuffles).
        acc = tl.zeros([TILE_GROUPS, GROUP_WORDS, 8, BLOCK_N], dtype=tl.float32)
        for kb in range(kb_start, kb_end):
            acc = _gemv_step(acc, x_ptr + pid_m * stride_xm, stride_xk, w_ptr, s_ptr, z_ptr,
                             kb * BLOCK_K, K, offs_n, mask_n, stride_wn, stride_wk, stride_sn,
                             stride_sg, stride_zn, stride_zg, GROUP_SIZE, TILE_GROUPS,
                             GROUP_WORDS, HAS_ZP, act_dtype, EMULATE)
        y = tl.sum(tl.sum(tl.sum(acc, axis=2), axis=1), axis=0)  # [BLOCK_N]
        out = out_ptr + pid_k * stride_os + pid_m * stride_om + offs_n * stride_on
        tl.store(out, round_to(y, out_ptr.dtype.element_ty, EMULATE), mask=mask_n)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(kb_start, kb_end):
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            w = dequant_tile(w_ptr, s_ptr, z_ptr, kb * BLOCK_K, K, offs_n, mask_n, stride_wn,
                             stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE,
                             BLOCK_K, HAS_ZP, act_dtype, EMULATE)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0)
            acc2 = dot_acc(x, w, acc2, EMULATE)
        out = (out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om
               + offs_n[None, :] * stride_on)
        tl.store(out, round_to(acc2, out_ptr.dtype.element_ty, EMULATE),
                 mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _int4_tiled_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg,
                       stride_zn, stride_zg, stride_om, stride_on,
                       GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_ZP: tl.constexpr,
                       EMULATE: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),); GROUP_M row tiles share weight tiles in L2."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_rows
    pid_n = (pid % num_pid_in_group) // group_rows
    act_dtype = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        w = dequant_tile(w_ptr, s_ptr, z_ptr, kb * BLOCK_K, K, offs_n, mask_n, stride_wn,
                         stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE,
                         BLOCK_K, HAS_ZP, act_dtype, EMULATE)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0)
        acc = dot_acc(x, w, acc, EMULATE)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, round_to(acc, out_ptr.dtype.element_ty, EMULATE),
             mask=mask_m[:, None] & mask_n[None, :])


# ----------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters. kind "splitk" (BLOCK_M == 1 is the GEMV) or "tiled"."""

    kind: str
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def choose_config(m: int, n: int, k: int, group_size: int | None, num_sms: int) -> GemmConfig:
    """The launch configuration for x [m, k] @ W [n, k].T: split-K for m <= 64, tiled above.

    Small M is bound by reading the weights once, which wants about two programs per SM in
    flight: BLOCK_N shrinks (128, 64, 32, 16) until the N tiles reach 2 * num_sms; only when
    they leave SMs idle (narrow layers) is K split, since splits cost an fp32 reduction (two
    more launches). Untuned guesses until tools/bench_kernels.py --sweep has run on the GPU.
    """
    if m > SPLIT_K_MAX_M:
        block_m = 64 if m <= 128 else 128
        return GemmConfig("tiled", block_m, 128, 64, num_warps=8 if block_m == 128 else 4)
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    m_tiles = m if block_m == 1 else triton.cdiv(m, block_m)
    target = 2 * num_sms
    block_n = next((b for b in (128, 64, 32) if triton.cdiv(n, b) * m_tiles >= target), 16)
    # The GEMV keeps a [BLOCK_K, BLOCK_N] fp32 accumulator: at most 4096 (32 per thread).
    block_k = 64 if m > 1 else min(128, 4096 // block_n)
    tiles = triton.cdiv(n, block_n) * m_tiles
    k_blocks = triton.cdiv(k, block_k)
    split_k = 1
    while split_k * 2 <= min(16, k_blocks) and tiles * split_k < num_sms:
        split_k *= 2
    return GemmConfig("splitk", block_m, block_n, block_k, split_k=split_k)



def check_int4_gemm_args(x: torch.Tensor, weight_packed: torch.Tensor,
                         weight_scale: torch.Tensor, group_size: int | None,
                         weight_zero_point: torch.Tensor | None = None) -> None:
    """Raise ValueError naming the tensor when the operands break the layout contract."""
    if x.dim() != 2 or x.dtype not in SUPPORTED_ACT_DTYPES:
        raise ValueError(f"x must be a 2-D float16/bfloat16/float32 tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    m, k = x.shape
    n = weight_packed.shape[0] if weight_packed.dim() == 2 else -1
    check_quantized_weight("weight", weight_packed, weight_scale, weight_zero_point,
                           group_size, n, k)
    operands = {"x": x, "weight_packed": weight_packed, "weight_scale": weight_scale,
                "weight_zero_point": weight_zero_point}
    for name, t in operands.items():
        if t is None:
            continue
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
        if max_offset(t) > INT32_MAX:
            raise ValueError(f"{name}'s strides {t.stride()} address past 2**31 elements")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"int4_gemm needs CUDA tensors (x is on {x.device}); use "
                         "int4_gemm_ref on the CPU or set TRITON_INTERPRET=1")


def kernel_group_size(group_size: int | None, k: int) -> int:
    """The kernels' GROUP_SIZE: the group, or for channel-wise scales one group of
    next_power_of_2(k) >= k columns (every K block then reads scale column 0)."""
    return group_size or triton.next_power_of_2(k)


def zero_point_args(zero_point: torch.Tensor | None, like: torch.Tensor
                    ) -> tuple[torch.Tensor, int, int]:
    """(pointer tensor, stride over packed rows, stride over groups) of the last two dims of
    `zero_point`; without one, `like` stands in (never read: HAS_ZP is False) with strides 0."""
    if zero_point is None:
        return like, 0, 0
    return zero_point, zero_point.stride(-2), zero_point.stride(-1)


def int4_gemm(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
              group_size: int | None, config: GemmConfig | None = None,
              weight_zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(weight_packed, weight_scale, weight_zero_point).T in
    x.dtype (see module doc). group_size None: channel-wise scales [N, 1].

    `config` overrides `choose_config` (benchmarks and tests only). Raises ValueError for any
    operand outside the layout contract instead of launching.
    """
    check_int4_gemm_args(x, weight_packed, weight_scale, group_size, weight_zero_point)
    m, k = x.shape
    n = weight_packed.shape[0]
    cfg = config or choose_config(m, n, k, group_size, device_num_sms(x.device))
    if cfg.block_k < 16 or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {cfg.block_k}")
    emulate = needs_emulation(x)
    group = kernel_group_size(group_size, k)
    zp, stride_zn, stride_zg = zero_point_args(weight_zero_point, weight_packed)
    has_zp = weight_zero_point is not None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if cfg.kind == "tiled":
        _int4_tiled_kernel[(triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)](
            x, weight_packed, weight_scale, zp, out, m, n, k,
            x.stride(0), x.stride(1), weight_packed.stride(0), weight_packed.stride(1),
            weight_scale.stride(0), weight_scale.stride(1), stride_zn, stride_zg,
            out.stride(0), out.stride(1),
            GROUP_SIZE=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, HAS_ZP=has_zp, EMULATE=emulate,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out
    k_blocks_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k)
    # One split writes y directly; several write fp32 partials [split_k, M, N] summed below.
    partial = out.unsqueeze(0) if cfg.split_k == 1 else torch.empty(
        (cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(m, cfg.block_m))
    _int4_splitk_kernel[grid](
        x, weight_packed, weight_scale, zp, partial, m, n, k, k_blocks_per_split,
        x.stride(0), x.stride(1), weight_packed.stride(0), weight_packed.stride(1),
        weight_scale.stride(0), weight_scale.stride(1), stride_zn, stride_zg,
        partial.stride(0), partial.stride(1), partial.stride(2),
        GROUP_SIZE=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        HAS_ZP=has_zp, EMULATE=emulate, TILE_GROUPS=max(1, cfg.block_k // group),
        GROUP_WORDS=min(cfg.block_k, group) // 8, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if cfg.split_k > 1:
        out.copy_(partial.sum(0))
    return out
