"""Which linears a quantization config makes INT4, and which load INT4.

Oracle for the config's matching: compressed-tensors' own matchers, `is_match` (what
`apply_quantization_config` runs over a model's named modules, a torch Linear per module)
and `match_quantizable_tensors` (its model-free path over a checkpoint's tensor names), on
Kimi's published ignore lists and on every module name of the fixture checkpoints and of
Kimi-K2.5's published tensor index, with and without the `language_model.` prefix. What a
linear then loads as (lm_head only when stored packed; any other disagreement between the
config and the stored tensors refused naming the rule) is checked on the factory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compressed_tensors.utils.match import is_match, match_quantizable_tensors
from safetensors import safe_open
from torch import nn

from specd.workers.config import FIXTURE_DIR, FIXTURE_MOE_DIR
from specd.workers.models.quant_config import QuantConfig, is_quantized, module_of
from specd.workers.models.quant_stored import StoredLinears, dense_output_note, linear_is_int4
from specd.workers.models.quantization import Int4Linear, linear_factory_for

KIMI_RULES = ["re:.*self_attn.*", "re:.*shared_experts.*",
              r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
# Kimi-K2-Thinking's list, which the Kimi-K2.5 release carries unchanged (top level and
# text_config): an exact `lm_head` although its tensor is `language_model.lm_head.weight`.
KIMI_IGNORE = ["lm_head", *KIMI_RULES]
IGNORE_LISTS = {
    "kimi-k2": KIMI_IGNORE,
    # The prefixed spelling with the vision parts named (as quantizers write a wrapper's).
    "kimi-k2.5-prefixed": ["language_model.lm_head", *KIMI_RULES, "re:.*vision_tower.*",
                           "re:.*mm_projector.*"],
    # The pattern spelling of Moonshot's later compressed-tensors releases.
    "kimi-pattern": [*KIMI_RULES, "re:.*lm_head.*", "re:.*vision_tower.*",
                     "re:.*mm_projector.*"],
    "class-name": ["Linear"],
    "none": [],
}
TARGET_LISTS = {"Linear": ["Linear"], "experts": [r"re:.*experts\.\d+\..*"],
                "exact": ["model.layers.1.mlp.experts.0.up_proj", "lm_head"]}
# Kimi-K2.5's language-model modules (layer 0 dense, the rest MoE) and its vision parts, as
# its published tensor index names them.
KIMI_K25_MODULES = [
    "language_model.lm_head", "language_model.model.embed_tokens",
    *(f"language_model.model.layers.{i}.self_attn.{p}" for i in (0, 60)
      for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")),
    *(f"language_model.model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")),
    *(f"language_model.model.layers.{i}.mlp.experts.{e}.{p}_proj" for i in (1, 60)
      for e in (0, 383) for p in ("gate", "up", "down")),
    *(f"language_model.model.layers.1.mlp.shared_experts.{p}_proj"
      for p in ("gate", "up", "down")),
    "language_model.model.layers.1.mlp.gate",
    "vision_tower.encoder.blocks.0.wqkv", "vision_tower.encoder.blocks.0.mlp.fc0",
    "mm_projector.proj.0", "mm_projector.proj.2",
]


def _fixture_modules(model_dir: Path) -> list[str]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sorted({module_of(n) for n in f.keys() if n.endswith(".weight")})  # noqa: SIM118


def _is_linear(module_name: str) -> bool:
    """Whether a fixture or Kimi module is a linear layer (not a norm, the embedding or the
    router, which the model builds as no linear)."""
    return not module_name.endswith(("norm", "embed_tokens", "mlp.gate"))


def _module_names() -> list[str]:
    names = _fixture_modules(FIXTURE_DIR) + _fixture_modules(FIXTURE_MOE_DIR)
    prefixed = [f"language_model.{n}" for n in names]
    unprefixed = [n.removeprefix("language_model.") for n in KIMI_K25_MODULES]
    return sorted(set(names + prefixed + KIMI_K25_MODULES + unprefixed))


@pytest.mark.parametrize("targets", TARGET_LISTS.values(), ids=TARGET_LISTS.keys())
@pytest.mark.parametrize("ignore", IGNORE_LISTS.values(), ids=IGNORE_LISTS.keys())
def test_matching_equals_compressed_tensors(ignore: list[str], targets: list[str]) -> None:
    """For every module name, is_quantized is compressed-tensors' is_match over a torch
    Linear of that name, and the tensor-name path agrees: the module of `NAME.weight` is
    yielded by match_quantizable_tensors exactly when is_quantized says INT4 (a "Linear"
    target means every module there, as for a linear)."""
    qcfg = QuantConfig(group_size=32, targets=tuple(targets), ignore=tuple(ignore))
    linear = nn.Linear(1, 1)
    names = _module_names()
    ours = {n for n in names if is_quantized(n, qcfg)}
    assert ours == {n for n in names if is_match(n, linear, targets, ignore)}
    if "Linear" not in ignore:  # the model-free path matches names only, never classes
        tensors = {f"{n}.weight": torch.zeros(1) for n in names}
        ct_tensors = {m for m, _ in match_quantizable_tensors(tensors, ignore, targets,
                                                              allow_nonquantizable=True)}
        assert ours == ct_tensors
    assert 0 < len(ours) < len(names) or ignore in (["Linear"], []) or targets != ["Linear"]


def test_kimi_lists_quantize_the_routed_experts_only() -> None:
    """Kimi's lists read as Moonshot means them, in either layout; the exact `lm_head` entry
    matches the unprefixed name only (the LM head is then decided by what is stored)."""
    for ignore in (IGNORE_LISTS["kimi-k2"], IGNORE_LISTS["kimi-k2.5-prefixed"],
                   IGNORE_LISTS["kimi-pattern"]):
        qcfg = QuantConfig(group_size=32, ignore=tuple(ignore))
        for prefix in ("", "language_model."):
            int4 = {n.removeprefix(prefix) for n in _module_names()
                    if n.startswith(prefix + "model.") and _is_linear(n)
                    and is_quantized(n, qcfg)}
            assert int4 and all(".experts." in n and ".shared_experts." not in n for n in int4)
    exact = QuantConfig(group_size=32, ignore=tuple(KIMI_IGNORE))
    assert not is_quantized("lm_head", exact)
    assert is_quantized("language_model.lm_head", exact)


def test_names_are_module_names_not_tensor_names() -> None:
    """An entry anchored at the end names a module: it never sees the `.weight` suffix."""
    qcfg = QuantConfig(group_size=32, ignore=("re:.*lm_head$",))
    assert not is_quantized("language_model.lm_head", qcfg)
    assert module_of("language_model.lm_head.weight_packed") == "language_model.lm_head"
    assert is_quantized(module_of("x.o_proj.weight"), qcfg)


# ----------------------------------------------------------------------------- stored


def _dense(i: int, o: int, bias: bool, names: tuple[str, ...]) -> nn.Module:
    return nn.Linear(i, o, bias=bias)


def _config(ignore: list[str]) -> dict[str, object]:
    return QuantConfig(group_size=32, ignore=tuple(ignore)).to_dict()


def _stored(dense: tuple[str, ...] = (), packed: tuple[str, ...] = ()) -> StoredLinears:
    """A checkpoint's view storing `dense` modules as `.weight`, `packed` ones as INT4."""
    kinds = ("weight_packed", "weight_scale", "weight_shape")
    return StoredLinears.from_names([f"{m}.weight" for m in dense]
                                    + [f"{m}.{k}" for m in packed for k in kinds])


def test_stored_linears_reads_packed_and_dense_modules() -> None:
    stored = StoredLinears.from_names(["a.weight_packed", "a.weight_scale", "a.weight_shape",
                                       "b.weight", "b.bias", "c.weight_scale", "norm.weight"])
    assert stored.packed == {"a", "c"}
    assert stored.dense == {"b", "norm"}


def test_lm_head_stored_dense_loads_dense_with_a_note_naming_the_rule() -> None:
    """Kimi-K2.5: the exact `lm_head` entry does not match `language_model.lm_head`, so the
    config alone would make it INT4; stored dense it loads dense, and the line start-up logs
    (workers/models/checkpoint_check.py) says why."""
    stored = StoredLinears.from_names(["language_model.lm_head.weight"])
    factory = linear_factory_for(_config(KIMI_IGNORE), _dense, "language_model.", stored)
    assert type(factory(64, 1000, False, ("lm_head",))) is nn.Linear
    qcfg = QuantConfig(group_size=32, ignore=tuple(KIMI_IGNORE))
    note = dense_output_note("language_model.lm_head", qcfg, "language_model.")
    assert note is not None and note.startswith(
        "language_model.lm_head loads dense (its checkpoint tensor is not packed) although "
        "the quantization_config would make it INT4 (targets entry 'Linear' matches it")
    assert "ignore entry 'lm_head' names it without the checkpoint's 'language_model.'" in note
    assert dense_output_note("lm_head", qcfg) is None  # the config leaves it dense itself
    # Without a view of the checkpoint, lm_head is dense too.
    assert type(linear_factory_for(_config([]), _dense)(64, 10, False, ("lm_head",))) is nn.Linear


def test_lm_head_is_int4_only_when_stored_packed() -> None:
    qcfg = QuantConfig(group_size=32)
    assert linear_is_int4("lm_head", qcfg, _stored(packed=("lm_head",)), output_projection=True)
    assert not linear_is_int4("lm_head", qcfg, _stored(dense=("lm_head",)),
                              output_projection=True)
    factory = linear_factory_for(_config([]), _dense, stored=_stored(packed=("lm_head",)))
    assert isinstance(factory(64, 1024, False, ("lm_head",)), Int4Linear)
    with pytest.raises(ValueError, match=r"'lm_head.weight_packed' is stored INT4, but the "
                       r"quantization_config leaves lm_head dense \(ignore entry 'lm_head' "
                       r"matches it\)"):
        linear_is_int4("lm_head", QuantConfig(group_size=32, ignore=("lm_head",)),
                       _stored(packed=("lm_head",)), output_projection=True)


def test_a_module_stored_packed_that_the_config_leaves_dense_is_refused_by_rule() -> None:
    """Refused when the model is built, naming the tensor and the ignore entry (or that no
    target matches); a block linear stored dense where the config makes it INT4 follows the
    config, and workers/models/checkpoint_check.py refuses it from the headers."""
    name = "language_model.model.layers.0.mlp.down_proj"
    ignored = QuantConfig(group_size=32, ignore=(r"re:.*mlp\.down_proj",))
    with pytest.raises(ValueError, match=r"'.*down_proj.weight_packed' is stored INT4, but the "
                       r"quantization_config leaves .* dense \(ignore entry "
                       r"'re:.\*mlp\\\\.down_proj' matches it\)"):
        linear_is_int4(name, ignored, _stored(packed=(name,)))
    untargeted = QuantConfig(group_size=32, targets=("re:.*experts.*",))
    with pytest.raises(ValueError, match=r"no entry of targets \['re:.\*experts.\*'\] "
                                         r"matches it"):
        linear_is_int4(name, untargeted, _stored(packed=(name,)))
    # Agreeing, stored dense, or not stored at all: the config decides.
    assert linear_is_int4(name, QuantConfig(group_size=32), _stored(packed=(name,)))
    assert linear_is_int4(name, QuantConfig(group_size=32), _stored(dense=(name,)))
    assert not linear_is_int4(name, ignored, _stored(dense=(name,)))
    assert linear_is_int4(name, QuantConfig(group_size=32), _stored())
