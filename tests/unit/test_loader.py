"""The safetensors loader: whole models from single or sharded files, clear errors otherwise.

Checkpoints are written by hand here with the standard Hugging Face tensor names of a tiny
Llama (2 layers, GQA), so that each test can remove, reshape or add one tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specd.workers.models.config import ModelConfig
from specd.workers.models.loader import load_model

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB = 32, 2, 4, 2, 48, 50
HEAD_DIM = HIDDEN // HEADS
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "intermediate_size": INTER,
    "vocab_size": VOCAB, "max_position_embeddings": 64, "tie_word_embeddings": False,
}
CPU = torch.device("cpu")


def checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (HIDDEN,),
            f"{p}.post_attention_layernorm.weight": (HIDDEN,),
            f"{p}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{p}.mlp.gate_proj.weight": (INTER, HIDDEN),
            f"{p}.mlp.up_proj.weight": (INTER, HIDDEN),
            f"{p}.mlp.down_proj.weight": (HIDDEN, INTER),
        }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def write(path: Path, tensors: dict[str, torch.Tensor], **config: object) -> ModelConfig:
    (path / "config.json").write_text(json.dumps(CONFIG | config))
    save_file(tensors, str(path / "model.safetensors"))
    return ModelConfig.from_dir(path)


def test_loads_every_tensor_into_its_place(tmp_path: Path) -> None:
    tensors = checkpoint()
    model = load_model(write(tmp_path, tensors), CPU, torch.float32)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    q, k, v = (tensors[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    gate, up = (tensors[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up"))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]))
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"])
    assert model.lm_head is not None
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    assert all(not p.requires_grad and p.device == CPU for p in model.parameters())


def test_dtype_is_applied(tmp_path: Path) -> None:
    model = load_model(write(tmp_path, checkpoint()), CPU, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    tensors = checkpoint()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = load_model(ModelConfig.from_dir(tmp_path), CPU, torch.float32)
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight,
                       tensors["model.layers.0.mlp.down_proj.weight"])


def test_tied_embeddings_share_the_matrix_and_ignore_a_stored_lm_head(tmp_path: Path) -> None:
    tensors = checkpoint()  # still holds lm_head.weight, as some tied checkpoints do
    model = load_model(write(tmp_path, tensors, tie_word_embeddings=True), CPU, torch.float32)
    assert model.lm_head is None
    hidden = torch.randn(3, HIDDEN)
    expected = hidden @ tensors["model.embed_tokens.weight"].T
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_rotary_inv_freq_is_a_harmless_extra(tmp_path: Path) -> None:
    tensors = checkpoint() | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    load_model(write(tmp_path, tensors), CPU, torch.float32)


def test_wrong_shape_names_tensor_expected_and_got(tmp_path: Path) -> None:
    tensors = checkpoint()
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(KV_HEADS * HEAD_DIM + 1,
                                                                   HIDDEN)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.1.self_attn"
                                         r".k_proj.weight' has shape \[17, 32\], expected "
                                         r"\[16, 32\]"):
        load_model(write(tmp_path, tensors), CPU, torch.float32)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    tensors = checkpoint()
    del tensors["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.0.mlp.up_proj.weight'"):
        load_model(write(tmp_path, tensors), CPU, torch.float32)


def test_unknown_tensor_is_refused(tmp_path: Path) -> None:
    tensors = checkpoint() | {"model.layers.0.self_attn.q_proj.bias": torch.zeros(HIDDEN)}
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.bias' matches no "
                                         "parameter"):
        load_model(write(tmp_path, tensors), CPU, torch.float32)


def test_truncated_file_is_named(tmp_path: Path) -> None:
    cfg = write(tmp_path, checkpoint())
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.safetensors: unreadable safetensors file, "
                                         r"truncated or corrupt"):
        load_model(cfg, CPU, torch.float32)


def test_missing_files_are_named(tmp_path: Path) -> None:
    cfg = write(tmp_path, checkpoint())
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors and no model.safetensors.index"):
        load_model(cfg, CPU, torch.float32)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00001-of-00001.safetensors: checkpoint file "
                                         "not found"):
        load_model(cfg, CPU, torch.float32)


# ----------------------------------------------------------------------------- INT4 experts


@pytest.fixture(scope="module")
def moe_int4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The MoE fixture quantized by tools/quantize.py's MoE recipe, and its tensors."""
    from safetensors.torch import load_file

    from specd.workers.config import FIXTURE_MOE_DIR
    from tools import quantize as quantize_tool

    out = tmp_path_factory.mktemp("moe") / "int4"
    assert quantize_tool.main([str(FIXTURE_MOE_DIR), str(out), "--recipe", "moe"]) == 0
    return out, load_file(out / "model.safetensors")


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor],
             quantization_config: object = ...) -> ModelConfig:
    """`src`'s checkpoint in `dst` with `tensors` (and the quantization_config replaced, or
    removed for None)."""
    import shutil

    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model.safetensors"))
    if quantization_config is not ...:
        config = json.loads((dst / "config.json").read_text())
        config.pop("quantization_config")
        if quantization_config is not None:
            config["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(config))
    return ModelConfig.from_dir(dst)


def _load(cfg: ModelConfig) -> None:
    from specd.workers.models.layers import dense_linear
    from specd.workers.models.quantization import linear_factory_for

    load_model(cfg, CPU, torch.float32, linear_factory_for(cfg.quantization_config,
                                                           dense_linear))


def test_int4_experts_missing_a_tensor_are_named(
        moe_int4: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    src, tensors = moe_int4
    name = "model.layers.2.mlp.experts.5.up_proj.weight_scale"
    cfg = _rewrite(src, tmp_path / "m", {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(ValueError, match=f"lacks tensor '{name}'"):
        _load(cfg)


def test_int4_experts_in_a_checkpoint_without_quantization_config_are_refused(
        moe_int4: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    src, tensors = moe_int4
    cfg = _rewrite(src, tmp_path / "m", dict(tensors), quantization_config=None)
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.experts.0.down_proj"
                                         r".weight_packed' matches no parameter"):
        _load(cfg)


def test_quantized_tensors_the_config_ignores_are_refused_by_name(
        moe_int4: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    """A config whose ignore list also names the routed experts: their INT4 tensors match no
    (dense) parameter."""
    src, tensors = moe_int4
    qcfg = json.loads((src / "config.json").read_text())["quantization_config"]
    qcfg["ignore"] = [*qcfg["ignore"], "re:.*experts.*"]
    cfg = _rewrite(src, tmp_path / "m", tensors, quantization_config=qcfg)
    with pytest.raises(ValueError, match=r"experts.0.down_proj.weight_packed' matches no"):
        _load(cfg)


def test_int4_kv_b_proj_is_refused(moe_int4: tuple[Path, dict[str, torch.Tensor]],
                                   tmp_path: Path) -> None:
    """MLA splits kv_b_proj into W_UK and W_UV at load, so it must stay dense: refused by
    name when the model is built, before any tensor is read."""
    from specd.workers.models.quantization import quantize_rtn

    src, tensors = moe_int4
    tensors = dict(tensors)
    for name in [n.removesuffix(".weight") for n in tensors if n.endswith("kv_b_proj.weight")]:
        packed, scale = quantize_rtn(tensors.pop(f"{name}.weight"), 32)
        tensors |= {f"{name}.weight_packed": packed, f"{name}.weight_scale": scale,
                    f"{name}.weight_shape": torch.tensor([packed.shape[0], packed.shape[1] * 8])}
    qcfg = json.loads((src / "config.json").read_text())["quantization_config"]
    qcfg["ignore"] = [p if p != "re:.*self_attn.*" else "re:.*self_attn\\.(q|kv_a|o)_.*"
                      for p in qcfg["ignore"]]
    cfg = _rewrite(src, tmp_path / "m", tensors, quantization_config=qcfg)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.kv_b_proj is INT4 under the "
                                         r"checkpoint's quantization_config"):
        _load(cfg)
