"""Helpers shared by the kernels: the device's SM count, the int32 addressing bound, and
rounding and `tl.dot` that also hold under the CPU interpreter with bf16.

Triton 3.9's interpreter (TRITON_INTERPRET=1) stores bf16 as uint16 and gets two things wrong
that the GPU gets right: `tl.dot` on bf16 multiplies the bit patterns as integers, and fp32 ->
bf16 casts truncate instead of rounding to nearest even. Kernels pass EMULATE=True when they
run under the interpreter with bf16 operands; the helpers then compute the GPU's result by
other means, so the interpreter tests check the GPU's arithmetic. float32 operands take the
same path on every device (`needs_emulation`): `tl.dot` on fp32 defaults to TF32 on the GPU
(a 10-bit mantissa), and the path multiplies in IEEE fp32 instead, so float32 is exact
arithmetic (as torch's default, `allow_tf32` off) wherever it runs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

INT32_MAX = 2**31 - 1  # kernels compute offsets in int32: no operand may address past it


def max_offset(t: torch.Tensor) -> int:
    """The largest element offset `t`'s shape and strides address (from its first element)."""
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))


def needs_emulation(t: torch.Tensor) -> bool:
    """The kernels' EMULATE flag for operands like `t` (module docstring): bf16 off CUDA (the
    interpreter), and float32 everywhere (IEEE products, not TF32)."""
    return t.dtype == torch.float32 or (t.device.type != "cuda" and t.dtype == torch.bfloat16)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; an H200's 132 under the CPU interpreter."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 x rounded to nearest even in DTYPE. With EMULATE and bf16 the rounding is done on
    the bits (exact for finite x), after which the interpreter's truncating cast is exact."""
    if EMULATE and tl.bfloat16 == DTYPE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def dot_acc(a, b, acc, EMULATE: tl.constexpr):
    """acc + a @ b with fp32 accumulation. With EMULATE the same (exactly representable) values
    are multiplied in IEEE fp32, which is what the GPU's bf16 tensor-core product computes
    (and, for fp32 operands, the exact product rather than TF32's)."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)
