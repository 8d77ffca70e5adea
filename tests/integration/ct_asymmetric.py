"""Asymmetric INT4 checkpoints written with compressed-tensors' own code (for the tests of
tests/integration/test_int4_asymmetric.py): min/max quantization parameters from its
`calculate_qparams`, tensors from its `PackedQuantizationCompressor.compress` (the packed
weight, the bf16 scale, `weight_shape` and the zero points packed along the output rows),
and the `quantization_config` from its `QuantizationConfig`. specd's code writes nothing.
`decompressed_oracle` is the matching reference model: transformers over compressed-tensors'
decompression of the same tensors.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open
from safetensors.torch import save_file


def ct_scheme(group_size: int | None, symmetric: bool) -> QuantizationScheme:
    """4-bit int weights, `group` strategy of `group_size` or `channel` when None."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric,
                            strategy="channel" if group_size is None else "group",
                            group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def compress_weight(weight: torch.Tensor, scheme: QuantizationScheme) -> dict[str, torch.Tensor]:
    """One [out, in] weight -> its pack-quantized tensors, by compressed-tensors."""
    args = scheme.weights
    assert args is not None
    w = weight.float()
    group = args.group_size or w.shape[1]
    grouped = w.view(w.shape[0], -1, group)  # [out, groups, group]
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    state = {"weight": w, "weight_scale": scale.to(torch.bfloat16),
             "weight_zero_point": zero_point.round().to(torch.int8)}
    return PackedQuantizationCompressor.compress(state, scheme)


def write_checkpoint(src: Path, dst: Path, scheme: QuantizationScheme, ignore: list[str],
                     quantize: Callable[[str], bool]) -> None:
    """Copy the single-file bf16 checkpoint `src` to `dst`, every weight whose module name
    `quantize` accepts compressed under `scheme`, config.json given compressed-tensors'
    quantization_config with `ignore`."""
    dst.mkdir(parents=True)
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
            tensor = f.get_tensor(name)
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and tensor.dim() == 2 and quantize(module):
                for kind, t in compress_weight(tensor, scheme).items():
                    out[f"{module}.{kind}"] = t.contiguous()
            else:
                out[name] = tensor
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    ct = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore,
                            format="pack-quantized", quantization_status="compressed")
    config["quantization_config"] = {"quant_method": "compressed-tensors",
                                     **ct.model_dump(mode="json", exclude={"quant_method"})}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.is_file() and path.name not in ("config.json", "model.safetensors"):
            shutil.copy2(path, dst / path.name)


def decompressed_oracle(base_dir: Path, int4_dir: Path) -> Any:
    """transformers' model of the bf16 checkpoint `base_dir` (float32) with every weight that
    `int4_dir` stores INT4 replaced by compressed-tensors' decompression of those tensors
    (`PackedQuantizationCompressor.decompress`, the scale cast to float32 so that
    (q - z) * scale is exact); routed experts fill transformers' stacked gate_up_proj /
    down_proj rows."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    raw = json.loads((int4_dir / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(raw["config_groups"]["group_0"])
    with safe_open(str(int4_dir / "model.safetensors"), framework="pt") as f, torch.no_grad():
        names = set(f.keys())
        for packed in sorted(n for n in names if n.endswith(".weight_packed")):
            module = packed.removesuffix(".weight_packed")
            state = {kind: f.get_tensor(f"{module}.{kind}") for kind in
                     ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
                     if f"{module}.{kind}" in names}
            state["weight_scale"] = state["weight_scale"].float()
            weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
            _dense_param(hf, module).copy_(weight)
    return hf


def _dense_param(hf: Any, module: str) -> torch.Tensor:
    """The slice of transformers' parameters that checkpoint module `module` fills."""
    expert = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj$", module)
    if expert is None:
        return hf.get_submodule(module).weight.data
    experts, e, proj = hf.get_submodule(expert[1]), int(expert[2]), expert[3]
    if proj == "down":
        return experts.down_proj.data[e]
    rows = experts.gate_up_proj.shape[1] // 2
    return experts.gate_up_proj.data[e].narrow(0, rows * (proj == "up"), rows)
