"""The W4A16 scheme of a compressed-tensors `pack-quantized` checkpoint.

* `QuantConfig.from_dict(config.json["quantization_config"])` accepts what specd can serve,
  as W4A16 checkpoints are published: quant_method compressed-tensors, format pack-quantized,
  status compressed or frozen, one config group of 4-bit int weights, symmetric or not
  (`weight_zero_point` tensors), strategy group (size 32/64/128) or channel, actorder null,
  false, `static` or `weight` (these reorder nothing in the stored tensors and carry no
  `g_idx`), no activation or KV-cache quantization. Anything else (actorder `group`, other bit
  widths, other strategies) is a ValueError naming the field and its value.
* `is_quantized(module_name, qcfg)`: whether the config makes a linear module INT4, exactly as
  compressed-tensors' `is_match` decides it for a torch Linear: some target matches the module
  and no `ignore` entry does. An entry matches by name (`match_name`: an exact name, or a
  `re:` pattern `re.match`-ed from the start of the name) or by class name (a torch Linear's
  classes are `Linear` and `Module`). Names are MODULE names (`model.layers.0.mlp.down_proj`,
  never the tensor `...down_proj.weight`: `module_of`) spelled as the checkpoint spells them,
  prefix included (Kimi-K2.5's `language_model.`). `int4_rule` and `dense_rule` say which
  entries decided, for error messages. Whether a linear then loads INT4 also depends on what the
  checkpoint stores (workers/models/quant_stored.py).

The older `compression_config` key of config.json holds the same object; ModelConfig reads
either (workers/models/config.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from specd.kernels.int4_layout import SUPPORTED_GROUP_SIZES

# The compressed-tensors release whose config.json layout `QuantConfig.to_dict` reproduces
# (tests/unit/test_quantization.py compares the two).
COMPRESSED_TENSORS_VERSION = "0.20.1"
# Activation orderings that leave the stored tensors in their natural order: `static` and
# `weight` only changed the order the quantizer visited columns in; `group` stores a `g_idx`
# permutation the kernels do not apply.
ACCEPTED_ACTORDER = (None, False, "static", "weight")
STRATEGIES = ("group", "channel")

# Keys whose value does not change how weights are stored or computed (bookkeeping written by
# compressed-tensors / llm-compressor); every other key is checked.
_INFO_TOP_KEYS = {"version", "global_compression_ratio"}
_INFO_WEIGHT_KEYS = {"observer", "observer_kwargs", "zp_dtype"}


@dataclass(frozen=True)
class QuantConfig:
    """The INT4 scheme of a checkpoint: its group size (None: one scale per output channel),
    whether zero points are stored (symmetric False), and which linears are quantized."""

    group_size: int | None
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    num_bits: int = 4
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.group_size is not None and self.group_size not in SUPPORTED_GROUP_SIZES:
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

    @property
    def strategy(self) -> str:
        return "channel" if self.group_size is None else "group"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> QuantConfig:
        """Parse config.json's `quantization_config`; ValueError naming any unsupported option."""
        _expect(raw, "quant_method", ("compressed-tensors",))
        _expect(raw, "format", ("pack-quantized",), optional=True)
        _expect(raw, "quantization_status", ("compressed", "frozen"), optional=True)
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
        group_size, symmetric = _parse_weights(group.get("weights"), f"{where}.weights")
        return cls(group_size=group_size, targets=tuple(targets), ignore=tuple(ignore),
                   symmetric=symmetric)

    def to_dict(self) -> dict[str, Any]:
        """The `quantization_config` entry exactly as compressed-tensors writes it (sorted keys,
        version of the compressed-tensors release whose layout this matches)."""
        weights = {"dynamic": False, "group_size": self.group_size, "num_bits": self.num_bits,
                   "strategy": self.strategy, "symmetric": self.symmetric, "type": "int"}
        group = {"format": "pack-quantized", "input_activations": None,
                 "output_activations": None, "targets": list(self.targets), "weights": weights}
        return {"config_groups": {"group_0": group}, "format": "pack-quantized",
                "global_compression_ratio": None, "ignore": list(self.ignore),
                "kv_cache_scheme": None, "moe_sparsity_config": None,
                "quant_method": "compressed-tensors", "quantization_status": "compressed",
                "sparsity_config": {}, "transform_config": {},
                "version": COMPRESSED_TENSORS_VERSION}


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


def _parse_weights(w: Any, where: str) -> tuple[int | None, bool]:
    """Check a group's `weights` args; return (group size or None for channel, symmetric)."""
    if not isinstance(w, Mapping):
        raise ValueError(f"{where} must be an object, got {w!r}")
    _reject_unknown(w, {"num_bits", "type", "symmetric", "strategy", "group_size", "dynamic",
                        "actorder", "block_structure", "scale_dtype", *_INFO_WEIGHT_KEYS}, where)
    _expect(w, "num_bits", (4,), where=where)
    _expect(w, "type", ("int",), where=where)
    _expect(w, "symmetric", (True, False), where=where)
    _expect(w, "strategy", STRATEGIES, where=where)
    _expect(w, "dynamic", (False,), optional=True, where=where)
    _expect(w, "actorder", ACCEPTED_ACTORDER, optional=True, where=where)
    _expect(w, "block_structure", (None,), optional=True, where=where)
    _expect(w, "scale_dtype", (None, "torch.bfloat16", "torch.float16", "bfloat16", "float16"),
            optional=True, where=where)
    group_size = w.get("group_size")
    if w["strategy"] == "channel":
        if group_size is not None:
            raise ValueError(f"{where}.group_size must be null with strategy 'channel', got "
                             f"{group_size!r}")
    elif not isinstance(group_size, int) or group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{where}.group_size must be one of {SUPPORTED_GROUP_SIZES}, got "
                         f"{group_size!r}")
    return group_size, bool(w["symmetric"])


# compressed-tensors' `_match_class` compares a plain (non-`re:`) entry with the names of the
# module's classes; a torch Linear's are these (its MRO below object), so such an entry in
# `targets` or `ignore` matches every linear.
LINEAR_CLASS_NAMES = ("Linear", "Module")


def match_name(name: str, pattern: str) -> bool:
    """compressed-tensors' `match_name` (without vLLM's fused names): a `re:` pattern
    `re.match`-ed from the start of `name` (so `re:.*lm_head$` needs no `^`, and an
    unanchored-at-the-end pattern matches any name it prefixes), else exact equality."""
    if pattern.startswith("re:"):
        return re.match(pattern.removeprefix("re:"), name) is not None
    return pattern == name


def module_of(tensor_name: str) -> str:
    """The module a checkpoint tensor belongs to (`a.b.weight_packed` -> `a.b`): what targets
    and ignore entries are matched against, as compressed-tensors' `match_quantizable_tensors`
    splits a tensor name."""
    return tensor_name.rpartition(".")[0]


def _matches_linear(module_name: str, entry: str) -> bool:
    return match_name(module_name, entry) or entry in LINEAR_CLASS_NAMES


def is_quantized(module_name: str, qcfg: QuantConfig | None) -> bool:
    """Whether `qcfg` makes the linear module `module_name` (the checkpoint's name, e.g.
    "model.layers.0.self_attn.q_proj" or "language_model.lm_head") INT4: compressed-tensors'
    `is_match(name, linear, targets, ignore)` (module docstring)."""
    if qcfg is None:
        return False
    return (any(_matches_linear(module_name, t) for t in qcfg.targets)
            and not any(_matches_linear(module_name, p) for p in qcfg.ignore))


def int4_rule(name: str, qcfg: QuantConfig) -> str:
    """Which part of `qcfg` makes module `name` INT4, in words: the `targets` entries that
    match it (matched by `is_quantized` itself, one target at a time), no `ignore` entry
    matching it."""
    targets = [t for t in qcfg.targets if is_quantized(name, replace(qcfg, targets=(t,)))]
    matched = ", ".join(repr(t) for t in targets)
    entries = "entry" if len(targets) == 1 else "entries"
    return (f"targets {entries} {matched} {'matches' if len(targets) == 1 else 'match'} it "
            f"and no entry of ignore {list(qcfg.ignore)} does")


def dense_rule(name: str, qcfg: QuantConfig) -> str:
    """Why `qcfg` leaves module `name` dense, in words: the first `ignore` entry that matches
    it, or that no `targets` entry does."""
    ignored = next((p for p in qcfg.ignore if _matches_linear(name, p)), None)
    if ignored is not None:
        return f"ignore entry {ignored!r} matches it"
    return f"no entry of targets {list(qcfg.targets)} matches it"
