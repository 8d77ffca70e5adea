"""The EAGLE-3 draft head: loads the published checkpoint layout, computes what it should."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specd.workers.spec.draft_config import DraftConfig, aux_layer_ids_as, resolve_aux_layer_ids
from specd.workers.spec.draft_model import load_draft_head

H, HEADS, KV_HEADS, HEAD_DIM, INTER = 32, 4, 2, 8, 48
VOCAB, DRAFT_VOCAB = 40, 16


def published_config(**overrides) -> dict:
    """A config.json as SpecForge writes it for LlamaForCausalLMEagle3."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "num_hidden_layers": 1, "hidden_size": H, "intermediate_size": INTER,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 500.0,
        "max_position_embeddings": 256, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 7]},
    }
    cfg.update(overrides)
    return cfg


def published_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the published names; draft vocab = every other target id + 7."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])

    target_ids = torch.arange(DRAFT_VOCAB) * 2 + 7
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    return {
        "fc.weight": w(H, 3 * H),
        "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=gen),
        "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(H, generator=gen),
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=gen),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": w(INTER, H),
        "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "norm.weight": 1 + 0.1 * torch.randn(H, generator=gen),
        "lm_head.weight": w(DRAFT_VOCAB, H),
        "d2t": target_ids - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }


def save(path: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config or published_config()))
    return path


def target_embedding() -> torch.Tensor:
    return torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(9))


def speculators_config(flat: dict, norm_before_residual: bool = False) -> dict:
    """`flat` (a LlamaForCausalLMEagle3 config) as the Speculators library writes it: the
    layer under transformer_layer_config, the EAGLE-3 keys at the top, ids by vLLM's rule."""
    layer_keys = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                  "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")
    ids = flat["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": {k: flat[k] for k in layer_keys},
        "draft_vocab_size": flat["draft_vocab_size"], "target_hidden_size": None,
        "norm_before_residual": norm_before_residual, "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "target",
                                            "architectures": ["LlamaForCausalLM"]}},
    }


def reference_logits(t: dict[str, torch.Tensor], embed: torch.Tensor, ids: torch.Tensor,
                     aux: torch.Tensor, eps: float = 1e-6, theta: float = 500.0,
                     norm_before_residual: bool = False) -> torch.Tensor:
    """The EAGLE-3 layer written out plainly for one sequence (positions 0..n-1).

    norm_before_residual as Speculators' Eagle3DecoderLayer: the residual is the normed
    hidden state."""

    def rms(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x, pos):  # x [heads, d] at position pos; pairs (i, i + d/2) rotate together
        half = HEAD_DIM // 2
        out = x.clone()
        for i in range(half):
            angle = pos / theta ** (2 * i / HEAD_DIM)
            c, s = math.cos(angle), math.sin(angle)
            out[:, i] = x[:, i] * c - x[:, i + half] * s
            out[:, i + half] = x[:, i + half] * c + x[:, i] * s
        return out

    n = len(ids)
    hidden = aux @ t["fc.weight"].T
    x = torch.cat([rms(embed[ids], t["midlayer.input_layernorm.weight"]),
                   rms(hidden, t["midlayer.hidden_norm.weight"])], dim=-1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    q = torch.stack([rope(q[p], p) for p in range(n)])
    k = torch.stack([rope(k[p], p) for p in range(n)])
    attn = torch.zeros(n, HEADS, HEAD_DIM)
    for h in range(HEADS):
        kv = h // (HEADS // KV_HEADS)
        for i in range(n):
            scores = (k[: i + 1, kv] @ q[i, h]) / math.sqrt(HEAD_DIM)
            attn[i, h] = torch.softmax(scores, dim=0) @ v[: i + 1, kv]
    residual = rms(hidden, t["midlayer.hidden_norm.weight"]) if norm_before_residual else hidden
    h1 = attn.reshape(n, -1) @ t["midlayer.self_attn.o_proj.weight"].T + residual
    y = rms(h1, t["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(y @ t["midlayer.mlp.gate_proj.weight"].T)
           * (y @ t["midlayer.mlp.up_proj.weight"].T)) @ t["midlayer.mlp.down_proj.weight"].T
    out = mlp + h1
    return rms(out, t["norm.weight"]) @ t["lm_head.weight"].T


def test_published_layout_loads_and_matches_the_reference(tmp_path):
    tensors = published_tensors()
    embed = target_embedding()
    head = load_draft_head(save(tmp_path / "head", tensors), embed)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (7,), generator=gen)
    aux = torch.randn(7, 3 * H, generator=gen)
    expected = reference_logits(tensors, embed, ids, aux)
    with torch.no_grad():
        positions = torch.arange(7)
        out = head(ids, positions, head.fuse(aux))  # the engine path, dense attention
        dense = head.forward_dense(embed[ids][None], head.fuse(aux)[None], positions[None])[0]
        torch.testing.assert_close(head.logits(out), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(head.logits(dense), expected, atol=1e-5, rtol=1e-5)


def test_embedding_is_shared_with_the_target_and_vocab_maps_apply(tmp_path):
    embed = target_embedding()
    head = load_draft_head(save(tmp_path / "head", published_tensors()), embed)
    assert head.embed_tokens.weight.data_ptr() == embed.data_ptr()
    assert head.to_target_ids(torch.tensor([0, 1, 15])).tolist() == [7, 9, 37]
    assert int(head.t2d.sum()) == DRAFT_VOCAB and bool(head.t2d[9])
    # LlamaForCausalLMEagle3 names the outputs of blocks 1, 4, 7: hidden states 2, 5, 8.
    assert resolve_aux_layer_ids(head.config, 12) == (2, 5, 8)


def test_a_checkpoint_embedding_is_used_when_present(tmp_path):
    tensors = published_tensors()
    tensors["embed_tokens.weight"] = torch.ones(VOCAB, H)
    head = load_draft_head(save(tmp_path / "head", tensors))
    assert torch.equal(head.embed_tokens.weight, torch.ones(VOCAB, H))


def test_sglang_and_speculators_name_variants_load(tmp_path):
    tensors = {("model." + n if n.startswith("midlayer") else n): t
               for n, t in published_tensors().items()}
    tensors = {n.replace("model.midlayer.", "layers.0.", 1) if "mlp" in n else n: t
               for n, t in tensors.items()}
    head = load_draft_head(save(tmp_path / "head", tensors), target_embedding())
    expected = published_tensors()["midlayer.mlp.up_proj.weight"]
    assert torch.equal(head.midlayer.mlp.up_proj.weight, expected)


def test_dtype_is_applied_and_rope_stays_float32(tmp_path):
    head = load_draft_head(save(tmp_path / "head", published_tensors()), target_embedding(),
                           dtype=torch.bfloat16)
    assert head.fc.weight.dtype == torch.bfloat16
    assert head.inv_freq.dtype == torch.float32
    assert head.d2t.dtype == torch.int64


def test_aux_layer_ids_default_and_top_level_field():
    cfg = published_config()
    del cfg["eagle_config"]
    assert resolve_aux_layer_ids(DraftConfig.from_dict(cfg), 12) == (2, 6, 9)
    cfg["eagle_aux_hidden_state_layer_ids"] = [-1, 3, 11]  # -1: the embedding output
    assert resolve_aux_layer_ids(DraftConfig.from_dict(cfg), 12) == (0, 4, 12)
    with pytest.raises(ValueError, match="out of range"):
        resolve_aux_layer_ids(DraftConfig.from_dict(cfg), 8)


def test_each_format_reads_aux_layer_ids_by_its_own_rule():
    """The same three target hidden states (2, 6, 9), named as each format's trainer names
    them: SpecForge/SGLang count block outputs, vLLM and Speculators block inputs."""
    sglang = published_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 5, 8]})
    vllm_ids = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 6, 9]}}
    variants = {
        "LlamaForCausalLMEagle3": sglang,
        "Eagle3LlamaForCausalLM": {**sglang, "architectures": ["Eagle3LlamaForCausalLM"],
                                   **vllm_ids},
        "LlamaForCausalLM": {**sglang, "architectures": ["LlamaForCausalLM"], **vllm_ids},
        "Eagle3Speculator": speculators_config(sglang),
    }
    for fmt, raw in variants.items():
        cfg = DraftConfig.from_dict(raw)
        assert resolve_aux_layer_ids(cfg, 12) == (2, 6, 9), fmt
        assert aux_layer_ids_as(cfg, fmt) == (
            [1, 5, 8] if fmt == "LlamaForCausalLMEagle3" else [2, 6, 9]), fmt
    assert DraftConfig.from_dict(published_config(eagle_config={})).aux_layer_ids is None


def test_the_kimi_k25_head_config_parses_as_a_llama_head():
    """TorchSpec's configs/draft_models/kimi_k25_eagle3.json (the config
    lightseekorg/kimi-k2.5-eagle3 was trained from): one Llama layer over Kimi-K2.5's hidden
    size, the whole vocabulary (no draft_vocab_size, no d2t needed), no rope scaling and no
    aux ids (the reference default)."""
    cfg = DraftConfig.from_dict({
        "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 163584, "eos_token_id": 163585,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
        "intermediate_size": 12288, "max_position_embeddings": 262144,
        "max_window_layers": 36, "model_type": "llama", "num_attention_heads": 64,
        "num_hidden_layers": 1, "num_key_value_heads": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 163840})
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (7168, 64, 128)
    assert cfg.draft_vocab_size == cfg.vocab_size == 163840 and cfg.target_hidden_size == 7168
    assert (cfg.rope_type, cfg.rope_theta, cfg.aux_layer_ids) == ("default", 1000000, None)
    assert resolve_aux_layer_ids(cfg, 61) == (2, 30, 58)
    assert cfg.mla_layer is None and cfg.kv_elements_per_token == 2 * 64 * 128


def test_speculators_config_maps_to_the_same_head():
    flat = DraftConfig.from_dict(published_config())
    spec = DraftConfig.from_dict(speculators_config(published_config(), True))
    assert spec == DraftConfig(**{**flat.__dict__, "norm_before_residual": True})


def test_norm_before_residual_matches_the_reference(tmp_path):
    tensors = published_tensors(seed=3)
    embed = target_embedding()
    path = save(tmp_path / "head", tensors, speculators_config(published_config(), True))
    head = load_draft_head(path, embed)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (6,), generator=gen)
    aux = torch.randn(6, 3 * H, generator=gen)
    expected = reference_logits(tensors, embed, ids, aux, norm_before_residual=True)
    with torch.no_grad():
        out = head(ids, torch.arange(6), head.fuse(aux))
    torch.testing.assert_close(head.logits(out), expected, atol=1e-5, rtol=1e-5)
    plain = reference_logits(tensors, embed, ids, aux)
    assert (plain - expected).abs().max() > 1e-2  # the option changes what the head computes


def test_norm_output_feeds_back_the_normed_state_with_the_same_logits(tmp_path):
    """Speculators' norm_output (Eagle 3.1; vLLM reads it from any config): the state fed to
    the next draft step is norm(out) and the logits are lm_head of it, i.e. the logits of
    one step are unchanged and only what the next step reads differs."""
    tensors = published_tensors(seed=3)
    embed = target_embedding()
    plain = load_draft_head(save(tmp_path / "plain", tensors), embed)
    normed = load_draft_head(save(tmp_path / "normed", tensors,
                                  speculators_config(published_config()) | {"norm_output": True}),
                             embed)
    assert normed.config.norm_output and not plain.config.norm_output
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (6,), generator=gen)
    aux = torch.randn(6, 3 * H, generator=gen)
    with torch.no_grad():
        out_plain = plain(ids, torch.arange(6), plain.fuse(aux))
        out_normed = normed(ids, torch.arange(6), normed.fuse(aux))
        torch.testing.assert_close(out_normed, plain.norm(out_plain), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(normed.logits(out_normed),
                                   reference_logits(tensors, embed, ids, aux), atol=1e-5,
                                   rtol=1e-5)
    assert (out_normed - out_plain).abs().max() > 1e-2
    flat = DraftConfig.from_dict(published_config(norm_output=True))
    assert flat.norm_output  # read at the top level of any format


@pytest.mark.parametrize("config, message", [
    (published_config(quantization_config={"quant_method": "fp8", "fmt": "e4m3"}),
     r"quantization_config \(quant_method 'fp8'\) is not supported"),
    (published_config(compression_config={"quant_method": "compressed-tensors"}),
     r"compression_config \(quant_method 'compressed-tensors'\)"),
    ({**speculators_config(published_config()), "transformer_layer_config": {
        **speculators_config(published_config())["transformer_layer_config"],
        "quantization_config": {"quant_method": "modelopt"}}},
     r"transformer_layer_config.quantization_config \(quant_method 'modelopt'\)"),
    ({**speculators_config(published_config()), "fc_norm": True}, "fc_norm"),
])
def test_quantized_and_unsupported_norm_heads_are_refused_naming_the_field(
        tmp_path, config, message):
    path = save(tmp_path / "head", published_tensors(), config)
    with pytest.raises(ValueError, match=message) as info:
        load_draft_head(path, target_embedding())
    assert "\n" not in str(info.value) and str(path / "config.json") in str(info.value)


@pytest.mark.parametrize("name, value, message", [
    ("embed_tokens.weight", torch.zeros(VOCAB, H), "embed_tokens.weight is all zeros"),
    ("fc.weight", torch.zeros(H, 3 * H), "fc.weight is all zeros"),
    ("lm_head.weight", torch.zeros(DRAFT_VOCAB, H), "lm_head.weight is all zeros"),
    ("midlayer.hidden_norm.weight", torch.full((H,), float("nan")),
     "midlayer.hidden_norm.weight holds non-finite values"),
    ("midlayer.self_attn.q_proj.weight",
     torch.ones(HEADS * HEAD_DIM, 2 * H).index_fill_(1, torch.tensor([3]), float("inf")),
     "q_proj.weight holds non-finite values"),
])
def test_a_degenerate_head_is_refused_naming_the_tensor(tmp_path, name, value, message):
    """An all-zero embedding (of the head's own), fc or lm_head drafts nothing a target
    accepts, a NaN or an infinity anywhere poisons every draft: refused at load."""
    tensors = published_tensors() | {name: value}
    with pytest.raises(ValueError, match=message):
        load_draft_head(save(tmp_path / "head", tensors), target_embedding())


def test_the_targets_embedding_is_not_the_heads_to_refuse(tmp_path):
    """A shared embedding is the target's, not checked as the head's."""
    head = load_draft_head(save(tmp_path / "head", published_tensors()), torch.zeros(VOCAB, H))
    assert not head.embed_tokens.weight.any()


def test_int32_d2t_loads_and_a_missing_t2d_is_derived(tmp_path):
    tensors = published_tensors()
    t2d = tensors.pop("t2d")
    tensors["d2t"] = tensors["d2t"].int()
    head = load_draft_head(save(tmp_path / "head", tensors), target_embedding())
    assert head.d2t.dtype == torch.int64
    assert torch.equal(head.d2t, published_tensors()["d2t"])
    assert torch.equal(head.t2d, t2d)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("fc.weight"), "missing tensors \\['fc.weight'\\]"),
    (lambda t: t.update({"midlayer.extra.weight": torch.zeros(1)}), "unexpected tensors"),
    (lambda t: t.update({"midlayer.self_attn.q_proj.weight": torch.zeros(HEADS * HEAD_DIM, H)}),
     "q_proj.weight has shape \\(32, 32\\), expected \\(32, 64\\)"),
    (lambda t: t.update({"t2d": torch.ones(VOCAB, dtype=torch.bool)}), "t2d does not mark"),
    (lambda t: t.update({"d2t": torch.full((DRAFT_VOCAB,), 100)}), "outside the target"),
    (lambda t: t.update({"d2t": t["d2t"].float()}), "d2t must hold integers"),
    (lambda t: t.update({"d2t": torch.zeros(DRAFT_VOCAB, dtype=torch.int64) - torch.arange(
        DRAFT_VOCAB) + 7}), "two draft ids to the same target token"),
    (lambda t: t.update({"t2d": t["t2d"].int()}), "t2d must be bool"),
    (lambda t: t.pop("d2t"), "missing tensors \\['d2t'\\]"),
])
def test_wrong_tensors_raise_naming_the_tensor(tmp_path, edit, message):
    tensors = published_tensors()
    edit(tensors)
    with pytest.raises(ValueError, match=message):
        load_draft_head(save(tmp_path / "head", tensors), target_embedding())


def _without(key: str) -> dict:
    cfg = published_config(architectures=["LlamaForCausalLM"])
    del cfg[key]
    return cfg


@pytest.mark.parametrize("config, message", [
    (published_config(architectures=["MistralForCausalLM"]), "architectures must contain"),
    (_without("draft_vocab_size"), "LlamaForCausalLM without draft_vocab_size"),
    (published_config(architectures=["Eagle3Speculator"]), "speculators_model_type"),
    ({**speculators_config(published_config()), "speculators_model_type": "eagle"},
     "speculators_model_type must be eagle3"),
    ({k: v for k, v in speculators_config(published_config()).items()
      if k != "norm_before_residual"}, "must set norm_before_residual"),
    ({**speculators_config(published_config()), "norm_before_fc": True}, "norm_before_fc"),
    ({**speculators_config(published_config()), "transformer_layer_config": {
        **speculators_config(published_config())["transformer_layer_config"],
        "model_type": "qwen3"}}, "model_type must be llama"),
    (published_config(attention_bias=True), "attention_bias must be false"),
    (published_config(mlp_bias=True), "mlp_bias must be false"),
    (published_config(eagle_config={"use_aux_hidden_state": False}), "use_aux_hidden_state"),
    (published_config(num_hidden_layers=2), "one-layer"),
    (published_config(draft_vocab_size=VOCAB + 1), "draft_vocab_size"),
    (published_config(rope_scaling={"rope_type": "yarn"}), "rope type"),
    (published_config(num_key_value_heads=3), "multiple of num_key_value_heads"),
])
def test_wrong_config_raises_one_line_naming_the_field(tmp_path, config, message):
    path = save(tmp_path / "head", published_tensors(), config)
    with pytest.raises(ValueError, match=message) as info:
        load_draft_head(path, target_embedding())
    assert "\n" not in str(info.value) and str(path / "config.json") in str(info.value)


def test_missing_files_and_embedding_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_draft_head(tmp_path / "nothing")
    path = save(tmp_path / "head", published_tensors())
    with pytest.raises(ValueError, match="no embed_tokens.weight"):
        load_draft_head(path)


def test_paged_forward_matches_dense_for_chunks_and_a_tree(tmp_path):
    """The head over its own paged KV cache (the engine path) equals the dense forward:
    a 5-token chunk, a 2-token chunk, then a 3-node tree (root, two siblings)."""
    from specd.workers.runner.attention import build_attention_metadata

    head = load_draft_head(save(tmp_path / "head", published_tensors()), target_embedding())
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (10,), generator=gen)
    hidden = head.fuse(torch.randn(10, 3 * H, generator=gen))
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 8])  # the siblings share depth 1
    block_size, table = 4, [3, 0, 2]
    cache = torch.zeros(2, 4, block_size, KV_HEADS, HEAD_DIM)
    outs = []
    with torch.no_grad():
        for start, end, tree_mask in ((0, 5, None), (5, 7, None),
                                      (7, 10, torch.tensor([0b001, 0b011, 0b101]))):
            meta = build_attention_metadata([end - start], [end], [table], block_size,
                                            torch.device("cpu"), tree_mask)
            outs.append(head(ids[start:end], positions[start:end], hidden[start:end], cache, meta))
        mask = torch.ones(10, 10, dtype=torch.bool).tril()
        mask[9, 8] = False  # the second sibling does not see the first
        dense = head.forward_dense(head.embed_tokens(ids)[None], hidden[None], positions[None],
                                   mask)[0]
    torch.testing.assert_close(torch.cat(outs), dense, atol=1e-5, rtol=1e-5)
