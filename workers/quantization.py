"""INT4 (W4A16) checkpoints in the compressed-tensors `pack-quantized` format.

* `QuantConfig.from_dict(config.json["quantization_config"])` accepts exactly what specd can
  serve: quant_method compressed-tensors, format pack-quantized, status compressed, one config
  group of 4-bit symmetric int weights with the group strategy and group size 32/64/128, no
  activation or KV-cache quantization. Anything else is a ValueError naming the option.
* `is_quantized(module_name, qcfg)`: a linear module is INT4 when a target matches it ("Linear"
  matches every linear; other targets are exact names or `re:` patterns matched from the start
  of the name, as compressed-tensors' `match_name`) and no `ignore` entry does.
* `Int4Linear` holds `weight_packed` int32 [out, in/8], `weight_scale` [out, in/group] and
  `weight_shape` [2]; its forward is `int4_linear`, the one function that picks the Triton
  kernel on CUDA and the pure-torch reference elsewhere.
* `pack_int4` / `unpack_int4` and `quantize_rtn` (round-to-nearest, symmetric, per group).
"""

from __future__ import annotations

import re
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

__all__ = [
    "Int4Linear", "QuantConfig", "build_int4_linear", "dequantize_int4", "int4_linear",
    "is_quantized", "linear_factory_for", "make_linear_factory", "pack_int4", "quantize_rtn",
    "unpack_int4",
]

# Keys whose value does not change how weights are stored or computed (bookkeeping written by
# compressed-tensors / llm-compressor); every other key is checked.
_INFO_TOP_KEYS = {"version", "global_compression_ratio"}
_INFO_WEIGHT_KEYS = {"observer", "observer_kwargs", "zp_dtype"}


@dataclass(frozen=True)
class QuantConfig:
    """The INT4 scheme of a checkpoint: its group size and which linears are quantized."""

    group_size: int
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    num_bits: int = 4

    def __post_init__(self) -> None:
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"quantization_config weights.group_size must be one of "
                             f"{SUPPORTED_GROUP_SIZES}, got {self.group_size}")
        if self.num_bits != 4:
            raise ValueError(f"quantization_config weights.num_bits must be 4, got "
                             f"{self.num_bits}")
        for pattern in (*self.targets, *self.ignore):
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern.removeprefix("re:"))
                except re.error as e:
                    raise ValueError(f"quantization_config pattern {pattern!r}: {e}") from e

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> QuantConfig:
        """Parse config.json's `quantization_config`; ValueError naming any unsupported option."""
        _expect(raw, "quant_method", ("compressed-tensors",))
        _expect(raw, "format", ("pack-quantized",), optional=True)
        _expect(raw, "quantization_status", ("compressed",), optional=True)
        for key in ("kv_cache_scheme", "sparsity_config", "transform_config",
                    "moe_sparsity_config"):
            if raw.get(key):
                raise ValueError(f"quantization_config.{key} is not supported, got {raw[key]!r}")
        known = {"quant_method", "format", "quantization_status", "config_groups", "ignore",
                 "kv_cache_scheme", "sparsity_config", "transform_config",
                 "moe_sparsity_config", *_INFO_TOP_KEYS}
        _reject_unknown(raw, known, "quantization_config")
        groups = raw.get("config_groups")
        if not isinstance(groups, Mapping) or len(groups) != 1:
            raise ValueError("quantization_config.config_groups must hold exactly one group, "
                             f"got {groups!r}")
        (group_name, group), = groups.items()
        where = f"quantization_config.config_groups.{group_name}"
        _reject_unknown(group, {"targets", "weights", "input_activations",
                                "output_activations", "format"}, where)
        _expect(group, "format", ("pack-quantized", None), optional=True, where=where)
        for key in ("input_activations", "output_activations"):
            if group.get(key) is not None:
                raise ValueError(f"{where}.{key} must be null (weight-only W4A16), got "
                                 f"{group[key]!r}")
        targets = group.get("targets")
        ignore = raw.get("ignore") or []
        if not isinstance(targets, list) or not targets:
            raise ValueError(f"{where}.targets must be a non-empty list, got {targets!r}")
        if not isinstance(ignore, list):
            raise ValueError(f"quantization_config.ignore must be a list, got {ignore!r}")
        return cls(group_size=_parse_weights(group.get("weights"), f"{where}.weights"),
                   targets=tuple(targets), ignore=tuple(ignore))

    def to_dict(self) -> dict[str, Any]:
        """The `quantization_config` entry exactly as compressed-tensors writes it (sorted keys,
        version of the compressed-tensors release whose layout this matches)."""
        weights = {"dynamic": False, "group_size": self.group_size, "num_bits": self.num_bits,
                   "strategy": "group", "symmetric": True, "type": "int"}
        group = {"format": "pack-quantized", "input_activations": None,
                 "output_activations": None, "targets": list(self.targets), "weights": weights}
        return {"config_groups": {"group_0": group}, "format": "pack-quantized",
                "global_compression_ratio": None, "ignore": list(self.ignore),
                "kv_cache_scheme": None, "moe_sparsity_config": None,
                "quant_method": "compressed-tensors", "quantization_status": "compressed",
                "sparsity_config": {}, "transform_config": {},
                "version": COMPRESSED_TENSORS_VERSION}


# The compressed-tensors release whose config.json layout `QuantConfig.to_dict` reproduces
# (tests/unit/test_quantization.py compares the two).
COMPRESSED_TENSORS_VERSION = "0.20.1"


def _expect(d: Mapping[str, Any], key: str, allowed: tuple[Any, ...], optional: bool = False,
            where: str = "quantization_config") -> None:
    if key not in d and optional:
        return
    if d.get(key) not in allowed:
        raise ValueError(f"{where}.{key} must be one of {allowed}, got {d.get(key)!r}")


def _reject_unknown(d: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where} has unsupported option(s) {unknown}")


def _parse_weights(w: Any, where: str) -> int:
    """Check a group's `weights` args; return the group size."""
    if not isinstance(w, Mapping):
        raise ValueError(f"{where} must be an object, got {w!r}")
    _reject_unknown(w, {"num_bits", "type", "symmetric", "strategy", "group_size", "dynamic",
                        "actorder", "block_structure", "scale_dtype", *_INFO_WEIGHT_KEYS}, where)
    _expect(w, "num_bits", (4,), where=where)
    _expect(w, "type", ("int",), where=where)
    _expect(w, "symmetric", (True,), where=where)
    _expect(w, "strategy", ("group",), where=where)
    _expect(w, "dynamic", (False,), optional=True, where=where)
    _expect(w, "actorder", (None, False), optional=True, where=where)
    _expect(w, "block_structure", (None,), optional=True, where=where)
    _expect(w, "scale_dtype", (None, "torch.bfloat16", "torch.float16", "bfloat16", "float16"),
            optional=True, where=where)
    group_size = w.get("group_size")
    if not isinstance(group_size, int) or group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{where}.group_size must be one of {SUPPORTED_GROUP_SIZES}, got "
                         f"{group_size!r}")
    return group_size


def _match_name(name: str, pattern: str) -> bool:
    """compressed-tensors' `match_name`: `re:` patterns with re.match, else exact equality."""
    if pattern.startswith("re:"):
        return re.match(pattern.removeprefix("re:"), name) is not None
    return pattern == name


def is_quantized(module_name: str, qcfg: QuantConfig | None) -> bool:
    """Whether the linear module `module_name` (checkpoint name, e.g.
    "model.layers.0.self_attn.q_proj") is stored as INT4 under `qcfg`."""
    if qcfg is None:
        return False
    targeted = any(t == "Linear" or _match_name(module_name, t) for t in qcfg.targets)
    return targeted and not any(_match_name(module_name, p) for p in qcfg.ignore)


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
                group_size: int) -> torch.Tensor:
    """x [M, K] -> [M, N]: the Triton INT4 GEMM on CUDA, its pure-torch reference elsewhere."""
    if x.is_cuda:
        return int4_gemm(x, weight_packed, weight_scale, group_size)
    return int4_gemm_ref(x, weight_packed, weight_scale, group_size)


class Int4Linear(nn.Module):
    """A W4A16 linear layer: y = x @ dequant(weight_packed, weight_scale).T + bias.

    Parameters (all without grad): `weight_packed` int32 [out, in/8], `weight_scale`
    [out, in/group_size] and `bias` [out] (optional) are output-major, so the shards of a fused
    layer (q/k/v, gate/up) fill consecutive rows; `weight_shape` int64 [2] = (out, in) is the
    whole layer's shape, checked against each shard's `weight_shape` tensor on load. The
    scale takes the model's float dtype on load (bf16 -> fp32/fp16 is exact for scales in the
    fp16 normal range).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int,
                 scale_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got "
                             f"{group_size}")
        if in_features % group_size:
            raise ValueError(f"group_size {group_size} does not divide in_features "
                             f"{in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        # [out, in/8] and [out, in/group] stored output-contiguous (stride (1, out)), the
        # layout the INT4 GEMM reads coalesced; loading shards into rows works the same.
        self.weight_packed = _frozen(torch.empty(in_features // PACK_FACTOR, out_features,
                                                 dtype=torch.int32).t())
        self.weight_scale = _frozen(torch.empty(in_features // group_size, out_features,
                                                dtype=scale_dtype).t())
        self.weight_shape = _frozen(torch.tensor([out_features, in_features], dtype=torch.int64))
        self.bias = _frozen(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x.dtype."""
        y = int4_linear(x.reshape(-1, self.in_features), self.weight_packed,
                        self.weight_scale, self.group_size)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def load_weight(self, name: str, tensor: torch.Tensor, shard: int | None,
                    shard_sizes: tuple[int, ...] | None) -> None:
        """Copy checkpoint tensor `name` (weight_packed, weight_scale, weight_shape or bias) of
        shard `shard` (None: the whole layer) into its rows; ValueError on any mismatch."""
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
        params = {"weight_packed": self.weight_packed, "weight_scale": self.weight_scale,
                  "bias": self.bias}
        param = params.get(name)
        if param is None:
            raise ValueError(f"an INT4 linear has no tensor {name!r} (expected one of "
                             f"weight_packed, weight_scale, weight_shape"
                             f"{', bias' if self.bias is not None else ''})")
        dest = param.data.narrow(0, offset, rows)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"{name} has shape {list(tensor.shape)}, expected "
                             f"{list(dest.shape)}")
        if name == "weight_packed" and tensor.dtype != torch.int32:
            raise ValueError(f"weight_packed must be int32, got {tensor.dtype}")
        dest.copy_(tensor)

    def dequantized_weight(self) -> torch.Tensor:
        """The dense weight [out, in] in the scale dtype (what compressed-tensors decompresses)."""
        return dequantize_int4(self.weight_packed, self.weight_scale, self.group_size,
                               self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def check_weight_shape(name: str, weight_shape: torch.Tensor, out_features: int,
                       in_features: int) -> None:
    """Raise ValueError unless a checkpoint's `weight_shape` tensor (int32 or int64) equals
    [out_features, in_features] of the shard it describes."""
    if weight_shape.numel() != 2 or weight_shape.tolist() != [out_features, in_features]:
        raise ValueError(f"{name} is {weight_shape.tolist()}, expected "
                         f"[{out_features}, {in_features}]")


def build_int4_linear(prefix: str, in_features: int, out_features: int, bias: bool,
                      qcfg: QuantConfig) -> Int4Linear:
    """The Int4Linear for checkpoint module `prefix` (ValueError if qcfg leaves it dense)."""
    if not is_quantized(prefix, qcfg):
        raise ValueError(f"{prefix} is not quantized under the checkpoint's quantization_config "
                         f"(targets {qcfg.targets}, ignore {qcfg.ignore})")
    return Int4Linear(in_features, out_features, bias, qcfg.group_size)


def linear_factory_for(quantization_config: Mapping[str, Any] | None,
                       dense: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """The linear factory for a checkpoint whose config.json holds `quantization_config`
    (None: `dense` itself); ValueError if the config is not one specd supports."""
    if quantization_config is None:
        return dense
    return make_linear_factory(QuantConfig.from_dict(quantization_config), dense)


def make_linear_factory(qcfg: QuantConfig | None,
                        dense: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A `LinearFactory` (workers/layers.py) for a checkpoint: Int4Linear where every fused name
    is quantized, `dense(...)` where none is, ValueError where the shards disagree."""

    def factory(in_features: int, out_features: int, bias: bool,
                names: tuple[str, ...]) -> nn.Module:
        flags = [is_quantized(name, qcfg) for name in names]
        if qcfg is None or not any(flags):
            return dense(in_features, out_features, bias, names)
        if not all(flags):
            raise ValueError(f"fused linear {names} mixes INT4 and dense shards "
                             f"({dict(zip(names, flags, strict=True))}); it cannot be fused")
        return build_int4_linear(names[0], in_features, out_features, bias, qcfg)

    return factory
