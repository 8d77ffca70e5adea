"""workers/models/checkpoint_check.py: which modules the model holds as INT4, read against
the checkpoints tools/quantize.py writes (the oracle: the modules it stored as
`weight_packed`), and the start-up check that refuses one stored dense.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specd.workers.config import FIXTURE_DIR, FIXTURE_MOE_DIR
from specd.workers.models.checkpoint_check import (
    check_int4_storage,
    has_checkpoint,
    int4_modules,
    int4_rule,
    stored_tensors,
)
from specd.workers.models.config import ModelConfig
from specd.workers.models.linear_factory import linear_factory
from specd.workers.models.quantization import QuantConfig
from specd.workers.models.registry import build_meta_model

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"


def _quantize(tmp_path_factory: pytest.TempPathFactory, src: Path, *args: str) -> Path:
    sys.path.insert(0, str(TOOLS_DIR))
    import quantize as quantize_tool

    dst = tmp_path_factory.mktemp("int4") / src.name
    assert quantize_tool.main([str(src), str(dst), *args]) == 0
    return dst


@pytest.fixture(scope="module")
def int4_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MoE fixture quantized with Kimi's recipe (routed experts INT4, the rest bf16)."""
    return _quantize(tmp_path_factory, FIXTURE_MOE_DIR, "--recipe", "moe")


@pytest.fixture(scope="module", params=["dense", "moe"])
def int4_checkpoint(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense fixture (group 32, down_proj and lm_head bf16) or the MoE fixture (Kimi's
    recipe) as tools/quantize.py writes them."""
    if request.param == "dense":
        return _quantize(tmp_path_factory, FIXTURE_DIR, "--group-size", "32",
                         "--ignore", "re:.*down_proj")
    path: Path = request.getfixturevalue("int4_moe")
    return path


def test_the_int4_modules_are_those_the_checkpoint_stores_packed(int4_checkpoint: Path) -> None:
    cfg = ModelConfig.from_dir(int4_checkpoint)
    model = build_meta_model(cfg, torch.device("cpu"), linear_factory(cfg))
    stored = stored_tensors(int4_checkpoint)
    packed = {name.removesuffix(".weight_packed") for name in stored
              if name.endswith(".weight_packed")
              and not name.startswith(f"model.layers.{cfg.num_layers}.")}  # an MTP layer
    modules = list(int4_modules(model))
    assert packed and len(modules) == len(set(modules))
    assert set(modules) == packed
    check_int4_storage(cfg, stored)  # as written: nothing to refuse


def test_headers_are_read_without_tensor_data(int4_checkpoint: Path) -> None:
    stored = stored_tensors(int4_checkpoint)
    name = next(n for n in stored if n.endswith(".weight_packed"))
    assert stored[name].dtype == "I32" and len(stored[name].shape) == 2
    assert has_checkpoint(int4_checkpoint) and not has_checkpoint(int4_checkpoint.parent)


def test_a_model_without_quantization_config_has_nothing_to_check(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(FIXTURE_MOE_DIR)
    check_int4_storage(cfg, stored_tensors(FIXTURE_MOE_DIR))
    assert list(int4_modules(build_meta_model(cfg, torch.device("cpu")))) == []


@pytest.mark.parametrize(("targets", "ignore", "rule"), [
    (("Linear",), (), "targets entry 'Linear' matches it and no entry of ignore [] does"),
    (("re:.*experts.*", "Linear"), ("re:.*self_attn.*",),
     "targets entries 're:.*experts.*', 'Linear' match it and no entry of ignore "
     "['re:.*self_attn.*'] does"),
    (("model.layers.1.mlp.experts.0.up_proj",), ("lm_head",),
     "targets entry 'model.layers.1.mlp.experts.0.up_proj' matches it and no entry of "
     "ignore ['lm_head'] does"),
])
def test_the_rule_names_the_targets_entries_that_match(targets: tuple[str, ...],
                                                      ignore: tuple[str, ...],
                                                      rule: str) -> None:
    qcfg = QuantConfig(group_size=32, targets=targets, ignore=ignore)
    assert int4_rule("model.layers.1.mlp.experts.0.up_proj", qcfg) == rule


def test_kimi_k25_names_are_checked_with_the_language_model_prefix(int4_moe: Path,
                                                                   tmp_path: Path) -> None:
    """The INT4 MoE checkpoint laid out as Kimi-K2.5 (tensors under `language_model.`, a
    vision tensor beside them): its ignore list names `language_model.lm_head`; without that
    entry lm_head, stored dense, still loads dense (an LM head is INT4 only when stored
    packed: workers/models/quant_stored.py), and without the shared experts' pattern their
    dense tensors are refused under their full names."""
    wrapped = tmp_path / "k25"
    wrapped.mkdir()
    tensors = {f"language_model.{k}": v
               for k, v in load_file(int4_moe / "model.safetensors").items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(wrapped / "model.safetensors"))
    text = json.loads((int4_moe / "config.json").read_text())
    qcfg = text.pop("quantization_config")
    assert qcfg["ignore"][0] == "lm_head"
    ignore = ["language_model.lm_head", "re:vision_tower.*", *qcfg["ignore"][1:]]

    def config(ignore: list[str]) -> ModelConfig:
        (wrapped / "config.json").write_text(json.dumps({
            "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": text, "vision_config": {},
            "quantization_config": {**qcfg, "ignore": ignore}}))
        return ModelConfig.from_dir(wrapped)

    stored = stored_tensors(wrapped)
    check_int4_storage(config(ignore), stored)
    check_int4_storage(config(ignore[1:]), stored)
    without_shared = [entry for entry in ignore if entry != "re:.*shared_experts.*"]
    with pytest.raises(ValueError, match=r"tensor language_model\.model\.layers\.1\.mlp\."
                                         r"shared_experts\.(gate|up|down)_proj\.weight is "
                                         r"stored dense \(BF16 \[\d+, \d+\]\), but the "
                                         r"quantization_config makes language_model\.model\."
                                         r"layers\.1\.mlp\.shared_experts\.(gate|up|down)_proj "
                                         r"INT4 \(targets entry 'Linear' matches it"):
        check_int4_storage(config(without_shared), stored)
