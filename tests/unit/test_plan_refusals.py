"""`specctl plan` refuses what the engine refuses at start-up (daemon/ctl/plan.py,
workers/plan/deployment.py `check_startup`, workers/models/checkpoint_check.py).

Oracle: the engine itself. Each case is a model directory the engine refuses (`specd.Engine`,
or the function its start-up calls), and the plan exits 2 with that very message, which
names the field or the tensor.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import specd
from specd.daemon.ctl.cli import cli
from specd.model_fit import check_vocabulary
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR, FIXTURE_MOE_DIR
from specd.workers.models.config import ModelConfig
from specd.workers.models.linear_factory import linear_factory
from specd.workers.models.loader import load_model
from tests.unit.test_tiktoken_tokenizer import write_model

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Routed experts INT4 (a `re:` target), everything else dense: Kimi's layout, by targets.
EXPERTS_ONLY: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"],
        "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32, "dynamic": False, "actorder": None}}},
    "ignore": [],
}


def _config(model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    return config


def _model_dir(root: Path, config: dict[str, Any], source: Path | None = None,
               files: tuple[str, ...] = ()) -> Path:
    """A model directory of `config` whose `files` are links to `source`'s."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    for name in files:
        (root / name).symlink_to(source / name if source is not None else name)
    return root


def _plan(model_dir: Path, *args: str) -> str:
    """The plan's refusal: its output, after checking it exited 2 (a usage error)."""
    result = CliRunner().invoke(cli, ["plan", str(model_dir), "--gpu-memory-gib", "80", *args])
    assert result.exit_code == 2, result.output
    return result.output


def _engine_refusal(model_dir: Path, **options: Any) -> str:
    with pytest.raises(ValueError) as refused:
        specd.Engine(str(model_dir), dtype="float32", **options)
    return str(refused.value)


def test_a_tokenizer_larger_than_the_embedding_is_refused_as_the_engine_refuses_it(
        tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path / "m", {**_config(FIXTURE_DIR), "vocab_size": 4000},
                           FIXTURE_DIR, TOKENIZER_FILES)
    message = _engine_refusal(model_dir)
    assert "has 4096 tokens but the model's embedding has 4000 rows (config.json " \
           "vocab_size)" in message
    assert message in _plan(model_dir)


def test_unnamed_reserved_ids_past_the_embedding_plan_as_the_engine_starts_them(
        tmp_path: Path) -> None:
    """Kimi-K2's class makes 258 special ids above the ranks, the last two unnamed (only their
    own `<|reserved_token_N|>` text gives them): its 163,840 rows fit its 163,842 tokens.
    The engine and the daemon check the ids a tokenizer needs rows for (`num_named_ids`),
    and so does the plan."""
    model_dir = write_model(tmp_path / "m")  # 272 ranks + 258 special ids, the last named 282
    tokenizer = Tokenizer.from_dir(model_dir)
    rows = tokenizer.vocab_size - 2
    (model_dir / "config.json").write_text(json.dumps({**_config(FIXTURE_DIR),
                                                       "vocab_size": rows}))
    check_vocabulary(tokenizer.num_named_ids, rows, model_dir)  # the engine's start-up check
    result = CliRunner().invoke(cli, ["plan", str(model_dir), "--gpu-memory-gib", "80"])
    assert result.exit_code == 0, result.output
    assert "verdict      fits" in result.output


@pytest.mark.parametrize(("source", "change", "named"), [
    (FIXTURE_DIR, {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    (FIXTURE_DIR, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "unsupported rope type 'dynamic'"),
    (FIXTURE_MOE_DIR, {"scoring_func": "tanh"}, "scoring_func 'tanh' is not supported"),
    (FIXTURE_MOE_DIR, {"topk_method": "group_limited_greedy"},
     "topk_method 'group_limited_greedy' is not supported"),
], ids=["hidden_act", "rope_type", "scoring_func", "topk_method"])
def test_an_unsupported_config_field_is_refused_naming_it(
        source: Path, change: dict[str, Any], named: str, tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path / "m", {**_config(source), **change})
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_dir(model_dir)  # what the engine's start-up parses first
    assert named in str(refused.value)
    assert str(refused.value) in _plan(model_dir)


def test_an_unsupported_quantization_option_is_refused_naming_it(tmp_path: Path) -> None:
    quantization = copy.deepcopy(EXPERTS_ONLY)
    quantization["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    model_dir = _model_dir(tmp_path / "m", {**_config(FIXTURE_MOE_DIR),
                                            "quantization_config": quantization})
    with pytest.raises(ValueError) as refused:
        linear_factory(ModelConfig.from_dir(model_dir))  # the engine's linear factory
    assert "quantization_config.config_groups.group_0.weights.actorder" in str(refused.value)
    assert str(refused.value) in _plan(model_dir)


def test_a_tensor_parallel_size_that_does_not_divide_is_refused_as_the_engine_refuses_it(
        tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path / "m", _config(FIXTURE_DIR), FIXTURE_DIR,
                           ("model.safetensors",))
    message = _engine_refusal(model_dir, tensor_parallel_size=3)
    assert message == "tensor_parallel_size 3 does not divide num_attention_heads (4)"
    assert message in _plan(model_dir, "-tp", "3")


def test_a_longer_max_model_len_than_the_model_serves_is_refused_as_the_engine_refuses_it(
        tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path / "m", _config(FIXTURE_DIR), FIXTURE_DIR,
                           ("model.safetensors",))
    message = _engine_refusal(model_dir, max_model_len=4096)
    assert message == "max_model_len 4096 exceeds the model's limit 2048"
    assert message in _plan(model_dir, "--max-model-len", "4096")


# ---- a module the quantization_config makes INT4, stored dense ---------------------------


@pytest.fixture(scope="module")
def int4_dense_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense fixture quantized by tools/quantize.py (group 32; down_proj and lm_head
    stay bf16, named in the config's ignore list)."""
    sys.path.insert(0, str(TOOLS_DIR))
    import quantize as quantize_tool

    dst = tmp_path_factory.mktemp("int4") / "fixture-int4"
    assert quantize_tool.main([str(FIXTURE_DIR), str(dst), "--group-size", "32",
                              "--ignore", "re:.*down_proj"]) == 0
    return dst


def test_a_dense_lm_head_the_config_makes_int4_loads_dense_and_plans_so(
        int4_dense_fixture: Path, tmp_path: Path) -> None:
    """An LM head is INT4 only when stored packed (workers/models/quant_stored.py): with
    lm_head forgotten in the ignore list, its dense tensor loads dense, and the plan counts
    it as the engine holds it, instead of refusing."""
    config = _config(int4_dense_fixture)
    assert config["quantization_config"]["ignore"] == ["lm_head", "re:.*down_proj"]
    config["quantization_config"]["ignore"] = ["re:.*down_proj"]  # lm_head forgotten
    model_dir = _model_dir(tmp_path / "m", config, int4_dense_fixture, ("model.safetensors",))
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(cfg, torch.device("cpu"), torch.float32, linear_factory(cfg))
    assert type(model.lm_head) is torch.nn.Linear
    plans = [CliRunner().invoke(cli, ["plan", str(d), "--gpu-memory-gib", "80", "--json"])
             for d in (model_dir, int4_dense_fixture)]
    assert [p.exit_code for p in plans] == [0, 0], plans[0].output
    weights = [json.loads(p.output)["weights"] for p in plans]
    assert weights[0] == weights[1]  # the same model either way: lm_head bf16


def test_dense_routed_experts_a_targets_pattern_makes_int4_are_refused_naming_it(
        tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path / "m", {**_config(FIXTURE_MOE_DIR),
                                            "quantization_config": EXPERTS_ONLY},
                           FIXTURE_MOE_DIR, ("model.safetensors",))
    message = _engine_refusal(model_dir)
    assert "tensor model.layers.1.mlp.experts.0.gate_proj.weight is stored dense (BF16 " \
           "[96, 128]), but the quantization_config makes model.layers.1.mlp.experts.0." \
           "gate_proj INT4 (targets entry 're:.*mlp\\\\.experts\\\\.\\\\d+\\\\.(gate|up|down)" \
           "_proj$' matches it" in message
    assert message in _plan(model_dir, "--expert-parallel", "-tp", "2")
