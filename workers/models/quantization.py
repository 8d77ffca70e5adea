"""INT4 (W4A16) checkpoints in the compressed-tensors `pack-quantized` format.

* `QuantConfig` and `is_quantized` (workers/models/quant_config.py): what a checkpoint's
  `quantization_config` says, and whether it makes a linear module INT4;
  `StoredLinears` and `linear_is_int4` (workers/models/quant_stored.py): whether the linear
  loads INT4, the checkpoint's own tensors considered (lm_head only when stored packed).
* `Int4Linear` holds `weight_packed` int32 [out, in/8], `weight_scale` [out, in/group]
  ([out, 1] channel-wise), `weight_zero_point` int32 [ceil(out/8), groups] when asymmetric and
  `weight_shape` [2]; its forward is `int4_linear`, the one function that picks the Triton
  kernel on CUDA and the pure-torch reference elsewhere.
* `Int4LinearFactory`: the model's linear factory for a quantized checkpoint; MoE layers ask
  it (`is_quantized`, `quant_config`) whether and how their routed experts are INT4
  (workers/models/moe.py's `build_routed_experts`, workers/models/moe_int4.py).
* `pack_int4` / `unpack_int4` and `quantize_rtn` (round-to-nearest, symmetric, per group).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specd.kernels.int4_gemm import int4_gemm, int4_gemm_ref
from specd.kernels.int4_layout import (
    PACK_FACTOR,
    SUPPORTED_GROUP_SIZES,
    dequantize_int4,
    unpack_int4,
)
from specd.workers.models.quant_config import COMPRESSED_TENSORS_VERSION, QuantConfig, is_quantized
from specd.workers.models.quant_stored import OUTPUT_PROJECTION, StoredLinears, linear_is_int4

__all__ = [
    "COMPRESSED_TENSORS_VERSION", "Int4Linear", "Int4LinearFactory", "QuantConfig",
    "StoredLinears", "dequantize_int4", "int4_linear", "is_quantized", "linear_factory_for",
    "make_linear_factory", "pack_int4", "quantize_rtn", "unpack_int4",
]

# ----------------------------------------------------------------------------- packing


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] values in [-8, 7] -> int32 [N, ceil(K/8)]: u = q + 8, element 8j+i in bits
    [4i, 4i+4) of word j; nibbles past K are 0 (u, not q: as compressed-tensors pads)."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"pack_int4 needs a 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
    if q.numel() and (q.min() < -8 or q.max() > 7):
        raise ValueError("pack_int4 values must lie in [-8, 7]")
    n, k = q.shape
    padded = torch.zeros((n, -(-k // PACK_FACTOR) * PACK_FACTOR), dtype=torch.int32,
                         device=q.device)
    padded[:, :k] = q.to(torch.int32) + 8
    u = padded.view(n, -1, PACK_FACTOR)  # [N, K/8, 8]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    # Nibbles occupy disjoint bits, so the sum is a bitwise OR; int32 wraps for bit 31.
    return (u << shifts).sum(dim=-1, dtype=torch.int32)


def quantize_rtn(weight: torch.Tensor, group_size: int,
                 scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric INT4 per group of `group_size` input columns.

    weight [N, K] (any float) -> (weight_packed int32 [N, K/8], weight_scale [N, K/group]).
    The scale uses the whole signed range without clipping: max(max_pos / 7, max_neg / 8), so
    the most negative value maps to -8 or the most positive to 7; it is rounded to
    `scale_dtype` before q = clamp(round(w / scale), -8, 7) is computed against it.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    w = weight.float().view(n, k // group_size, group_size)
    pos = w.amax(dim=-1).clamp(min=0) / 7
    neg = (-w.amin(dim=-1)).clamp(min=0) / 8
    scale = torch.maximum(pos, neg).to(scale_dtype)  # [N, K/group]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # all-zero group
    q = torch.round(w / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
    return pack_int4(q.view(n, k)), scale


# ----------------------------------------------------------------------------- the layer


def int4_linear(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                group_size: int | None,
                weight_zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N]: the Triton INT4 GEMM on CUDA, its pure-torch reference elsewhere
    (group_size None: channel-wise scales; weight_zero_point None: symmetric)."""
    if x.is_cuda:
        return int4_gemm(x, weight_packed, weight_scale, group_size,
                         weight_zero_point=weight_zero_point)
    return int4_gemm_ref(x, weight_packed, weight_scale, group_size, weight_zero_point)


class Int4Linear(nn.Module):
    """A W4A16 linear layer: y = x @ dequant(weight_packed, weight_scale, weight_zero_point).T
    + bias.

    Parameters (all without grad): `weight_packed` int32 [out, in/8], `weight_scale`
    [out, groups] (groups = in/group_size, or 1 channel-wise: group_size None),
    `weight_zero_point` int32 [ceil(out/8), groups] packed along the output rows (asymmetric
    only) and `bias` [out] (optional) are output-major, so the shards of a fused layer (q/k/v,
    gate/up) fill consecutive rows (eight rows per zero-point word: an asymmetric fused shard
    must start and end on a multiple of 8); `weight_shape` int64 [2] = (out, in) is the whole
    layer's shape, checked against each shard's `weight_shape` tensor on load. The scale takes
    the model's float dtype on load (bf16 -> fp32/fp16 is exact for scales in the fp16 normal
    range).
    """

    weight_zero_point: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int | None,
                 scale_dtype: torch.dtype = torch.bfloat16, symmetric: bool = True) -> None:
        super().__init__()
        if group_size is not None and group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES} or None "
                             f"(channel-wise), got {group_size}")
        if group_size is not None and in_features % group_size:
            raise ValueError(f"group_size {group_size} does not divide in_features "
                             f"{in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        groups = in_features // group_size if group_size else 1
        # [out, in/8] and [out, groups] stored output-contiguous (stride (1, out)), the
        # layout the INT4 GEMM reads coalesced; loading shards into rows works the same.
        self.weight_packed = _frozen(torch.empty(-(-in_features // PACK_FACTOR), out_features,
                                                 dtype=torch.int32).t())
        self.weight_scale = _frozen(torch.empty(groups, out_features, dtype=scale_dtype).t())
        self.weight_zero_point = None if symmetric else _frozen(torch.empty(
            -(-out_features // PACK_FACTOR), groups, dtype=torch.int32))
        self.weight_shape = _frozen(torch.tensor([out_features, in_features], dtype=torch.int64))
        self.bias = _frozen(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x.dtype."""
        y = int4_linear(x.reshape(-1, self.in_features), self.weight_packed,
                        self.weight_scale, self.group_size, self.weight_zero_point)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def load_weight(self, name: str, tensor: torch.Tensor, shard: int | None,
                    shard_sizes: tuple[int, ...] | None) -> None:
        """Copy checkpoint tensor `name` (weight_packed, weight_scale, weight_zero_point,
        weight_shape or bias) of shard `shard` (None: the whole layer) into its rows;
        ValueError on any mismatch."""
        offset, rows = 0, self.out_features
        if shard is not None:
            if shard_sizes is None or sum(shard_sizes) != self.out_features:
                raise ValueError(f"shard sizes {shard_sizes} do not add up to out_features "
                                 f"{self.out_features}")
            offset, rows = sum(shard_sizes[:shard]), shard_sizes[shard]
        if name == "weight_shape":
            check_weight_shape(name, tensor, rows, self.in_features)
            self.weight_shape.data.copy_(torch.tensor([self.out_features, self.in_features]))
            return
        if name == "weight_g_idx":
            raise ValueError("weight_g_idx: activation ordering by group (a g_idx permutation) "
                             "is not supported; only actorder null, static or weight")
        params = {"weight_packed": self.weight_packed, "weight_scale": self.weight_scale,
                  "weight_zero_point": self.weight_zero_point, "bias": self.bias}
        param = params.get(name)
        if param is None:
            held = [n for n, p in params.items() if p is not None]
            raise ValueError(f"an INT4 linear of this checkpoint has no tensor {name!r} "
                             f"(expected one of {', '.join(held)}, weight_shape)")
        if name == "weight_zero_point":
            if offset % PACK_FACTOR or (rows % PACK_FACTOR and offset + rows < self.out_features):
                raise ValueError(f"weight_zero_point of a fused shard of rows [{offset}, "
                                 f"{offset + rows}) cannot be stacked: zero points pack 8 rows "
                                 f"per word")
            offset, rows = offset // PACK_FACTOR, -(-rows // PACK_FACTOR)
        dest = param.data.narrow(0, offset, rows)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"{name} has shape {list(tensor.shape)}, expected "
                             f"{list(dest.shape)}")
        if name in ("weight_packed", "weight_zero_point") and tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensor.dtype}")
        dest.copy_(tensor)

    def dequantized_weight(self) -> torch.Tensor:
        """The dense weight [out, in] in the scale dtype (what compressed-tensors decompresses)."""
        return dequantize_int4(self.weight_packed, self.weight_scale, self.group_size,
                               self.in_features, weight_zero_point=self.weight_zero_point)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, "
                f"symmetric={self.weight_zero_point is None}, bias={self.bias is not None}")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def check_weight_shape(name: str, weight_shape: torch.Tensor, out_features: int,
                       in_features: int) -> None:
    """Raise ValueError unless a checkpoint's `weight_shape` tensor (int32 or int64) equals
    [out_features, in_features] of the shard it describes."""
    if weight_shape.numel() != 2 or weight_shape.tolist() != [out_features, in_features]:
        raise ValueError(f"{name} is {weight_shape.tolist()}, expected "
                         f"[{out_features}, {in_features}]")


def linear_factory_for(quantization_config: Mapping[str, Any] | None,
                       dense: Callable[..., nn.Module],
                       name_prefix: str = "",
                       stored: StoredLinears | None = None) -> Callable[..., nn.Module]:
    """The linear factory for a checkpoint whose config.json holds `quantization_config`
    (None: `dense` itself); ValueError if the config is not one specd supports. name_prefix:
    `ModelConfig.weight_prefix`; stored: what the checkpoint stores (see `Int4LinearFactory`)."""
    if quantization_config is None:
        return dense
    return make_linear_factory(QuantConfig.from_dict(quantization_config), dense, name_prefix,
                               stored)


@dataclass(frozen=True)
class Int4LinearFactory:
    """A `LinearFactory` (workers/models/layers.py) for a quantized checkpoint: Int4Linear
    where every fused name loads INT4, `dense(...)` where none does, ValueError where the
    shards disagree. `quant_config` is the scheme, read by MoE layers to build INT4 routed
    experts.

    Names are matched against `targets` and `ignore` as the checkpoint spells them:
    `name_prefix` + the model's module name (Kimi-K2.5's language model sits under
    `language_model.`), as compressed-tensors matches the checkpoint's own modules. Whether a
    linear loads INT4 is `quant_stored.linear_is_int4` against `stored`, the checkpoint's
    tensors (None: the config alone, lm_head dense): as the config says, lm_head only when
    stored packed (checkpoint_check logs the one line saying so when the config alone would
    make it INT4), a module stored packed that the config leaves dense refused naming the
    rule."""

    quant_config: QuantConfig
    dense: Callable[..., nn.Module]
    name_prefix: str = ""
    stored: StoredLinears | None = None

    def is_quantized(self, name: str) -> bool:
        """Whether the model's module `name` loads INT4 (ValueError naming the tensor and the
        rule where the checkpoint stores it packed and the config leaves it dense)."""
        return linear_is_int4(self.name_prefix + name, self.quant_config, self.stored,
                              output_projection=name == OUTPUT_PROJECTION)

    def __call__(self, in_features: int, out_features: int, bias: bool,
                 names: tuple[str, ...]) -> nn.Module:
        flags = [self.is_quantized(name) for name in names]
        if not any(flags):
            return self.dense(in_features, out_features, bias, names)
        if not all(flags):
            raise ValueError(f"fused linear {names} mixes INT4 and dense shards "
                             f"({dict(zip(names, flags, strict=True))}); it cannot be fused")
        return Int4Linear(in_features, out_features, bias, self.quant_config.group_size,
                          symmetric=self.quant_config.symmetric)


def make_linear_factory(qcfg: QuantConfig | None, dense: Callable[..., nn.Module],
                        name_prefix: str = "",
                        stored: StoredLinears | None = None) -> Callable[..., nn.Module]:
    """The linear factory for a checkpoint quantized under `qcfg` (None: `dense` itself)."""
    return dense if qcfg is None else Int4LinearFactory(qcfg, dense, name_prefix, stored)
