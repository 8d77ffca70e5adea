"""The merge of split-KV attention (flash-decoding): S partial results of one attention, each
over its share of the keys, combined into the attention over all of them. One kernel launch,
where the torch version (`merge_splits_ref`) takes about a dozen small kernels per layer.

Memory layout (what kernels/tree_attention.py and kernels/mla_attention.py write with
NUM_SPLITS > 1):

* partial fp32 [S, N, H, D], any strides: split s's attention output of row (n, h), already
  normalized by its own softmax sum (zeros where the split saw no key).
* lse fp32 [S, N, H], any strides: split s's log2-sum-exp of the scaled scores (log2 units),
  -inf where the split saw no key.
* out [N, H, D] (bf16, fp16 or fp32; any strides): written.

Semantics: with top = max_s lse[s] (0 when every split is empty) and w_s = 2^(lse[s] - top),
out = rnd(sum_s w_s * partial[s] / max(sum_s w_s, tiny)), computed in fp32 and rounded once to
out's dtype: a row that no split saw is 0. The kernel adds the splits in order s = 0, 1, ...;
the reference sums as torch does: the two agree to fp32 rounding (an output may differ by one
unit of its dtype after the final rounding).

Kernel: grid (N * H,), one program per row (n, h), the splits a static loop (S <= 16); the D
values of the row in one block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specd.kernels.common import INT32_MAX, max_offset, needs_emulation, round_to

MAX_SPLITS = 16


# ----------------------------------------------------------------------------- reference


def merge_splits_ref(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """partial [S, N, H, D] and lse [S, N, H] (module docstring) -> fp32 [N, H, D]."""
    top = lse.max(dim=0).values  # [N, H]
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp2(lse - top)  # [S, N, H]; empty splits (-inf) weigh 0
    total = weight.sum(dim=0).clamp(min=torch.finfo(torch.float32).tiny)
    return (partial * weight[..., None]).sum(dim=0) / total[..., None]


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, num_heads,
                         stride_ps, stride_pn, stride_ph, stride_pd,
                         stride_ls, stride_ln, stride_lh, stride_on, stride_oh, stride_od,
                         NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, EMULATE: tl.constexpr):
    """Grid (N * H,): row (n, h) = (pid // H, pid % H); see the module docstring."""
    pid = tl.program_id(0)
    n = (pid // num_heads).to(tl.int64)
    h = pid % num_heads
    lse_row = lse_ptr + n * stride_ln + h * stride_lh
    top = tl.load(lse_row)
    for s in tl.static_range(1, NUM_SPLITS):
        top = tl.maximum(top, tl.load(lse_row + s * stride_ls))
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: weights 0
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    partial_row = partial_ptr + n * stride_pn + h * stride_ph + offs_d * stride_pd
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = 0.0
    for s in tl.static_range(NUM_SPLITS):
        weight = tl.exp2(tl.load(lse_row + s * stride_ls) - top)
        total += weight
        acc += weight * tl.load(partial_row + s * stride_ps, mask=mask_d, other=0.0)
    merged = acc / tl.maximum(total, 1.1754943508222875e-38)  # fp32 tiny: empty rows are 0
    out = out_ptr + n * stride_on + h * stride_oh + offs_d * stride_od
    tl.store(out, round_to(merged, out_ptr.dtype.element_ty, EMULATE), mask=mask_d)


# ----------------------------------------------------------------------------- launcher


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the merge of `partial` [S, N, H, D] by `lse` [S, N, H] into `out` [N, H, D]
    (module docstring) with one `_merge_splits_kernel` launch; returns out. ValueError for
    operands outside the layout."""
    if partial.dim() != 4 or partial.dtype != torch.float32:
        raise ValueError(f"partial must be float32 [S, N, H, D], got {partial.dtype} "
                         f"{tuple(partial.shape)}")
    splits, n, heads, head_dim = partial.shape
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"between 1 and {MAX_SPLITS} splits, got {splits}")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (splits, n, heads):
        raise ValueError(f"lse must be float32 {[splits, n, heads]}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    if tuple(out.shape) != (n, heads, head_dim):
        raise ValueError(f"out must be [{n}, {heads}, {head_dim}], got {tuple(out.shape)}")
    for name, t in (("partial", partial), ("lse", lse), ("out", out)):
        if t.device != partial.device:
            raise ValueError(f"{name} is on {t.device}, partial on {partial.device}")
        if max_offset(t) > INT32_MAX:
            raise ValueError(f"{name}'s strides {t.stride()} address past 2**31 elements")
    if n * heads == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    _merge_splits_kernel[(n * heads,)](
        partial, lse, out, heads, *partial.stride(), *lse.stride(), *out.stride(),
        NUM_SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=block_d,
        EMULATE=needs_emulation(out), num_warps=4 if block_d <= 256 else 8)
    return out
