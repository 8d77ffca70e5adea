"""INT4 (W4A16) routed experts as Kimi's INT4 releases store them.

A checkpoint quantized with compressed-tensors' `pack-quantized` format stores each routed
expert's projections as separate linears:

    {prefix}.{e}.{gate,up,down}_proj.weight_packed      int32 [out, in/8]
    {prefix}.{e}.{gate,up,down}_proj.weight_scale       [out, in/group] ([out, 1] channel-wise)
    {prefix}.{e}.{gate,up,down}_proj.weight_shape       int [2] = (out, in)
    {prefix}.{e}.{gate,up,down}_proj.weight_zero_point  int32 [ceil(out/8), groups] (asymmetric)

`Int4RoutedExperts` stacks them into kernels/moe_w4a16.py's `Int4ExpertWeights` layout at
load (expert e's gate_proj is shard 2e and its up_proj shard 2e + 1 of the `w13_*`
parameters, its down_proj shard e of the `w2_*` ones), so the fused MoE kernel and its
reference read them as they are; nothing is repacked. The loader (workers/models/loader.py) hands it
each tensor through `load_shard`, which checks shape, dtype and the `weight_shape` values.
"""

from __future__ import annotations

import torch
from torch import nn

from specd.kernels.int4_layout import PACK_FACTOR, SUPPORTED_GROUP_SIZES
from specd.kernels.moe_w4a16 import Int4ExpertWeights

# The checkpoint's tensor kinds of one quantized projection -> the parameter suffix.
INT4_KINDS = {"weight_packed": "_packed", "weight_scale": "_scale",
              "weight_zero_point": "_zero_point", "weight_shape": "_shape"}
_PROJECTIONS = ("gate", "up")


class Int4RoutedExperts(nn.Module):
    """E routed experts in INT4, H hidden, I intermediate (module docstring's layout).

    Parameters: w13_packed int32 [E, 2I, ceil(H/8)], w13_scale [E, 2I, groups(H)],
    w2_packed int32 [E, H, ceil(I/8)], w2_scale [E, H, groups(I)]; asymmetric checkpoints add
    w13_zero_point int32 [E, 2I/8, groups(H)] (gate's words, then up's: I must be a multiple
    of 8) and w2_zero_point int32 [E, ceil(H/8), groups(I)]; w13_shape int64 [E, 2, 2] and
    w2_shape int64 [E, 2] hold the checked `weight_shape` tensors. groups(K) = K / group_size,
    or 1 when group_size is None (channel-wise scales).
    """

    w13_zero_point: nn.Parameter | None
    w2_zero_point: nn.Parameter | None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 prefix: str, group_size: int | None, symmetric: bool,
                 scale_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if group_size is not None and group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"{prefix}: group_size must be one of {SUPPORTED_GROUP_SIZES} or "
                             f"None (channel-wise), got {group_size}")
        for name, size in (("hidden_size", hidden_size), ("moe_intermediate_size",
                                                          intermediate_size)):
            if group_size is not None and size % group_size:
                raise ValueError(f"{prefix}: group_size {group_size} does not divide {name} "
                                 f"{size}")
        if not symmetric and intermediate_size % PACK_FACTOR:
            raise ValueError(f"{prefix}: asymmetric experts need moe_intermediate_size "
                             f"({intermediate_size}) to be a multiple of 8 (gate and up zero "
                             f"points are stacked by whole words)")
        self.prefix = prefix
        self.group_size = group_size
        e, h, i = num_experts, hidden_size, intermediate_size
        self.intermediate_size = i
        groups_h, groups_i = (1, 1) if group_size is None else (h // group_size, i // group_size)
        self.w13_packed = _frozen(torch.empty(e, 2 * i, _words(h), dtype=torch.int32))
        self.w13_scale = _frozen(torch.empty(e, 2 * i, groups_h, dtype=scale_dtype))
        self.w2_packed = _frozen(torch.empty(e, h, _words(i), dtype=torch.int32))
        self.w2_scale = _frozen(torch.empty(e, h, groups_i, dtype=scale_dtype))
        self.w13_zero_point = None if symmetric else _frozen(
            torch.empty(e, 2 * i // PACK_FACTOR, groups_h, dtype=torch.int32))
        self.w2_zero_point = None if symmetric else _frozen(
            torch.empty(e, _words(h), groups_i, dtype=torch.int32))
        self.w13_shape = _frozen(torch.empty(e, 2, 2, dtype=torch.int64))
        self.w2_shape = _frozen(torch.empty(e, 2, dtype=torch.int64))
        self._expected_shape = {"w13": [i, h], "w2": [h, i]}

    def weights(self) -> Int4ExpertWeights:
        """The loaded experts as the operand of workers/models/moe.py's `experts_forward` (the fused
        kernel's layout, checked on construction)."""
        return Int4ExpertWeights(self.w13_packed, self.w13_scale, self.w2_packed,
                                 self.w2_scale, self.group_size, self.w13_zero_point,
                                 self.w2_zero_point)

    # The loader's interface for parameters filled shard by shard.
    def num_shards(self, leaf: str) -> int:
        return self.w13_packed.shape[0] * (2 if leaf.startswith("w13") else 1)

    def shard_name(self, leaf: str, shard: int) -> str:
        stack, _, kind = leaf.partition("_")
        if stack == "w13":
            expert, part = divmod(shard, 2)
            return f"{self.prefix}.{expert}.{_PROJECTIONS[part]}_proj.weight_{kind}"
        return f"{self.prefix}.{shard}.down_proj.weight_{kind}"

    def load_shard(self, leaf: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor `shard_name(leaf, shard)` into its slice of parameter `leaf`;
        ValueError naming it on a wrong shape, dtype or `weight_shape` value."""
        name = self.shard_name(leaf, shard)
        stack, _, kind = leaf.partition("_")
        if kind == "shape":
            expected = self._expected_shape[stack]
            if tensor.numel() != 2 or tensor.tolist() != expected:
                raise ValueError(f"{name} is {tensor.tolist()}, expected {expected}")
        elif kind in ("packed", "zero_point") and tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensor.dtype}")
        dest = self._shard_view(leaf, shard)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"{name} has shape {list(tensor.shape)}, expected "
                             f"{list(dest.shape)}")
        dest.copy_(tensor)

    def _shard_view(self, leaf: str, shard: int) -> torch.Tensor:
        param = getattr(self, leaf)
        if not leaf.startswith("w13"):
            return param.data[shard]
        expert, part = divmod(shard, 2)
        if leaf == "w13_shape":
            return param.data[expert, part]
        rows = param.shape[1] // 2  # I rows, or I/8 zero-point words
        return param.data[expert].narrow(0, part * rows, rows)


def _words(k: int) -> int:
    """int32 words holding k packed 4-bit values."""
    return -(-k // PACK_FACTOR)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)
