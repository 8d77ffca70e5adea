"""The compressed-tensors `pack-quantized` INT4 layout (W4A16) in pure torch: its constants,
unpacking, dequantization and shape checks, shared by the dense GEMM (kernels/int4_gemm.py,
whose docstring describes the layout in full), the fused MoE (kernels/moe_w4a16.py) and the
loader (workers/models/quantization.py).

W[n, k] = (q[n, k] - z[n, g]) * scale[n, g], g = k // group_size: `weight_packed` int32
[N, K/8] (eight 4-bit values per word along K, least significant nibble first, stored + 8),
`weight_scale` [N, K/group_size] ([N, 1] channel-wise), optional `weight_zero_point` int32
[ceil(N/8), G] packed along N.
"""

from __future__ import annotations

import torch
import triton

SUPPORTED_GROUP_SIZES = (32, 64, 128)
SUPPORTED_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # fp32: IEEE products
SUPPORTED_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PACK_FACTOR = 8  # int4 values per int32 word


def unpack_int4(weight_packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [N, ceil(K/8)] -> int8 [N, K] in [-8, 7]; element 8j+i is nibble i of word j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=weight_packed.device)  # [8]
    nibbles = (weight_packed.unsqueeze(-1) >> shifts) & 0xF  # [N, K/8, 8]
    values = nibbles.reshape(weight_packed.shape[0], -1)[:, :in_features]
    return (values - 8).to(torch.int8)


def unpack_zero_point(weight_zero_point: torch.Tensor, out_features: int) -> torch.Tensor:
    """int32 [ceil(N/8), G] packed along N -> int8 [N, G] zero points in [-8, 7]."""
    return unpack_int4(weight_zero_point.t(), out_features).t()


def dequantize_int4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                    group_size: int | None, in_features: int,
                    dtype: torch.dtype | None = None,
                    weight_zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weight [N, K] = (q - z) * scale[:, k // group_size], computed in float32 and
    rounded once to `dtype` (default: the scale's dtype, which is what compressed-tensors'
    decompression yields). group_size None: channel-wise scales [N, 1]; z = 0 without
    `weight_zero_point` (int32 [ceil(N/8), G], see the module docstring)."""
    group = group_size or in_features
    q = unpack_int4(weight_packed, in_features).float()  # [N, K]
    if weight_zero_point is not None:
        zero = unpack_zero_point(weight_zero_point, weight_packed.shape[0]).float()  # [N, G]
        q = q - zero.repeat_interleave(group, dim=1)[:, :in_features]
    scale = weight_scale.float().repeat_interleave(group, dim=1)[:, :in_features]
    return (q * scale).to(dtype or weight_scale.dtype)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same 2-D tensor stored N-contiguous (stride (1, rows)): the kernels' fast layout."""
    return t.t().contiguous().t()


# ----------------------------------------------------------------------------- kernels


def check_quantized_weight(name: str, packed: torch.Tensor, scale: torch.Tensor,
                           zero_point: torch.Tensor | None, group_size: int | None,
                           n: int, k: int) -> None:
    """Raise ValueError naming `{name}_packed`/`_scale`/`_zero_point` unless the tensors are
    one INT4 weight [n, k] (leading dimensions allowed, e.g. experts) in the module's layout;
    group_size None is channel-wise."""
    if group_size is not None and group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES} or None "
                         f"(channel-wise), got {group_size}")
    if group_size is not None and k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K = {k}")
    lead = tuple(packed.shape[:-2])
    groups = 1 if group_size is None else k // group_size
    expected = {f"{name}_packed": (packed, (*lead, n, triton.cdiv(k, PACK_FACTOR)), "int32"),
                f"{name}_scale": (scale, (*lead, n, groups), "bf16/fp16/fp32"),
                f"{name}_zero_point": (zero_point, (*lead, triton.cdiv(n, PACK_FACTOR), groups),
                                       "int32")}
    for label, (t, shape, dtypes) in expected.items():
        if t is None:
            continue
        dtype_ok = (t.dtype in SUPPORTED_SCALE_DTYPES if label.endswith("_scale")
                    else t.dtype == torch.int32)
        if not dtype_ok or tuple(t.shape) != shape:
            raise ValueError(f"{label} must be {dtypes} {list(shape)}, got {t.dtype} "
                             f"{list(t.shape)}")
