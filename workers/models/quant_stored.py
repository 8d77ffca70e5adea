"""Whether a linear loads INT4: what the quantization config says, with what the checkpoint
stores of lm_head (no torch).

`quant_config.is_quantized` is what compressed-tensors would decide from the config alone,
and the model's linear factory (workers/models/quantization.py) builds every linear as it
says, with two exceptions decided here:

* **lm_head** (the output projection) is INT4 only when the checkpoint stores it packed
  (`lm_head.weight_packed`, the config then making it INT4 too). Stored dense where the
  config would make it INT4, it loads dense and is logged once (`dense_output_note`): vLLM
  and SGLang never quantize their LM head, whatever the config says, and Kimi-K2.5's config
  names `lm_head` while its tensor is `language_model.lm_head.weight` (compressed-tensors
  matches the exact entry against the prefixed name, so by the config alone it would be
  INT4). Without a view of the checkpoint it is dense.
* **A module stored packed** (`weight_packed` and its scales) where the config leaves it
  dense is refused when the model is built, naming the tensor and the rule
  (`quant_config.dense_rule`).

Any other linear follows the config. One stored dense where the config makes it INT4 is
refused from the headers before the build's weights are read, by
workers/models/checkpoint_check.py, naming the rule (`quant_config.int4_rule`):
compressed-tensors, transformers, vLLM and SGLang build such layers from the config and
would each fail on the checkpoint, and `specctl plan` counts them as the config says, so a
config that misdescribes a block's weights is an error to fix rather than something to
serve around. A linear the checkpoint does not store at all follows the config (the loader
then names the missing tensor).

Names are the checkpoint's module names (weight prefix included), as `is_quantized` takes
them; `StoredLinears.from_names` reads them off the checkpoint's tensor names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from specd.workers.models.quant_config import (
    QuantConfig,
    dense_rule,
    int4_rule,
    is_quantized,
    module_of,
)

# The served model's output projection, by its module name under the weight prefix.
OUTPUT_PROJECTION = "lm_head"
# Tensor kinds a compressed-tensors pack-quantized linear stores instead of `weight`.
PACKED_KINDS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                "weight_g_idx")


@dataclass(frozen=True)
class StoredLinears:
    """Which modules a checkpoint stores packed (any of `PACKED_KINDS`) and which dense (a
    `weight` tensor and none of them), by module name as the checkpoint spells it."""

    packed: frozenset[str]
    dense: frozenset[str]

    @classmethod
    def from_names(cls, tensor_names: Iterable[str]) -> StoredLinears:
        packed: set[str] = set()
        weights: set[str] = set()
        for name in tensor_names:
            kind = name.rpartition(".")[2]
            if kind in PACKED_KINDS:
                packed.add(module_of(name))
            elif kind == "weight":
                weights.add(module_of(name))
        return cls(frozenset(packed), frozenset(weights - packed))


def linear_is_int4(module_name: str, qcfg: QuantConfig, stored: StoredLinears | None,
                   output_projection: bool = False) -> bool:
    """Whether linear `module_name` (the checkpoint's name) loads INT4 (module docstring):
    as the config says, an lm_head (`output_projection`) only when also stored packed.
    ValueError naming the tensor and the rule for a module stored packed that the config
    leaves dense."""
    config_int4 = is_quantized(module_name, qcfg)
    is_packed = stored is not None and module_name in stored.packed
    if is_packed and not config_int4:
        raise ValueError(f"checkpoint tensor '{module_name}.weight_packed' is stored INT4, but "
                         f"the quantization_config leaves {module_name} dense "
                         f"({dense_rule(module_name, qcfg)}): the quantization_config does "
                         "not describe this checkpoint")
    return is_packed if output_projection else config_int4


def dense_output_note(module_name: str, qcfg: QuantConfig, weight_prefix: str = "") -> str | None:
    """The line logged when lm_head loads dense although the config alone would make it INT4
    (None when the config leaves it dense too)."""
    if not is_quantized(module_name, qcfg):
        return None
    return (f"{module_name} loads dense (its checkpoint tensor is not packed) although the "
            f"quantization_config would make it INT4 ({int4_rule(module_name, qcfg)})"
            f"{_unprefixed_hint(module_name, qcfg, weight_prefix)}; an LM head is INT4 only "
            f"when stored packed")


def _unprefixed_hint(module_name: str, qcfg: QuantConfig, weight_prefix: str) -> str:
    """A note when an exact ignore entry is `module_name` without the weight prefix: such an
    entry is matched against the prefixed name and so never matches."""
    bare = module_name.removeprefix(weight_prefix) if weight_prefix else None
    if bare is None or bare == module_name or bare not in qcfg.ignore:
        return ""
    return (f"; ignore entry {bare!r} names it without the checkpoint's {weight_prefix!r} "
            f"prefix, and entries are matched against the names as the checkpoint spells "
            f"them, as compressed-tensors matches them")
