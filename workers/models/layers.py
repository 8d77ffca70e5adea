"""Building blocks of the decoder: RMSNorm, rotary embedding, and the one place linears are made.

Numerics follow transformers' Llama family exactly (RMSNorm in float32, then cast; rope
frequencies in float32, cos/sin cast to the activation dtype), so that parity tests can hold
fp32 models to a tight tolerance.
"""

from __future__ import annotations

import math
from typing import Protocol, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.config import CPU_LINEAR_KERNELS
from specd.workers.models.config import RopeScaling
from specd.workers.models.rope import yarn_parameters


class LinearFactory(Protocol):
    """Makes every linear layer of a model (the INT4 engineer supplies a quantized one).

    in_features/out_features: the layer's (possibly fused) shape; bias: whether it has one;
    names: the checkpoint module names fused into it, in output order (for example
    `("model.layers.0.self_attn.q_proj", "...k_proj", "...v_proj")`), so that a factory can
    match a quantization config's `ignore` list. The module must map [..., in] -> [..., out]
    and name its output-major parameters so that the loader can stack shards along dim 0.
    """

    def __call__(self, in_features: int, out_features: int, bias: bool,
                 names: tuple[str, ...]) -> nn.Module: ...


def dense_linear(in_features: int, out_features: int, bias: bool,
                 names: tuple[str, ...]) -> nn.Module:
    """The unquantized linear: `nn.Linear` (on whatever device the build context sets)."""
    del names  # a dense layer is the same whatever it is called
    return nn.Linear(in_features, out_features, bias=bias)


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the statistic computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.device.type == "cpu":
            # One call instead of six: on the CPU each op's dispatch is paid, and ATen's
            # rms_norm there is these same float32 ops, bit for bit (elsewhere it may be a
            # fused kernel that reduces in another order).
            if dtype == self.weight.dtype == torch.float32:
                return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        else:
            x32 = x.float()
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(dtype)


class RotaryEmbedding:
    """Rotary position embedding over the whole head (rotate-half layout, as transformers).

    Not an nn.Module: it holds no weights, only the float32 inverse frequencies, built on the
    target device so that the meta-device model build leaves it intact. `cos_sin` is computed
    once per forward and shared by every layer.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None,
                 device: torch.device) -> None:
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (theta ** (exponents / head_dim))  # [head_dim / 2]
        self.attention_scaling = 1.0  # cos and sin are multiplied by it (YaRN)
        if scaling is not None and scaling.rope_type == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling is not None and scaling.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif scaling is not None and scaling.rope_type == "yarn":
            inv_freq, self.attention_scaling = yarn_parameters(head_dim, theta, scaling, device)
        self.inv_freq = inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [N] -> (cos, sin), each [N, 1, head_dim / 2] in `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [N, head_dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] rotated by (cos, sin) [N, 1, head_dim / 2]: the pair (i, i + d/2)
    turns by the angle of frequency i (transformers' `x * cos + rotate_half(x) * sin`)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency rescaling: long wavelengths divided by `factor`, short ones kept,
    the band between interpolated smoothly (transformers' `_compute_llama3_parameters`)."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class PackedLinear(nn.Module):
    """A bfloat16 or float32 linear whose weight oneDNN lays out once, at load, for its own
    GEMM kernels (CPU). In bfloat16 the same arithmetic as `nn.Linear` (bit-identical in the
    tests), without the per-call re-layout of the weight that dominates a small-batch bf16
    GEMM (about 20% of a batch-1 decode step of the fixture). In float32 `nn.Linear` runs
    MKL's sgemm, which on this project's AMD EPYC VM took 1.3-2.2x oneDNN's packed kernel
    (the fixture's 48 layer linears: 2.3 vs 1.9 ms at 1 row, 4.0 vs 3.0 at 8, 46 vs 21 at
    256); the sums then differ in rounding (about 1e-5), not in what they compute."""

    packed_weight: torch.Tensor
    weight: nn.Parameter | None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, keep_plain: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, 1))
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias)
        # keep_plain: torch.compile cannot lower the packed op (cpu_decode.py); code it
        # compiles reads this copy instead (its freezing packs it again). Twice the memory.
        # A parameter, not a buffer: inductor's freezing folds (and packs) parameters.
        self.weight = nn.Parameter(weight, requires_grad=False) if keep_plain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if self.weight is None:
                raise ValueError("a PackedLinear without its plain weight cannot be compiled "
                                 "(prepare_cpu_linears(..., keep_plain=True))")
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none",
                                                  [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


class TransposedLinear(nn.Module):
    """A float32 linear whose weight is held transposed, [in, out] contiguous, and run as
    `x @ weight_t` (`torch.mm`, `torch.addmm` with a bias): the same products as
    `nn.Linear`, summed by the same BLAS (sums differ by rounding, about 1e-6), with the
    operand BLAS streams laid out row by row. On a CPU whose memory bandwidth bounds a
    one-row GEMM this ran faster than both `nn.Linear` and `PackedLinear` (measured per
    machine at load: workers/runner/cpu_linears.py). torch.compile lowers `mm` to the
    same extern GEMM, so compiled and eager steps compute alike. `weight` is the
    [out, in] view of the same storage, for code that reads a linear's weight."""

    weight_t: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = (torch.mm(rows, self.weight_t) if self.bias is None
               else torch.addmm(self.bias, rows, self.weight_t))
        return out.reshape(*x.shape[:-1], self.out_features)


def prepare_cpu_linears(model: nn.Module, float32_kernel: str,
                        keep_plain: bool = False) -> int:
    """Replace the dense linears of a CPU model for the kernels that run them; returns how
    many were replaced. bfloat16 ones become `PackedLinear` where this CPU can pack them
    (`bf16_packing_unsupported`; keep_plain: see PackedLinear). float32 ones by
    `float32_kernel` (workers/runner/cpu_linears.py chooses it): "onednn" `PackedLinear`
    (where oneDNN is built in), "transposed" `TransposedLinear`, "mkl" kept `nn.Linear`."""
    if float32_kernel not in CPU_LINEAR_KERNELS:
        raise ValueError(f"float32_kernel must be one of {CPU_LINEAR_KERNELS}, "
                         f"not {float32_kernel!r}")
    pack_bf16 = bf16_packing_unsupported() is None
    pack_fp32 = float32_kernel == "onednn" and torch.backends.mkldnn.is_available()
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not can_pack(child):
                continue
            dtype = child.weight.dtype
            replacement: nn.Module | None = None
            if (dtype == torch.bfloat16 and pack_bf16) or (dtype == torch.float32 and pack_fp32):
                replacement = PackedLinear(child, keep_plain)
            elif dtype == torch.float32 and float32_kernel == "transposed":
                replacement = TransposedLinear(child)
            if replacement is not None:
                setattr(module, name, replacement)
                count += 1
    return count


def bf16_packing_unsupported() -> str | None:
    """Why oneDNN cannot pack bfloat16 linears here, in one line, or None where it can.

    oneDNN's bf16 GEMM needs avx_ne_convert, or avx512bw + avx512vl + avx512dq (an AVX2-only
    CPU has neither: `_reorder_linear_weight` raises there); torch asks oneDNN itself, so an
    `ONEDNN_MAX_CPU_ISA` cap counts as the CPU's limit too."""
    if not torch.backends.mkldnn.is_available():
        return "torch is built without oneDNN"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return ("oneDNN's bf16 GEMM needs avx_ne_convert, or avx512bw, avx512vl and avx512dq, "
                "which this CPU lacks")
    return None


def can_pack(module: nn.Module | None) -> TypeGuard[nn.Linear]:
    """Whether `module` is a linear `PackedLinear` can replace (bf16 or float32, on the
    CPU); whether the CPU can pack bf16 at all is `bf16_packing_unsupported`."""
    return (isinstance(module, nn.Linear)
            and module.weight.dtype in (torch.bfloat16, torch.float32)
            and module.weight.device.type == "cpu")
