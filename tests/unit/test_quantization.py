"""INT4 checkpoints: config parsing, packing, the Int4Linear layer and tools/quantize.py.

The independent oracle is the `compressed-tensors` package itself: its packer, its compressor
and its model-free checkpoint dequantizer must agree bit for bit with specd's code.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
    CompressedTensorsDequantizer,
)
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specd.workers.models.quantization import (
    Int4Linear,
    QuantConfig,
    StoredLinears,
    dequantize_int4,
    is_quantized,
    linear_factory_for,
    pack_int4,
    quantize_rtn,
    unpack_int4,
)
from tools import quantize as quantize_tool

# Kimi-K2-Thinking's quantization_config: only the routed experts INT4 (group 32, symmetric).
KIMI_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32, "dynamic": False, "actorder": None,
                    "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
}


def _ct_scheme(group_size: int) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


# ----------------------------------------------------------------------------- config


def test_parses_kimi_config_and_honours_its_ignore_patterns() -> None:
    qcfg = QuantConfig.from_dict(KIMI_CONFIG)
    assert qcfg.group_size == 32
    assert is_quantized("model.layers.3.mlp.experts.17.gate_proj", qcfg)
    assert is_quantized("model.layers.60.mlp.experts.383.down_proj", qcfg)
    assert not is_quantized("model.layers.3.self_attn.q_a_proj", qcfg)
    assert not is_quantized("model.layers.3.mlp.shared_experts.up_proj", qcfg)
    assert not is_quantized("model.layers.0.mlp.gate_proj", qcfg)  # the dense layer-0 MLP
    assert not is_quantized("lm_head", qcfg)
    assert is_quantized("lm_head_extra", qcfg)  # plain ignore entries are exact names
    assert not is_quantized("model.layers.0.mlp.gate_proj", None)


def test_targets_other_than_linear_are_names_or_patterns() -> None:
    qcfg = QuantConfig(group_size=64, targets=("re:.*experts.*", "model.layers.0.o_proj"))
    assert is_quantized("model.layers.1.mlp.experts.0.up_proj", qcfg)
    assert is_quantized("model.layers.0.o_proj", qcfg)
    assert not is_quantized("model.layers.1.o_proj", qcfg)
    # re: patterns match from the start of the name (re.match), as compressed-tensors does.
    assert not is_quantized("x.experts", QuantConfig(group_size=32, targets=("re:experts",)))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_config_round_trips_through_compressed_tensors(group_size: int) -> None:
    """to_dict is what ModelCompressor.update_config writes; CT parses it back to our scheme."""
    qcfg = QuantConfig(group_size=group_size, ignore=("lm_head", "re:.*mlp.gate$"))
    ct = QuantizationConfig(config_groups={"group_0": _ct_scheme(group_size)},
                            ignore=list(qcfg.ignore), format="pack-quantized",
                            quantization_status="compressed")
    import compressed_tensors

    written = {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
               "sparsity_config": {}, "transform_config": {},
               **ct.model_dump(exclude=["quant_method"])}
    assert qcfg.to_dict() == written
    assert QuantConfig.from_dict(written) == qcfg
    parsed = QuantizationConfig.model_validate(qcfg.to_dict())
    assert parsed.config_groups["group_0"].weights.group_size == group_size


@pytest.mark.parametrize(("preset", "error"), [
    ("W4A16", None), ("W4A16_ASYM", None), ("W8A16", "num_bits"),
    ("W4A8", "input_activations"),
])
def test_compressed_tensors_presets(preset: str, error: str | None) -> None:
    """llm-compressor's presets as they land in config.json: W4A16 (symmetric or not) loads,
    the rest name why."""
    from compressed_tensors.quantization import preset_name_to_scheme

    ct = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                            ignore=["lm_head"], format="pack-quantized",
                            quantization_status="compressed")
    raw = {"quant_method": "compressed-tensors", **ct.model_dump(exclude=["quant_method"])}
    if error is None:
        assert QuantConfig.from_dict(raw) == QuantConfig(group_size=128, ignore=("lm_head",),
                                                         symmetric=preset == "W4A16")
    else:
        with pytest.raises(ValueError, match=error):
            QuantConfig.from_dict(raw)


def _with(path: str, value: Any) -> dict[str, Any]:
    """KIMI_CONFIG with the dotted `path` set to `value` (the key deleted for ...)."""
    cfg = copy.deepcopy(KIMI_CONFIG)
    *parents, leaf = path.split(".")
    node = cfg
    for key in parents:
        node = node[key]
    if value is ...:
        del node[leaf]
    else:
        node[leaf] = value
    return cfg


W = "config_groups.group_0.weights"


@pytest.mark.parametrize(("path", "value", "named"), [
    ("quant_method", "gptq", "quant_method"),
    ("format", "naive-quantized", "format"),
    ("format", "nvfp4-pack-quantized", "format"),
    ("quantization_status", "initialized", "quantization_status"),
    ("kv_cache_scheme", {"num_bits": 8}, "kv_cache_scheme"),
    ("sparsity_config", {"format": "sparse-24-bitmask"}, "sparsity_config"),
    ("config_groups.group_1", KIMI_CONFIG["config_groups"]["group_0"], "config_groups"),
    ("config_groups.group_0.input_activations", {"num_bits": 8}, "input_activations"),
    ("config_groups.group_0.format", "float-quantized", "format"),
    ("config_groups.group_0.targets", [], "targets"),
    (f"{W}.num_bits", 8, "num_bits"),
    (f"{W}.type", "float", "type"),
    (f"{W}.symmetric", "yes", "symmetric"),
    (f"{W}.strategy", "tensor", "strategy"),
    (f"{W}.strategy", "block", "strategy"),
    (f"{W}.strategy", ..., "strategy"),
    (f"{W}.group_size", 16, "group_size"),
    (f"{W}.group_size", ..., "group_size"),
    (f"{W}.actorder", "group", "actorder"),
    (f"{W}.num_bits", 2, "num_bits"),
    (f"{W}.dynamic", True, "dynamic"),
    (f"{W}.block_structure", [128, 128], "block_structure"),
    (f"{W}.rounding", "stochastic", "rounding"),
    ("compression_ratio", 3.5, "compression_ratio"),
    ("ignore", "lm_head", "ignore"),
    ("ignore", ["re:(unclosed"], "unclosed"),
])
def test_unsupported_options_are_rejected_by_name(path: str, value: Any, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        QuantConfig.from_dict(_with(path, value))


@pytest.mark.parametrize(("path", "value", "field"), [
    (f"{W}.actorder", "group", "actorder"),
    (f"{W}.num_bits", 8, "num_bits"),
    (f"{W}.strategy", "tensor_group", "strategy"),
    ("quantization_status", "initialized", "quantization_status"),
])
def test_refusals_name_the_field_and_its_value(path: str, value: Any, field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be one of .*, got {value!r}"):
        QuantConfig.from_dict(_with(path, value))


@pytest.mark.parametrize(("path", "value"), [
    (f"{W}.actorder", "static"), (f"{W}.actorder", "weight"), (f"{W}.actorder", False),
    ("quantization_status", "frozen"),
])
def test_published_options_that_store_nothing_different_are_accepted(path: str,
                                                                     value: Any) -> None:
    """actorder static/weight only changed the quantizer's column order (no g_idx stored);
    a frozen status stores the same packed tensors."""
    assert QuantConfig.from_dict(_with(path, value)) == QuantConfig.from_dict(KIMI_CONFIG)


def test_asymmetric_and_channel_wise_weights_are_parsed() -> None:
    asym = QuantConfig.from_dict(_with(f"{W}.symmetric", False))
    assert (asym.group_size, asym.symmetric, asym.strategy) == (32, False, "group")
    channel = _with(f"{W}.strategy", "channel")
    channel["config_groups"]["group_0"]["weights"]["group_size"] = None
    parsed = QuantConfig.from_dict(channel)
    assert (parsed.group_size, parsed.symmetric, parsed.strategy) == (None, True, "channel")
    with pytest.raises(ValueError, match="group_size must be null with strategy 'channel'"):
        QuantConfig.from_dict(_with(f"{W}.strategy", "channel"))


@pytest.mark.parametrize(("group_size", "symmetric"), [(64, False), (None, True), (None, False)])
def test_asymmetric_and_channel_configs_round_trip_through_compressed_tensors(
        group_size: int | None, symmetric: bool) -> None:
    """CT parses to_dict's scheme back, and its own dump parses to the same QuantConfig."""
    qcfg = QuantConfig(group_size=group_size, symmetric=symmetric, ignore=("lm_head",))
    parsed = QuantizationConfig.model_validate(qcfg.to_dict()).config_groups["group_0"].weights
    assert (parsed.group_size, parsed.symmetric, parsed.strategy) == (
        group_size, symmetric, qcfg.strategy)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric,
                            strategy=qcfg.strategy, group_size=group_size)
    ct = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=args, format="pack-quantized")}, ignore=["lm_head"],
        format="pack-quantized", quantization_status="compressed")
    raw = {"quant_method": "compressed-tensors",
           **ct.model_dump(mode="json", exclude={"quant_method"})}
    assert QuantConfig.from_dict(raw) == qcfg


def test_older_compression_config_key_is_read(tmp_path: Path) -> None:
    """config.json's `compression_config` (older compressed-tensors exports) holds the same
    object as `quantization_config`."""
    from specd.workers.models.config import ModelConfig

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
              "vocab_size": 97, "max_position_embeddings": 64,
              "compression_config": KIMI_CONFIG}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.quantization_config == KIMI_CONFIG


# ----------------------------------------------------------------------------- packing


@pytest.mark.parametrize("k", [8, 36, 96, 128])
def test_pack_and_unpack_match_compressed_tensors(k: int) -> None:
    q = torch.randint(-8, 8, (13, k), dtype=torch.int8, generator=torch.Generator().manual_seed(k))
    packed = pack_int4(q)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(packed, k), q)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size([13, k])), q)


def test_pack_rejects_values_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.full((2, 8), 8, dtype=torch.int8))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_round_to_nearest_error_is_half_a_step(group_size: int) -> None:
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(group_size)).bfloat16()
    w[3, :group_size] = 0  # an all-zero group stays exactly zero
    packed, scale = quantize_rtn(w, group_size)
    assert scale.dtype == torch.bfloat16 and scale.shape == (24, 256 // group_size)
    deq = dequantize_int4(packed, scale, group_size, 256, torch.float32)
    step = scale.float().repeat_interleave(group_size, dim=1)
    # Half a step, plus the bf16 rounding of the scale itself (relative 2**-8, times |q| <= 8).
    assert bool(((w.float() - deq).abs() <= step * (0.5 + 8 * 2**-8)).all())
    assert torch.equal(deq[3, :group_size], torch.zeros(group_size))
    q = unpack_int4(packed, 256)
    assert int(q.min()) == -8 or int(q.max()) == 7  # the full signed range is used


# ----------------------------------------------------------------------------- the layer


def test_weights_compressed_by_compressed_tensors_load_to_the_same_values() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 96, generator=gen).bfloat16()
    scale = (weight.float().view(40, 3, 32).abs().amax(-1) / 7.5).bfloat16()  # CT's minmax
    compressed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale},
                                                       _ct_scheme(32))
    expected = PackedQuantizationCompressor.decompress(compressed, _ct_scheme(32))["weight"]
    layer = Int4Linear(96, 40, bias=False, group_size=32)
    for name, tensor in compressed.items():
        layer.load_weight(name, tensor, None, None)
    assert torch.equal(layer.dequantized_weight(), expected)
    # In fp32 the layer dequantizes exactly (q * scale, no bf16 rounding of the product).
    q = unpack_from_int32(compressed["weight_packed"], 4, torch.Size([40, 96]))
    exact = q.float() * scale.float().repeat_interleave(32, dim=1)
    x = torch.randn(5, 96, generator=gen)
    torch.testing.assert_close(layer(x), x @ exact.t())
    torch.testing.assert_close(layer(x.bfloat16()), (x.bfloat16().float() @ expected.float().t())
                               .bfloat16())


def test_fused_shards_fill_their_rows_and_check_weight_shape() -> None:
    """q/k/v shards of sizes (8, 4, 4) stacked into one layer, with their biases."""
    gen = torch.Generator().manual_seed(1)
    shards = [torch.randn(rows, 64, generator=gen) for rows in (8, 4, 4)]
    layer = Int4Linear(64, 16, bias=True, group_size=32).float()
    biases = [torch.randn(w.shape[0], generator=gen) for w in shards]
    for i, (w, b) in enumerate(zip(shards, biases, strict=True)):
        packed, scale = quantize_rtn(w, 32)
        for name, t in (("weight_packed", packed), ("weight_scale", scale),
                        ("weight_shape", torch.tensor(w.shape)), ("bias", b)):
            layer.load_weight(name, t, i, (8, 4, 4))
    assert layer.weight_shape.tolist() == [16, 64]
    dense = torch.cat([dequantize_int4(*quantize_rtn(w, 32), 32, 64, torch.float32)
                       for w in shards])
    x = torch.randn(3, 2, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ dense.t() + torch.cat(biases))
    with pytest.raises(ValueError, match=r"weight_shape is \[4, 64\], expected \[8, 64\]"):
        layer.load_weight("weight_shape", torch.tensor([4, 64]), 0, (8, 4, 4))
    with pytest.raises(ValueError, match="weight_packed has shape"):
        layer.load_weight("weight_packed", torch.zeros(4, 9, dtype=torch.int32), 1, (8, 4, 4))
    with pytest.raises(ValueError, match="no tensor 'weight'"):
        layer.load_weight("weight", torch.zeros(4, 64), 1, (8, 4, 4))


def _ct_asym_compress(weight: torch.Tensor, group_size: int | None
                     ) -> tuple[dict[str, torch.Tensor], QuantizationScheme]:
    """`weight` [N, K] compressed by compressed-tensors with zero points (min/max qparams)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, group_size=group_size,
                            strategy="channel" if group_size is None else "group")
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    grouped = weight.float().view(weight.shape[0], -1, group_size or weight.shape[1])
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    state = {"weight": weight.float(), "weight_scale": scale.bfloat16(),
             "weight_zero_point": zero.round().to(torch.int8)}
    return PackedQuantizationCompressor.compress(state, scheme), scheme


@pytest.mark.parametrize("group_size", [32, None], ids=["group32", "channel"])
def test_asymmetric_weights_load_and_compute_as_compressed_tensors_decompresses(
        group_size: int | None) -> None:
    """Zero points and channel-wise scales: the layer's weight is compressed-tensors'
    decompression (computed with fp32 scales, so exact), and its forward uses it."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 96, generator=gen)
    compressed, scheme = _ct_asym_compress(weight, group_size)
    assert "weight_zero_point" in compressed
    exact = PackedQuantizationCompressor.decompress(
        {**compressed, "weight_scale": compressed["weight_scale"].float()}, scheme)["weight"]
    layer = Int4Linear(96, 40, bias=False, group_size=group_size, symmetric=False).float()
    for name, tensor in compressed.items():
        layer.load_weight(name, tensor, None, None)
    torch.testing.assert_close(layer.dequantized_weight(), exact, atol=0, rtol=0)
    x = torch.randn(5, 96, generator=gen)
    torch.testing.assert_close(layer(x), x @ exact.t())


def test_asymmetric_fused_shards_stack_zero_point_words() -> None:
    """gate/up shards of 16 rows each: each shard's zero-point words fill its rows' words; a
    shard not starting on a multiple of 8 rows cannot be stacked and is refused."""
    gen = torch.Generator().manual_seed(3)
    shards = [torch.randn(16, 64, generator=gen) for _ in range(2)]
    layer = Int4Linear(64, 32, bias=False, group_size=32, symmetric=False).float()
    exact = []
    for i, w in enumerate(shards):
        compressed, scheme = _ct_asym_compress(w, 32)
        for name, t in compressed.items():
            layer.load_weight(name, t, i, (16, 16))
        exact.append(PackedQuantizationCompressor.decompress(
            {**compressed, "weight_scale": compressed["weight_scale"].float()}, scheme)["weight"])
    torch.testing.assert_close(layer.dequantized_weight(), torch.cat(exact), atol=0, rtol=0)
    odd = Int4Linear(64, 16, bias=False, group_size=32, symmetric=False)
    with pytest.raises(ValueError, match="weight_zero_point of a fused shard of rows"):
        odd.load_weight("weight_zero_point", torch.zeros(1, 2, dtype=torch.int32), 1, (4, 12))


def test_symmetric_layer_refuses_zero_points_and_any_layer_refuses_g_idx() -> None:
    layer = Int4Linear(64, 16, bias=False, group_size=32)
    with pytest.raises(ValueError, match="no tensor 'weight_zero_point'"):
        layer.load_weight("weight_zero_point", torch.zeros(2, 2, dtype=torch.int32), None, None)
    with pytest.raises(ValueError, match="weight_g_idx: activation ordering by group"):
        layer.load_weight("weight_g_idx", torch.zeros(64, dtype=torch.int32), None, None)


def test_linear_factory_picks_int4_or_dense_per_module() -> None:
    def dense(i: int, o: int, bias: bool, names: tuple[str, ...]) -> nn.Module:
        return nn.Linear(i, o, bias=bias)

    factory = linear_factory_for(_with("ignore", ["lm_head", "re:.*o_proj"]), dense)
    qkv = factory(64, 96, False, ("l.0.q_proj", "l.0.k_proj", "l.0.v_proj"))
    assert isinstance(qkv, Int4Linear) and qkv.group_size == 32
    assert isinstance(factory(64, 64, False, ("l.0.o_proj",)), nn.Linear)
    assert isinstance(factory(64, 1000, False, ("lm_head",)), nn.Linear)
    with pytest.raises(ValueError, match="mixes INT4 and dense"):
        factory(64, 96, False, ("l.0.q_proj", "l.0.o_proj"))
    assert linear_factory_for(None, dense) is dense
    with pytest.raises(ValueError, match="does not divide in_features"):
        factory(80, 16, False, ("l.0.down_proj",))


def test_names_are_matched_as_the_checkpoint_spells_them() -> None:
    """Kimi-K2.5's language model sits under `language_model.`: its config's exact names and
    anchored patterns carry the prefix, and the factory matches the model's names with it."""
    def dense(i: int, o: int, bias: bool, names: tuple[str, ...]) -> nn.Module:
        return nn.Linear(i, o, bias=bias)

    config = _with("ignore", ["language_model.lm_head", r"re:language_model\.model\..*attn.*"])
    factory = linear_factory_for(config, dense, "language_model.")
    assert isinstance(factory(64, 1000, False, ("lm_head",)), nn.Linear)
    assert isinstance(factory(64, 64, False, ("model.layers.0.self_attn.o_proj",)), nn.Linear)
    assert isinstance(factory(64, 64, False, ("model.layers.0.mlp.down_proj",)), Int4Linear)
    # Without the prefix the entries do not match lm_head: the config alone makes it INT4,
    # and it loads INT4 when the checkpoint stores it packed (dense otherwise: quant_stored).
    assert is_quantized("lm_head", QuantConfig.from_dict(config))
    packed = StoredLinears.from_names(["lm_head.weight_packed", "lm_head.weight_scale"])
    unprefixed = linear_factory_for(config, dense, stored=packed)
    assert isinstance(unprefixed(64, 1024, False, ("lm_head",)), Int4Linear)


# ----------------------------------------------------------------------------- the tool


def _write_bf16_checkpoint(root: Path) -> dict[str, torch.Tensor]:
    """A two-layer Llama-shaped checkpoint in two shards with an index and side files."""
    gen = torch.Generator().manual_seed(2)
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(50, 64),
                                        "model.norm.weight": torch.ones(64),
                                        "lm_head.weight": torch.randn(50, 64)}
    for i in range(2):
        p = f"model.layers.{i}"
        shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64),
                  "self_attn.v_proj": (32, 64), "self_attn.o_proj": (64, 64),
                  "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64), "mlp.down_proj": (64, 96)}
        for name, shape in shapes.items():
            tensors[f"{p}.{name}.weight"] = torch.randn(*shape, generator=gen) * 0.05
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(64)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(64)
    tensors = {k: v.bfloat16() for k, v in tensors.items()}
    root.mkdir()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10],
              "model-00002-of-00002.safetensors": names[10:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(root / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                  "torch_dtype": "bfloat16"}))
    (root / "tokenizer.json").write_text("{}")
    (root / "generation_config.json").write_text('{"eos_token_id": 2}')
    return tensors


def _read_dir(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def test_quantize_tool_output_decompresses_with_compressed_tensors(tmp_path: Path) -> None:
    src, dst = tmp_path / "bf16", tmp_path / "int4"
    original = _write_bf16_checkpoint(src)
    assert quantize_tool.main([str(src), str(dst), "--group-size", "32"]) == 0
    config = json.loads((dst / "config.json").read_text())
    qcfg = QuantConfig.from_dict(config["quantization_config"])
    assert qcfg == QuantConfig(group_size=32, ignore=("lm_head",))
    assert (dst / "tokenizer.json").is_file() and (dst / "generation_config.json").is_file()
    written = _read_dir(dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(written)
    # compressed-tensors' own model-free dequantizer, on the files as written.
    ct_dense = CompressedTensorsDequantizer(dst, dtype=torch.bfloat16).process(dict(written))
    assert set(ct_dense) == set(original)
    for name, tensor in original.items():
        module = name.removesuffix(".weight")
        if f"{module}.weight_packed" in written:
            assert written[f"{module}.weight_shape"].tolist() == list(tensor.shape)
            ours = dequantize_int4(written[f"{module}.weight_packed"],
                                   written[f"{module}.weight_scale"], 32, tensor.shape[1])
            assert torch.equal(ct_dense[name], ours), name
            assert ".layers." in name
        else:  # embeddings, norms, lm_head: untouched
            assert torch.equal(written[name], tensor), name
            assert ".layers." not in name or name.endswith("norm.weight")


def test_moe_recipe_refuses_a_checkpoint_without_routed_experts(tmp_path: Path) -> None:
    _write_bf16_checkpoint(tmp_path / "bf16")
    with pytest.raises(ValueError, match="no routed expert weights"):
        quantize_tool.quantize_checkpoint(tmp_path / "bf16", tmp_path / "int4", 32, [], "moe")
    assert not (tmp_path / "int4").exists()


@pytest.mark.parametrize("prefix", ["", "language_model."])
def test_moe_recipe_quantizes_the_routed_experts_only(tmp_path: Path, prefix: str) -> None:
    """A tiny DeepSeek-shaped checkpoint (a dense layer, a MoE layer with two experts, a
    shared expert, the router, lm_head): only the experts are packed, the rest is
    byte-identical, and compressed-tensors reads Kimi's ignore list back, with a prefixed
    lm_head (Kimi-K2.5's layout) named after it."""
    gen = torch.Generator().manual_seed(4)
    shapes = {"model.layers.0.mlp.gate_proj": (96, 64), "model.layers.0.self_attn.o_proj": (64, 64),
              "model.layers.1.mlp.gate": (2, 64), "lm_head": (50, 64),
              "model.layers.1.mlp.shared_experts.up_proj": (32, 64),
              **{f"model.layers.1.mlp.experts.{e}.{p}_proj": (32, 64) if p != "down" else (64, 32)
                 for e in range(2) for p in ("gate", "up", "down")}}
    shapes = {prefix + module: shape for module, shape in shapes.items()}
    tensors = {f"{m}.weight": torch.randn(*s, generator=gen).bfloat16() for m, s in shapes.items()}
    (tmp_path / "bf16").mkdir()
    save_file(tensors, str(tmp_path / "bf16" / "model.safetensors"))
    (tmp_path / "bf16" / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"]}')
    assert quantize_tool.main([str(tmp_path / "bf16"), str(tmp_path / "int4"), "--recipe", "moe",
                               "--group-size", "32"]) == 0
    written = _read_dir(tmp_path / "int4")
    packed = {n.removesuffix(".weight_packed") for n in written if n.endswith("weight_packed")}
    assert packed == {m for m in shapes if ".experts." in m}
    for module in set(shapes) - packed:
        assert torch.equal(written[f"{module}.weight"], tensors[f"{module}.weight"]), module
    raw = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]
    extra = [f"{prefix}lm_head"] if prefix else []
    assert QuantizationConfig.model_validate(raw).ignore == [*quantize_tool.MOE_IGNORE, *extra]


def test_quantize_tool_refuses_bad_input(tmp_path: Path) -> None:
    src = tmp_path / "bf16"
    _write_bf16_checkpoint(src)
    with pytest.raises(ValueError, match="not a multiple of group size 128"):
        quantize_tool.quantize_checkpoint(src, tmp_path / "out", 128, [])
    quantize_tool.quantize_checkpoint(src, tmp_path / "ok", 32, ["re:.*mlp.down_proj"])
    written = _read_dir(tmp_path / "ok")
    assert written["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="already has a quantization_config"):
        quantize_tool.quantize_checkpoint(tmp_path / "ok", tmp_path / "again", 32, [])
