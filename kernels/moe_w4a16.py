"""Fused mixture of experts: y[t] = sum_j w[t, j] * SwiGLU_{e[t, j]}(x[t]), over INT4 (W4A16)
experts or dense ones.

Memory layout (E experts, H hidden, I expert intermediate; `Int4ExpertWeights`): each expert's
gate_proj, up_proj and down_proj in the compressed-tensors `pack-quantized` layout of
kernels/int4_gemm.py (W = (q - z) * scale, eight 4-bit values per int32 along the input
dimension, least significant nibble first, stored as value + 8), stacked over experts:

* `w13_packed` int32 [E, 2I, H/8]: expert e's gate_proj rows [0, I), then its up_proj rows
  [I, 2I). `w13_scale` [E, 2I, H/group] (channel-wise: [E, 2I, 1]).
* `w2_packed` int32 [E, H, I/8] (down_proj), `w2_scale` [E, H, I/group] ([E, H, 1]).
* Asymmetric only: `w13_zero_point` int32 [E, ceil(2I/8), H/group] and `w2_zero_point` int32
  [E, ceil(H/8), I/group], packed along the output rows (compressed-tensors'
  `pack_to_int32(zero_point, 4, packed_dim=0)` of the stacked rows: with I % 8 == 0 that is
  gate's words followed by up's). Symmetric experts have none (z = 0).
* group_size 32, 64 or 128 for every projection, or None for channel-wise scales.
* Dense experts (`ExpertWeights`, the activation dtype): `w13` [E, 2I, H] (gate rows, then up
  rows) and `w2` [E, H, I], any strides; the kernels load their tiles as they are.

Routing: topk_ids [M, k] in [-1, E). An id of -1 says the slot's expert is not held here (with
expert parallelism the caller applies its expert map, global id -> local id or -1, as vLLM's
fused MoE does): the pair contributes zero, and its blocks are skipped (gate/up) or write
zeros (down). Every shape is fixed by M, k, E and the block sizes; nothing is read on the
host, so a forward through it can be captured as a CUDA graph.

Pipeline (`fused_moe`, vLLM's `fused_experts` structure, notes/mla_moe_tp.md section 3):

1. `moe_align_block_size` (kernels/moe_align.py): the M * k (token, slot) pairs, "pair"
   p = token * k + slot, sorted by expert (stable) and each expert's run padded to a multiple
   of BLOCK_M with the sentinel M * k; one expert id per BLOCK_M block (-1 for the run of
   pairs with id -1); the padded length.
2. Gate/up launch over (block, N tile): the block's rows gathered from x (row p // k), times
   the gate and the up tile of the block's expert (two accumulators), SiLU-and-multiply fused
   in the epilogue -> h [M * k, I] at row p.
3. Down launch: h rows times the expert's down_proj, multiplied by the router weight of the
   pair in the epilogue -> weighted [M * k, H] at row p.
4. `moe_sum`: weighted viewed [M, k, H] summed over k in float32.

`routed_scaling_factor`: workers/models/moe.py's `route` multiplies it into topk_weights, so the
weights arrive scaled and are applied as given; nothing here scales again.

Semantics (the kernels and `fused_moe_ref` alike), with `rnd` the rounding to the
activation dtype (fp16, bf16, or fp32 with IEEE products, not TF32): INT4 weights dequantized
in float32 and rounded once (int4_gemm.py), dense weights as they are;
gate = rnd(x W_gate^T), up = rnd(x W_up^T) accumulated in float32; h = rnd(rnd(silu(gate)) *
up); y = rnd(h W_down^T); weighted = rnd(y * w) in float32; out = rnd(sum_j weighted_j) in
float32. These are the roundings of workers/models/moe.py's dense path plus one (weighted is stored
in the activation dtype, as vLLM's fused MoE stores it, to keep the buffer at 2 bytes).

Tokens are processed in chunks of CHUNK_TOKENS, so the buffers (h and weighted, CHUNK_TOKENS
* k * (I + H) activation elements) stay bounded whatever M is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specd.kernels.common import INT32_MAX, dot_acc, max_offset, needs_emulation, round_to
from specd.kernels.int4_gemm import (
    dequant_tile,
    kernel_group_size,
    zero_point_args,
)
from specd.kernels.int4_layout import (
    SUPPORTED_ACT_DTYPES,
    check_quantized_weight,
    dequantize_int4,
)
from specd.kernels.moe_align import moe_align_block_size

CHUNK_TOKENS = 2048  # tokens per pass: bounds h and weighted (untuned)


@dataclass(frozen=True)
class Int4ExpertWeights:
    """Stacked INT4 SwiGLU weights of E routed experts (module docstring's layout); the INT4
    counterpart of workers/models/moe.py's `ExpertWeights`. ValueError on construction for tensors
    outside the layout."""

    w13_packed: torch.Tensor
    w13_scale: torch.Tensor
    w2_packed: torch.Tensor
    w2_scale: torch.Tensor
    group_size: int | None
    w13_zero_point: torch.Tensor | None = None
    w2_zero_point: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.w13_packed.dim() != 3 or self.w2_packed.dim() != 3:
            raise ValueError(f"w13_packed and w2_packed must be 3-D [E, N, K/8], got "
                             f"{list(self.w13_packed.shape)} and {list(self.w2_packed.shape)}")
        if self.w13_packed.shape[1] % 2 or self.w2_packed.shape[0] != self.num_experts:
            raise ValueError(f"w13_packed [E, 2I, H/8] and w2_packed [E, H, I/8] disagree: "
                             f"{list(self.w13_packed.shape)}, {list(self.w2_packed.shape)}")
        h, i = self.hidden_size, self.intermediate_size
        check_quantized_weight("w13", self.w13_packed, self.w13_scale, self.w13_zero_point,
                               self.group_size, 2 * i, h)
        check_quantized_weight("w2", self.w2_packed, self.w2_scale, self.w2_zero_point,
                               self.group_size, h, i)

    @property
    def num_experts(self) -> int:
        return self.w13_packed.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w13_packed.shape[1] // 2

    @property
    def hidden_size(self) -> int:
        return self.w2_packed.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held, by field name (zero points only when present)."""
        fields = ("w13_packed", "w13_scale", "w2_packed", "w2_scale", "w13_zero_point",
                  "w2_zero_point")
        return {f: t for f in fields if (t := getattr(self, f)) is not None}

    def dequantized(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s dense (w13 [2I, H], w2 [H, I]) rounded once to `dtype`."""
        def zero(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[expert]

        w13 = dequantize_int4(self.w13_packed[expert], self.w13_scale[expert], self.group_size,
                              self.hidden_size, dtype, zero(self.w13_zero_point))
        w2 = dequantize_int4(self.w2_packed[expert], self.w2_scale[expert], self.group_size,
                             self.intermediate_size, dtype, zero(self.w2_zero_point))
        return w13, w2


@dataclass(frozen=True)
class ExpertWeights:
    """Stacked SwiGLU weights of E routed experts (unquantized), H hidden, I intermediate.

    w13: [E, 2I, H], expert e's gate_proj rows [0, I) then its up_proj rows [I, 2I).
    w2: [E, H, I], expert e's down_proj. ValueError on construction for other shapes.
    """

    w13: torch.Tensor
    w2: torch.Tensor

    def __post_init__(self) -> None:
        e, two_i, h = self.w13.shape if self.w13.dim() == 3 else (-1, -1, -1)
        if (self.w13.dim() != 3 or two_i % 2 or self.w2.dim() != 3
                or tuple(self.w2.shape) != (e, h, two_i // 2)):
            raise ValueError(f"w13 [E, 2I, H] and w2 [E, H, I] disagree: "
                             f"{list(self.w13.shape)}, {list(self.w2.shape)}")

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"w13": self.w13, "w2": self.w2}

    def dequantized(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s (w13 [2I, H], w2 [H, I]) in `dtype`."""
        return self.w13[expert].to(dtype), self.w2[expert].to(dtype)


Experts = Int4ExpertWeights | ExpertWeights


# ----------------------------------------------------------------------------- reference


def moe_sum(weighted: torch.Tensor) -> torch.Tensor:
    """[M, k, H] router-weighted expert outputs -> [M, H]: summed in float32, rounded once."""
    return weighted.float().sum(dim=1).to(weighted.dtype)


def _silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2I] -> [n, I]: rnd(rnd(silu(gate)) * up), computed in float32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate).to(gate_up.dtype).float() * up).to(gate_up.dtype)


def fused_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  weights: Experts) -> torch.Tensor:
    """Pure-torch `fused_moe` with the kernels' semantics (module docstring): x [M, H]
    (any float dtype), topk_ids [M, k] in [-1, E), topk_weights [M, k] -> [M, H] in x.dtype.

    The pairs are sorted by expert; each expert that received pairs is dequantized once and
    runs one gate/up and one down product over its rows (a loop over experts, never over
    tokens; the bounds are read on the host: this is the CPU path). Pairs of id -1 add zero.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = weights.num_experts
    flat = topk_ids.reshape(-1).long()
    flat = torch.where(flat < 0, num_experts, flat)  # id -1 sorts last and is skipped
    pair_weights = topk_weights.reshape(-1).float()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    weighted = x.new_zeros(num_tokens * top_k, weights.hidden_size)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        w13, w2 = weights.dequantized(expert, x.dtype)
        gate_up = (x[pairs // top_k].float() @ w13.float().t()).to(x.dtype)  # [count, 2I]
        y = (_silu_and_mul_ref(gate_up).float() @ w2.float().t()).to(x.dtype)  # [count, H]
        weighted[pairs] = (y.float() * pair_weights[pairs, None]).to(x.dtype)
    return moe_sum(weighted.view(num_tokens, top_k, weights.hidden_size))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _weight_tile(w_e, s_e, z_e, k0, K, offs_n, mask_n, stride_wn, stride_wk, stride_sn,
                 stride_sg, stride_zn, stride_zg, GROUP_SIZE: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_ZP: tl.constexpr, DENSE: tl.constexpr,
                 OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """One expert's W[offs_n, k0:k0+BLOCK_K] as a [BLOCK_K, BLOCK_N] tile: loaded as it is
    (DENSE) or dequantized (int4_gemm.dequant_tile); zeros past N and K."""
    if DENSE:  # both branches assign: the compiler would type the code after a return too
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w_e + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                       mask=(offs_k[:, None] < K) & mask_n[None, :], other=0.0)
    else:
        tile = dequant_tile(w_e, s_e, z_e, k0, K, offs_n, mask_n, stride_wn, stride_wk,
                            stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE, BLOCK_K,
                            HAS_ZP, OUT_DTYPE, EMULATE)
    return tile


@triton.jit
def _fused_moe_kernel(a_ptr, w_ptr, s_ptr, z_ptr, pair_weight_ptr, out_ptr,
                      sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                      num_pairs, a_row_divisor, N, K, num_blocks,
                      stride_am, stride_ak, stride_we, stride_wn, stride_wk,
                      stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
                      stride_om, stride_on,
                      GATE_UP: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      HAS_ZP: tl.constexpr, DENSE: tl.constexpr, EMULATE: tl.constexpr):
    """Grid (num_blocks * cdiv(N, BLOCK_N),), GROUP_M blocks sharing each weight tile in turn.

    Program (block b, N tile): the BLOCK_M pairs sorted_ids[b * BLOCK_M:], A rows
    pair // a_row_divisor, expert expert_ids[b]; blocks at or past num_post exit at once.
    GATE_UP: out[pair, n] = rnd(rnd(silu(rnd(A W[n]))) * rnd(A W[N + n])) for n < N (W is
    [2N, K]); otherwise out[pair, n] = rnd(rnd(A W[n]) * pair_weight[pair]). A block of
    expert -1 (pairs whose expert is not held) computes nothing: its gate/up rows are never
    read, and its down rows are written as zeros. DENSE: W is the weights themselves.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_rows
    pid_n = (pid % num_pid_in_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    act_dtype = out_ptr.dtype.element_ty
    expert = tl.load(expert_ids_ptr + pid_m)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    mask_m = pairs < num_pairs  # padding rows hold the sentinel num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    out = out_ptr + pairs[:, None] * stride_om + offs_n[None, :] * stride_on
    if expert < 0:  # not held here: these pairs add zero
        if not GATE_UP:
            tl.store(out, tl.zeros([BLOCK_M, BLOCK_N], act_dtype),
                     mask=mask_m[:, None] & mask_n[None, :])
        return
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_ze
    rows = pairs // a_row_divisor
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0)
        w = _weight_tile(w_e, s_e, z_e, kb * BLOCK_K, K, offs_n, mask_n, stride_wn, stride_wk,
                         stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE, BLOCK_K,
                         HAS_ZP, DENSE, act_dtype, EMULATE)
        acc = dot_acc(a, w, acc, EMULATE)
        if GATE_UP:
            w_up = _weight_tile(w_e, s_e, z_e, kb * BLOCK_K, K, offs_n + N, mask_n, stride_wn,
                                stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
                                GROUP_SIZE, BLOCK_K, HAS_ZP, DENSE, act_dtype, EMULATE)
            acc_up = dot_acc(a, w_up, acc_up, EMULATE)
    y = round_to(acc, act_dtype, EMULATE).to(tl.float32)
    if GATE_UP:
        up = round_to(acc_up, act_dtype, EMULATE).to(tl.float32)
        silu = round_to(y / (1.0 + tl.exp(-y)), act_dtype, EMULATE).to(tl.float32)
        y = silu * up
    else:
        y = y * tl.load(pair_weight_ptr + pairs, mask=mask_m, other=0.0)[:, None]
    out = out_ptr + pairs[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, round_to(y, act_dtype, EMULATE), mask=mask_m[:, None] & mask_n[None, :])


# ----------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class FusedMoeConfig:
    """Launch parameters: block_m rows per block (the alignment of each expert's run), the
    N and K tiles of the gate/up and of the down launch."""

    block_m: int
    block_n: int = 64
    block_k: int = 64
    block_n_down: int = 64
    block_k_down: int = 64
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


def choose_moe_config(num_pairs: int, num_experts: int, intermediate_size: int,
                      hidden_size: int) -> FusedMoeConfig:
    """BLOCK_M from the mean rows per expert (16 in decode, where each expert gets a few
    rows; up to 64 in prefill, with GROUP_M 8 for L2 reuse of weight tiles across blocks);
    64-wide N and K tiles, narrower only for small layers. Untuned guesses until
    tools/bench_kernels.py has run on the GPU."""
    mean_rows = num_pairs / num_experts
    block_m = 16 if mean_rows <= 16 else 32 if mean_rows <= 48 else 64

    def tile(size: int) -> int:
        return min(64, max(16, triton.next_power_of_2(size)))

    return FusedMoeConfig(block_m, tile(intermediate_size), tile(hidden_size),
                          tile(hidden_size), tile(intermediate_size),
                          group_m=1 if block_m == 16 else 8)


def check_moe_config(cfg: FusedMoeConfig) -> None:
    """ValueError unless every block size is a power of two >= 16 (`tl.dot`'s minimum)."""
    for name in ("block_m", "block_n", "block_k", "block_n_down", "block_k_down"):
        size = getattr(cfg, name)
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")


def check_fused_moe_args(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         weights: Experts) -> None:
    """Raise ValueError naming the operand when it breaks the launcher's contract (the
    weights' own layout is checked when they are built). The ids' values are not read (that
    would synchronise): they must lie in [-1, E)."""
    if x.dim() != 2 or x.dtype not in SUPPORTED_ACT_DTYPES:
        raise ValueError(f"x must be a 2-D float16/bfloat16/float32 tensor, got {x.dtype} "
                         f"{list(x.shape)}")
    if x.shape[1] != weights.hidden_size:
        raise ValueError(f"x has hidden size {x.shape[1]}, the experts "
                         f"{weights.hidden_size}")
    if (topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] < 1
            or topk_ids.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"topk_ids must be int32/int64 [M, k] with M = {x.shape[0]}, got "
                         f"{topk_ids.dtype} {list(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be a float tensor {list(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {list(topk_weights.shape)}")
    if isinstance(weights, ExpertWeights) and {weights.w13.dtype, weights.w2.dtype} != {x.dtype}:
        raise ValueError(f"dense experts must be in x's dtype {x.dtype}, got w13 "
                         f"{weights.w13.dtype}, w2 {weights.w2.dtype}")
    operands = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights,
                **weights.tensors()}
    for name, t in operands.items():
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
        if max_offset(t) > INT32_MAX:
            raise ValueError(f"{name}'s strides {t.stride()} address past 2**31 elements")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"fused_moe needs CUDA tensors (x is on {x.device}); use "
                         "fused_moe_ref on the CPU or set TRITON_INTERPRET=1")


Routing = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # moe_align_block_size's outputs


def _launch(a: torch.Tensor, a_row_divisor: int, weights: Experts, down: bool,
            pair_weights: torch.Tensor, out: torch.Tensor, routing: Routing, block_n: int,
            block_k: int, cfg: FusedMoeConfig) -> None:
    """One `_fused_moe_kernel` launch: out [pairs, N] from A rows and the experts' w13
    (gate/up, W [E, 2N, K]) or w2 (down, W [E, N, K])."""
    sorted_ids, expert_ids, num_post = routing
    n = out.shape[1]
    k = a.shape[1]
    if isinstance(weights, ExpertWeights):
        w = weights.w2 if down else weights.w13
        scale, zero_point, group_size = w, None, None  # unread: DENSE
    else:
        w = weights.w2_packed if down else weights.w13_packed
        scale = weights.w2_scale if down else weights.w13_scale
        zero_point = weights.w2_zero_point if down else weights.w13_zero_point
        group_size = weights.group_size
    zp, stride_zn, stride_zg = zero_point_args(zero_point, w)
    num_blocks = expert_ids.numel()
    _fused_moe_kernel[(num_blocks * triton.cdiv(n, block_n),)](
        a, w, scale, zp, pair_weights, out, sorted_ids, expert_ids, num_post,
        pair_weights.numel(), a_row_divisor, n, k, num_blocks,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        zp.stride(0) if zero_point is not None else 0, stride_zn, stride_zg,
        out.stride(0), out.stride(1),
        GATE_UP=not down, GROUP_SIZE=kernel_group_size(group_size, k), BLOCK_M=cfg.block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m, HAS_ZP=zero_point is not None,
        DENSE=isinstance(weights, ExpertWeights), EMULATE=needs_emulation(a),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _fused_moe_chunk(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     weights: Experts, config: FusedMoeConfig | None) -> torch.Tensor:
    """Steps 1-4 of the module docstring for one chunk of tokens: [M, H] -> [M, H]."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    w = weights
    cfg = config or choose_moe_config(num_pairs, w.num_experts, w.intermediate_size,
                                      w.hidden_size)
    routing = moe_align_block_size(topk_ids, cfg.block_m, w.num_experts)
    pair_weights = topk_weights.reshape(-1).float()  # [M * k], pair p at p
    h = torch.empty(num_pairs, w.intermediate_size, dtype=x.dtype, device=x.device)
    _launch(x, top_k, w, False, pair_weights, h, routing, cfg.block_n, cfg.block_k, cfg)
    weighted = torch.empty(num_pairs, w.hidden_size, dtype=x.dtype, device=x.device)
    _launch(h, 1, w, True, pair_weights, weighted, routing, cfg.block_n_down,
            cfg.block_k_down, cfg)
    return moe_sum(weighted.view(num_tokens, top_k, w.hidden_size))


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              weights: Experts, config: FusedMoeConfig | None = None) -> torch.Tensor:
    """x [M, H] fp16/bf16/fp32 (any strides), topk_ids int32/int64 [M, k] in [-1, E),
    topk_weights float [M, k] (routed_scaling_factor included) -> [M, H] in x.dtype: sum
    over slots j with topk_ids[m, j] >= 0 of topk_weights[m, j] * SwiGLU_{topk_ids[m, j]}(x[m])
    with the module docstring's semantics. INT4 or dense experts (dense ones in x.dtype).

    `config` overrides `choose_moe_config` (benchmarks and tests only). Raises ValueError for
    any operand outside the contract instead of launching.
    """
    check_fused_moe_args(x, topk_ids, topk_weights, weights)
    if config is not None:
        check_moe_config(config)
    if x.shape[0] == 0:
        return x.new_empty(0, weights.hidden_size)
    if x.shape[0] <= CHUNK_TOKENS:
        return _fused_moe_chunk(x, topk_ids, topk_weights, weights, config)
    return torch.cat([_fused_moe_chunk(x[rows], topk_ids[rows], topk_weights[rows], weights,
                                       config)
                      for rows in (slice(s, s + CHUNK_TOKENS)
                                   for s in range(0, x.shape[0], CHUNK_TOKENS))])
