r"""Quantize a bf16 checkpoint into a compressed-tensors `pack-quantized` INT4 (W4A16) one.

    python -m tools.quantize SRC_DIR DST_DIR [--recipe dense|moe] [--group-size 32]
                             [--ignore PATTERN ...]

Weights are quantized round-to-nearest, symmetric, per group of `group_size` input columns
(`specd.workers.models.quantization.quantize_rtn`) and stored as `weight_packed` int32 [out, in/8],
`weight_scale` bf16 [out, in/group] and `weight_shape` int64 [2]. Which weights, by recipe:

* `dense` (default): every linear weight of the decoder blocks (`...layers.N....weight`, 2-D,
  not a norm). lm_head and any other 2-D weight outside the blocks (embeddings excepted) are
  named in the config's `ignore` list.
* `moe`: the routed experts only (`...mlp.experts.E.{gate,up,down}_proj.weight`), as Kimi's
  INT4 releases do; the `ignore` list is theirs: `lm_head`, `re:.*self_attn.*`,
  `re:.*shared_experts.*` and `re:.*mlp\.(gate|up|gate_up|down)_proj.*` (the dense layers'
  MLPs), so attention, shared experts, dense MLPs and lm_head stay bf16 (the router and the
  embeddings are no Linear to compressed-tensors), followed by any other 2-D weight outside
  the blocks that it does not cover (e.g. a prefixed `language_model.lm_head`).

`--ignore` patterns are added to either list, which is how compressed-tensors, vLLM, SGLang
and specd's loader know what stays dense; the tool checks that every block linear it leaves
dense is covered by the list. The output keeps the input's file sharding; tensors are read
one at a time through safetensors' memory map, so memory holds one output shard at most.
config.json gets `quantization_config` exactly as compressed-tensors writes it; tokenizer,
generation and other non-weight files are copied.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specd.workers.models.checkpoint import SAFETENSORS_INDEX, checkpoint_files
from specd.workers.models.moe import EXPERT_TENSOR
from specd.workers.models.quantization import QuantConfig, is_quantized, quantize_rtn

BLOCK_WEIGHT = re.compile(r"(^|.*\.)layers\.\d+\..+\.weight$")
RECIPES = ("dense", "moe")
# Kimi-K2-Thinking / K2.5's `ignore` list: everything but the routed experts stays bf16.
MOE_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
              r"re:.*mlp\.(gate|up|gate_up|down)_proj.*")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
EMBEDDING_NAMES = ("embed_tokens",)


class ProgressBar:
    """A one-line progress bar on stderr: `[#####.....] 12/34 name`."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total = max(total, 1)
        self.width = width
        self.done = 0
        self.started = time.monotonic()

    def advance(self, label: str) -> None:
        self.done += 1
        filled = self.width * self.done // self.total
        elapsed = time.monotonic() - self.started
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] "
                         f"{self.done}/{self.total} {elapsed:5.1f}s {label[:60]:<60}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def is_block_linear(name: str, tensor_ndim: int) -> bool:
    """A decoder-block linear weight: `...layers.N.<module>.weight`, 2-D, not a norm."""
    module = name.removesuffix(".weight")
    return (tensor_ndim == 2 and BLOCK_WEIGHT.match(name) is not None
            and not module.endswith("norm"))


def plan_ignore(src: Path, extra_ignore: list[str]) -> list[str]:
    """The `ignore` list: lm_head, every other 2-D weight outside the blocks except the
    embeddings (not a Linear, so never targeted), and the user's patterns."""
    ignore = ["lm_head"]
    for path, _ in checkpoint_files(src):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                module = name.removesuffix(".weight")
                is_2d = len(f.get_slice(name).get_shape()) == 2
                if (name.endswith(".weight") and is_2d and not is_block_linear(name, 2)
                        and not module.endswith(EMBEDDING_NAMES) and module not in ignore):
                    ignore.append(module)
    return ignore + [p for p in extra_ignore if p not in ignore]


def is_routed_expert(name: str) -> bool:
    """A routed expert's dense projection weight (`...experts.E.{gate,up,down}_proj.weight`)."""
    match = EXPERT_TENSOR.match(name)
    return match is not None and match["kind"] == ""


def quantize_checkpoint(src: Path, dst: Path, group_size: int, extra_ignore: list[str],
                        recipe: str = "dense") -> None:
    """Write the INT4 checkpoint of `src` into `dst` (created; must not hold a checkpoint)."""
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{src}/config.json already has a quantization_config")
    if (dst / "config.json").exists():
        raise ValueError(f"{dst} already holds a checkpoint (config.json exists)")
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    ignore = plan_ignore(src, extra_ignore)
    if recipe == "moe":
        # Kimi's list, then what it does not already cover (a prefixed lm_head, the user's).
        kimi = QuantConfig(group_size=group_size, ignore=MOE_IGNORE)
        ignore = [*MOE_IGNORE, *(p for p in ignore
                                 if p not in MOE_IGNORE and is_quantized(p, kimi))]
    qcfg = QuantConfig(group_size=group_size, ignore=tuple(ignore))
    chosen = is_block_linear if recipe == "dense" else (
        lambda name, ndim: ndim == 2 and is_routed_expert(name))
    files = list(checkpoint_files(src))
    names: list[str] = []
    for path, _ in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names += f.keys()
    if recipe == "moe" and not any(is_routed_expert(name) for name in names):
        raise ValueError(f"{src} has no routed expert weights (...mlp.experts.E.*_proj.weight) "
                         f"for the moe recipe to quantize")
    dst.mkdir(parents=True, exist_ok=True)
    bar = ProgressBar(len(names))
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for path, _ in files:
        out = _quantize_file(path, qcfg, chosen, bar)
        save_file(out, str(dst / path.name), metadata={"format": "pt"})
        weight_map.update({name: path.name for name in out})
        total_bytes += sum(t.numel() * t.element_size() for t in out.values())
    if (src / SAFETENSORS_INDEX).is_file():
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(
            weight_map.items()))}
        (dst / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    _copy_side_files(src, dst)
    config["quantization_config"] = qcfg.to_dict()
    with open(dst / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _quantize_file(path: Path, qcfg: QuantConfig, chosen: Callable[[str, int], bool],
                   bar: ProgressBar) -> dict[str, torch.Tensor]:
    """The file's tensors with every `chosen` weight that `qcfg` quantizes packed; ValueError
    for a block linear left dense that `qcfg` does not ignore (loaders would expect INT4)."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
            tensor = f.get_tensor(name)
            module = name.removesuffix(".weight")
            quantize = chosen(name, tensor.dim()) and is_quantized(module, qcfg)
            # The MoE router (`mlp.gate`) is no Linear to compressed-tensors (transformers'
            # DeepseekV3TopkRouter), so the "Linear" target never reaches it.
            if (not quantize and is_block_linear(name, tensor.dim())
                    and not module.endswith(".mlp.gate") and is_quantized(module, qcfg)):
                raise ValueError(f"{name} stays dense but the ignore list {list(qcfg.ignore)} "
                                 f"does not name it; pass --ignore {module}")
            if quantize:
                if tensor.shape[1] % qcfg.group_size:
                    raise ValueError(f"{name}: in_features {tensor.shape[1]} is not a multiple "
                                     f"of group size {qcfg.group_size}; pass --ignore {module}")
                packed, scale = quantize_rtn(tensor, qcfg.group_size)
                out[f"{module}.weight_packed"] = packed
                out[f"{module}.weight_scale"] = scale
                out[f"{module}.weight_shape"] = torch.tensor(tensor.shape)  # int64, as CT
            else:
                out[name] = tensor.contiguous()
            bar.advance(name)
    return out


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat template, licence...: every top-level non-weight file."""
    for path in sorted(src.iterdir()):
        if (path.is_file() and path.name not in ("config.json", SAFETENSORS_INDEX)
                and not path.name.endswith(WEIGHT_SUFFIXES)):
            shutil.copy2(path, dst / path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="bf16 Hugging Face checkpoint directory")
    parser.add_argument("dst", type=Path, help="output directory (created)")
    parser.add_argument("--recipe", choices=RECIPES, default="dense",
                        help="dense: every decoder-block linear; moe: the routed experts only "
                             "(Kimi's INT4 layout: attention, shared experts, dense MLPs and "
                             "lm_head stay bf16 through re: ignore patterns)")
    parser.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128),
                        help="input columns per scale (default 32)")
    parser.add_argument("--ignore", action="append", default=[],
                        help="module name or re:pattern to keep dense (repeatable)")
    args = parser.parse_args(argv)
    try:
        quantize_checkpoint(args.src, args.dst, args.group_size, args.ignore, args.recipe)
    except (ValueError, OSError) as e:
        print(f"quantize: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.dst}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
