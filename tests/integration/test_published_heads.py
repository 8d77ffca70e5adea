"""EAGLE-3 heads as they are published load and behave as the head they were made from.

Each variant is the fixture's committed head rewritten into one published layout: the
config of the original EAGLE-3 releases (`LlamaForCausalLM` with a `draft_vocab_size`),
vLLM's architecture name, `pytorch_model.bin`, sharded safetensors and sharded `.bin` with
their index, no `t2d` (NVIDIA ModelOpt exports), an int32 `d2t`, and the Speculators format
(`Eagle3Speculator`: nested config, `layers.0.` names, the target's embedding inside). Each
names the aux layers by its own format's rule. The engine, greedy in float32, must then
emit the same tokens and draft, accept and verify exactly as with the original head.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specd.ipc.sampling import SamplingParams
from specd.workers.config import FIXTURE_DIR, FIXTURE_MOE_DIR, EngineConfig
from specd.workers.engine.core import EngineCore
from tests.integration.heldout import heldout_prompt_ids

HEAD_DIR = FIXTURE_DIR / "eagle3"
PROMPTS = heldout_prompt_ids(3, 9, 11)
MAX_TOKENS = 16

Tensors = dict[str, torch.Tensor]
Config = dict[str, Any]


def _run(head: Path) -> tuple[list[list[int]], tuple[int, int, int, float]]:
    """Greedy outputs of PROMPTS (all at once) and (drafted, accepted, verify passes,
    acceptance length) with speculation on, a chain of 3 drafts."""
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(draft_model=str(head), dtype="float32", spec_mode="on",
                                   spec_num_steps=3, max_num_batched_tokens=64))
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        out[f"r{i}"] = []
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id] += delta.new_token_ids
    s = core.stats()
    return ([out[f"r{i}"] for i in range(len(PROMPTS))],
            (s.num_drafted, s.num_accepted, s.num_verify_passes, s.acceptance_length))


def _sglang_ids(config: Config) -> list[int]:
    return list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])


def _vllm_ids(config: Config) -> Config:
    """The fixture head's ids as vLLM and Speculators number them (block inputs): the
    LlamaForCausalLMEagle3 ids (block outputs) plus one."""
    return {"eagle_config": {"eagle_aux_hidden_state_layer_ids":
                             [i + 1 for i in _sglang_ids(config)]}}


def _renamed(arch: str) -> Callable[[Tensors, Config], tuple[Tensors, Config]]:
    return lambda t, c: (t, {**c, "architectures": [arch], **_vllm_ids(c)})


def _speculators(tensors: Tensors, config: Config) -> tuple[Tensors, Config]:
    layer_keys = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                  "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size",
                  "tie_word_embeddings")
    target = load_file(str(FIXTURE_DIR / "model.safetensors"))
    renamed = {n.replace("midlayer.", "layers.0.", 1): t for n, t in tensors.items()}
    # The Speculators converter stores the verifier's embedding in the head.
    renamed["embed_tokens.weight"] = target["model.embed_tokens.weight"].float()
    return renamed, {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": {k: config[k] for k in layer_keys},
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        "norm_before_residual": False, "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in _sglang_ids(config)],
        "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "fixture", "architectures": ["LlamaForCausalLM"]}},
    }


def _write(path: Path, tensors: Tensors, config: Config, layout: str) -> Path:
    """Write `tensors` as model.safetensors ("safetensors"), pytorch_model.bin ("bin") or
    three shards with an index ("sharded-safetensors", "sharded-bin")."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {n: t.contiguous() for n, t in tensors.items()}
    if layout == "safetensors":
        save_file(tensors, str(path / "model.safetensors"))
    elif layout == "bin":
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        ext = "safetensors" if layout == "sharded-safetensors" else "bin"
        prefix = "model" if ext == "safetensors" else "pytorch_model"
        names = sorted(tensors)
        weight_map = {}
        for k in range(3):
            shard = f"{prefix}-{k + 1:05d}-of-00003.{ext}"
            part = {n: tensors[n] for n in names[k::3]}
            weight_map.update(dict.fromkeys(part, shard))
            if ext == "safetensors":
                save_file(part, str(path / shard))
            else:
                torch.save(part, path / shard)
        (path / f"{prefix}.{ext}.index.json").write_text(json.dumps(
            {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


def _same(t: Tensors, c: Config) -> tuple[Tensors, Config]:
    return t, c


VARIANTS: dict[str, tuple[Callable[[Tensors, Config], tuple[Tensors, Config]], str]] = {
    "LlamaForCausalLM": (_renamed("LlamaForCausalLM"), "safetensors"),
    "Eagle3LlamaForCausalLM": (_renamed("Eagle3LlamaForCausalLM"), "safetensors"),
    "pytorch_model.bin": (_same, "bin"),
    "sharded-safetensors": (_same, "sharded-safetensors"),
    "sharded-bin": (_same, "sharded-bin"),
    "no-t2d": (lambda t, c: ({n: v for n, v in t.items() if n != "t2d"}, c), "safetensors"),
    "int32-d2t": (lambda t, c: ({**t, "d2t": t["d2t"].int()}, c), "safetensors"),
    "speculators": (_speculators, "safetensors"),
}


@pytest.fixture(scope="module")
def original() -> tuple[list[list[int]], tuple[int, int, int, float]]:
    return _run(HEAD_DIR)


@pytest.fixture(scope="module")
def head_parts() -> tuple[Tensors, Config]:
    return (load_file(str(HEAD_DIR / "model.safetensors")),
            json.loads((HEAD_DIR / "config.json").read_text()))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_published_variant_drafts_and_accepts_as_the_original(
        variant: str, original: tuple[list[list[int]], tuple[int, int, int, float]],
        head_parts: tuple[Tensors, Config], tmp_path: Path) -> None:
    rewrite, layout = VARIANTS[variant]
    tensors, config = rewrite(*head_parts)
    tokens, figures = _run(_write(tmp_path / "head", tensors, config, layout))
    assert tokens == original[0]
    assert figures == original[1]
    assert figures[1] > 0  # the head does draft tokens the target accepts


def test_ids_read_by_the_wrong_rule_change_what_the_head_drafts(
        original: tuple[list[list[int]], tuple[int, int, int, float]],
        head_parts: tuple[Tensors, Config], tmp_path: Path) -> None:
    """The comparison above can tell: the original's config with vLLM-numbered ids (one
    layer later each, read by LlamaForCausalLMEagle3's rule) keeps the output (speculation
    is lossless) but not the acceptance."""
    tensors, config = head_parts
    tokens, figures = _run(_write(tmp_path / "head", tensors, {**config, **_vllm_ids(config)},
                                  "safetensors"))
    assert tokens == original[0]
    assert figures[1] != original[1][1]


# ---- heads as Kimi publishes them: Eagle 3.1 options, quantized and degenerate heads, MLA ----


def _run_plain(model: Path | None = None) -> list[list[int]]:
    """Greedy outputs of PROMPTS with speculation off."""
    torch.set_num_threads(1)
    options: dict[str, Any] = {} if model is None else {"model": str(model)}
    core = EngineCore(EngineConfig(dtype="float32", speculative_algorithm=None,
                                   max_num_batched_tokens=64, **options))
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        out[f"r{i}"] = []
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id] += delta.new_token_ids
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


def test_a_norm_output_head_drafts_from_the_normed_state_and_stays_lossless(
        original: tuple[list[list[int]], tuple[int, int, int, float]],
        head_parts: tuple[Tensors, Config], tmp_path: Path) -> None:
    """The fixture's head marked norm_output (Speculators' Eagle 3.1): it drafts from
    norm(out), so what it drafts changes, and greedy output stays speculation off's."""
    tensors, config = head_parts
    tokens, figures = _run(_write(tmp_path / "head", tensors, {**config, "norm_output": True},
                                  "safetensors"))
    assert tokens == _run_plain() == original[0]
    assert figures[0] > 0 and figures != original[1]


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t, c: (t, {**c, "quantization_config": {"quant_method": "fp8"}}),
     r"quantization_config \(quant_method 'fp8'\) is not supported"),
    (lambda t, c: ({**t, "embed_tokens.weight": torch.zeros(c["vocab_size"], c["hidden_size"])},
                   c),
     "tensor embed_tokens.weight is all zeros"),
    (lambda t, c: ({**t, "fc.weight": torch.zeros_like(t["fc.weight"])}, c),
     "tensor fc.weight is all zeros"),
], ids=["fp8", "zero-embedding", "zero-fc"])
def test_quantized_or_degenerate_heads_are_refused_at_start_up(
        edit: Callable[[Tensors, Config], tuple[Tensors, Config]], message: str,
        head_parts: tuple[Tensors, Config], tmp_path: Path) -> None:
    head = _write(tmp_path / "head", *edit(*head_parts), "safetensors")
    with pytest.raises(ValueError, match=message):
        EngineCore(EngineConfig(draft_model=str(head), dtype="float32", spec_mode="on"))


def _mla_head(root: Path) -> Path:
    """An Eagle3DeepseekV2ForCausalLM head over the MoE fixture: the fixture's trained
    Llama head's fc, norms, MLP, lm_head and vocabulary maps around a random MLA attention
    (the target's MLA shapes and rope) whose output is damped, so that it drafts roughly as
    the trained head does and the target accepts some of it."""
    tensors = load_file(str(FIXTURE_MOE_DIR / "eagle3" / "model.safetensors"))
    config = json.loads((FIXTURE_MOE_DIR / "eagle3" / "config.json").read_text())
    target = json.loads((FIXTURE_MOE_DIR / "config.json").read_text())
    mla_keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "rope_parameters", "rms_norm_eps", "max_position_embeddings")
    config = {k: v for k, v in config.items() if k not in ("head_dim", "num_key_value_heads")}
    config.update({k: target[k] for k in mla_keys}, architectures=["Eagle3DeepseekV2ForCausalLM"],
                  model_type="kimi_k2")
    gen = torch.Generator().manual_seed(5)
    h, heads, q_lora, kv_lora = 128, 4, target["q_lora_rank"], target["kv_lora_rank"]
    nope, rope, v = target["qk_nope_head_dim"], target["qk_rope_head_dim"], target["v_head_dim"]

    def w(*shape: int, gain: float = 1.0) -> torch.Tensor:
        return gain * torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    attn = {"q_a_proj.weight": w(q_lora, 2 * h), "q_a_layernorm.weight": torch.ones(q_lora),
            "q_b_proj.weight": w(heads * (nope + rope), q_lora),
            "kv_a_proj_with_mqa.weight": w(kv_lora + rope, 2 * h),
            "kv_a_layernorm.weight": torch.ones(kv_lora),
            "kv_b_proj.weight": w(heads * (nope + v), kv_lora),
            "o_proj.weight": w(h, heads * v, gain=0.1)}
    tensors = {n: t for n, t in tensors.items() if ".self_attn." not in n}
    tensors.update({f"midlayer.self_attn.{n}": t.bfloat16() for n, t in attn.items()})
    return _write(root, tensors, config, "safetensors")


@pytest.mark.parametrize("options", [
    {"spec_num_steps": 3},
    {"spec_num_steps": 3, "spec_topk": 4, "spec_num_draft_tokens": 8},
], ids=["chain", "tree"])
def test_an_mla_head_over_the_moe_fixture_is_lossless(options: dict[str, Any],
                                                      tmp_path: Path) -> None:
    """The MLA head drafts for the MoE fixture over its latent draft cache (paged catch-up,
    then tree levels over the gathered prefix): greedy output is speculation off's, and the
    target accepts some of its drafts."""
    torch.set_num_threads(1)
    head = _mla_head(tmp_path / "mla")
    core = EngineCore(EngineConfig(model=str(FIXTURE_MOE_DIR), draft_model=str(head),
                                   dtype="float32", spec_mode="on", max_num_batched_tokens=64,
                                   **options))
    assert core.spec is not None
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        out[f"r{i}"] = []
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id] += delta.new_token_ids
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == _run_plain(FIXTURE_MOE_DIR)
    stats = core.stats()
    assert stats.num_drafted > 0 and stats.num_accepted > 0
