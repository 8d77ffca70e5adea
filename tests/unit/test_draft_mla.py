"""The EAGLE-3 head with an MLA layer (`Eagle3DeepseekV2ForCausalLM`): it loads as published
and computes what its trainer and its readers compute.

Oracle: the layer written out plainly from TorchSpec's training code (the trainer of Kimi's
MLA heads) and SGLang's serving code: expanded MLA (per-head k_nope and v from kv_b_proj of
the normed latent, one rope key for all heads, rope in interleaved pairs with YaRN's
frequencies and cos/sin factor from transformers' own `_compute_yarn_parameters`, softmax
scale qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2, latent norms at rms_norm_eps),
float32. Every way the head runs (one dense sequence, batched dense, paged over its latent
cache in chunks and a tree, a draft level over a gathered prefix) must give its logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from specd.workers.runner.attention import build_attention_metadata
from specd.workers.spec.draft_config import DraftConfig
from specd.workers.spec.draft_mla import MlaDraftHead
from specd.workers.spec.draft_model import load_draft_head

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import _compute_yarn_parameters  # noqa: E402

H, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V, INTER = 32, 4, 16, 12, 8, 4, 6, 48
VOCAB, DRAFT_VOCAB, EPS = 40, 16, 1e-5
YARN: dict[str, Any] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707}


def mla_config(**overrides: Any) -> dict[str, Any]:
    """A config.json as NVIDIA ModelOpt exports a Kimi-K2 MLA head (the target's MoE keys
    copied along, which describe nothing of the head)."""
    cfg = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2",
        "num_hidden_layers": 1, "hidden_size": H, "intermediate_size": INTER,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "hidden_act": "silu",
        "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE, "v_head_dim": V, "rms_norm_eps": EPS,
        "rope_theta": 500.0, "rope_scaling": dict(YARN), "max_position_embeddings": 64,
        "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False,
        "n_routed_experts": 384, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "moe_intermediate_size": 2048,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 7],
                         "use_aux_hidden_state": True},
    }
    cfg.update(overrides)
    return cfg


def mla_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=gen)

    target_ids = torch.arange(DRAFT_VOCAB) * 2 + 7
    a = "midlayer.self_attn."
    return {
        "fc.weight": w(H, 3 * H),
        "midlayer.input_layernorm.weight": norm(H), "midlayer.hidden_norm.weight": norm(H),
        "midlayer.post_attention_layernorm.weight": norm(H),
        # Small latents (mean square about 1e-4), so that the latent norms' eps shows.
        a + "q_a_proj.weight": 0.01 * w(Q_LORA, 2 * H), a + "q_a_layernorm.weight": norm(Q_LORA),
        a + "q_b_proj.weight": w(HEADS * (NOPE + ROPE), Q_LORA),
        a + "kv_a_proj_with_mqa.weight": 0.01 * w(KV_LORA + ROPE, 2 * H),
        a + "kv_a_layernorm.weight": norm(KV_LORA),
        a + "kv_b_proj.weight": w(HEADS * (NOPE + V), KV_LORA),
        a + "o_proj.weight": w(H, HEADS * V),
        "midlayer.mlp.gate_proj.weight": w(INTER, H), "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "norm.weight": norm(H), "lm_head.weight": w(DRAFT_VOCAB, H),
        "d2t": target_ids - torch.arange(DRAFT_VOCAB),
    }


def save(path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def target_embedding() -> torch.Tensor:
    return torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(9))


def _yarn_rope() -> tuple[torch.Tensor, float]:
    """transformers' YaRN inverse frequencies [ROPE / 2] and cos/sin factor for the config."""
    hf = transformers.DeepseekV3Config(
        hidden_size=H, num_attention_heads=HEADS, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE,
        max_position_embeddings=64, rope_parameters={"rope_theta": 500.0, **YARN})
    inv_freq, factor = _compute_yarn_parameters(hf)
    return inv_freq.double(), float(factor)


def reference(t: dict[str, torch.Tensor], embed: torch.Tensor, ids: torch.Tensor,
              aux: torch.Tensor, norm_output: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fed-back states [n, H], the logits [n, DRAFT_VOCAB]) of one sequence at positions
    0..n-1, the MLA layer written out as TorchSpec trains it and SGLang serves it."""
    t = {k: v.double() for k, v in t.items() if v.is_floating_point()}
    a = "midlayer.self_attn."

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    inv_freq, factor = _yarn_rope()

    def rope(x: torch.Tensor, pos: int) -> torch.Tensor:  # x [..., ROPE]: pairs (2i, 2i + 1)
        out = x.clone()
        for i in range(ROPE // 2):
            c, s = math.cos(pos * inv_freq[i]) * factor, math.sin(pos * inv_freq[i]) * factor
            out[..., 2 * i] = x[..., 2 * i] * c - x[..., 2 * i + 1] * s
            out[..., 2 * i + 1] = x[..., 2 * i + 1] * c + x[..., 2 * i] * s
        return out

    n = len(ids)
    hidden = aux.double() @ t["fc.weight"].T
    x = torch.cat([rms(embed.double()[ids], t["midlayer.input_layernorm.weight"]),
                   rms(hidden, t["midlayer.hidden_norm.weight"])], dim=-1)
    q = rms(x @ t[a + "q_a_proj.weight"].T, t[a + "q_a_layernorm.weight"]) @ t[
        a + "q_b_proj.weight"].T
    q = q.view(n, HEADS, NOPE + ROPE)
    c, k_pe = (x @ t[a + "kv_a_proj_with_mqa.weight"].T).split([KV_LORA, ROPE], dim=-1)
    kv = (rms(c, t[a + "kv_a_layernorm.weight"]) @ t[a + "kv_b_proj.weight"].T).view(
        n, HEADS, NOPE + V)
    k_nope, v = kv.split([NOPE, V], dim=-1)
    q_pe = torch.stack([rope(q[p, :, NOPE:], p) for p in range(n)])  # [n, heads, ROPE]
    k_pe = torch.stack([rope(k_pe[p], p) for p in range(n)])  # [n, ROPE], one for all heads
    mscale = 0.1 * YARN["mscale_all_dim"] * math.log(YARN["factor"]) + 1.0
    scale = (NOPE + ROPE) ** -0.5 * mscale * mscale
    attn = torch.zeros(n, HEADS, V, dtype=torch.float64)
    for h in range(HEADS):
        for i in range(n):
            scores = (k_nope[: i + 1, h] @ q[i, h, :NOPE] + k_pe[: i + 1] @ q_pe[i, h]) * scale
            attn[i, h] = torch.softmax(scores, dim=0) @ v[: i + 1, h]
    h1 = attn.reshape(n, -1) @ t[a + "o_proj.weight"].T + hidden
    y = rms(h1, t["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(y @ t["midlayer.mlp.gate_proj.weight"].T)
           * (y @ t["midlayer.mlp.up_proj.weight"].T)) @ t["midlayer.mlp.down_proj.weight"].T
    out = mlp + h1
    normed = rms(out, t["norm.weight"])
    return (normed if norm_output else out).float(), (normed @ t["lm_head.weight"].T).float()


def _inputs(n: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=gen), torch.randn(n, 3 * H, generator=gen)


def test_config_reads_the_mla_layer_and_its_cache_is_one_latent_row() -> None:
    cfg = DraftConfig.from_dict(mla_config())
    assert cfg.mla_layer is not None and cfg.mla_layer.mla is not None
    assert cfg.mla_layer.mla.latent_size == KV_LORA + ROPE
    assert cfg.mla_layer.rope_scaling is not None and cfg.mla_layer.rope_scaling.factor == 4.0
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps) == (HEADS, NOPE + ROPE, EPS)
    assert cfg.aux_layer_ids == (2, 5, 8)  # SGLang's rule: block outputs
    assert cfg.kv_elements_per_token == KV_LORA + ROPE
    assert cfg.kv_layer_shape(5, 4) == (5, 4, KV_LORA + ROPE)


@pytest.mark.parametrize("norm_output", [False, True])
def test_mla_head_matches_the_reference(tmp_path: Path, norm_output: bool) -> None:
    tensors = mla_tensors()
    head = load_draft_head(save(tmp_path / "head", tensors, mla_config(norm_output=norm_output)),
                           target_embedding())
    assert isinstance(head, MlaDraftHead)
    ids, aux = _inputs(7)
    want_out, want_logits = reference(tensors, target_embedding(), ids, aux, norm_output)
    positions = torch.arange(7)
    with torch.no_grad():
        hidden = head.fuse(aux)
        out = head(ids, positions, hidden)
        dense = head.forward_dense(head.embed_tokens(ids)[None], hidden[None], positions[None])[0]
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.logits(out), want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense, out, atol=1e-6, rtol=1e-6)


def test_paged_forward_matches_dense_for_chunks_and_a_tree(tmp_path: Path) -> None:
    """Over its latent cache: an 18-row chunk (the expanded path), a 2-row chunk and a
    3-node tree (the absorbed path) equal the dense forward."""
    head = load_draft_head(save(tmp_path / "head", mla_tensors(), mla_config()),
                           target_embedding())
    ids, aux = _inputs(23)
    positions = torch.tensor([*range(21), 21, 21])  # the last two are siblings
    block_size, table = 4, [3, 0, 2, 5, 1, 4]
    cache = torch.zeros(head.config.kv_layer_shape(6, block_size))
    outs = []
    with torch.no_grad():
        hidden = head.fuse(aux)
        for start, end, tree_mask in ((0, 18, None), (18, 20, None),
                                      (20, 23, torch.tensor([0b001, 0b011, 0b101]))):
            meta = build_attention_metadata([end - start], [end], [table], block_size,
                                            torch.device("cpu"), tree_mask)
            outs.append(head(ids[start:end], positions[start:end], hidden[start:end], cache,
                             meta))
        mask = torch.ones(23, 23, dtype=torch.bool).tril()
        mask[22, 21] = False
        dense = head.forward_dense(head.embed_tokens(ids)[None], hidden[None], positions[None],
                                   mask)[0]
    torch.testing.assert_close(torch.cat(outs), dense, atol=1e-5, rtol=1e-5)


def test_a_draft_level_over_the_gathered_prefix_matches_dense(tmp_path: Path) -> None:
    """Two nodes (siblings at the same depth) attend a 6-row paged prefix: `draft_level`
    over `gather_prefix` equals the dense forward of prefix + nodes under the tree mask."""
    head = load_draft_head(save(tmp_path / "head", mla_tensors(), mla_config()),
                           target_embedding())
    ids, aux = _inputs(8)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6])
    block_size, table = 4, [1, 0]
    cache = torch.zeros(head.config.kv_layer_shape(2, block_size))
    with torch.no_grad():
        hidden = head.fuse(aux)
        meta = build_attention_metadata([6], [6], [table], block_size, torch.device("cpu"))
        head(ids[:6], positions[:6], hidden[:6], cache, meta)
        slots = torch.tensor([[4, 5, 6, 7, 0, 1]])  # table [1, 0]: positions 0..5
        prefix = head.gather_prefix(cache, slots)
        scratch: list[tuple[torch.Tensor, ...]] = []
        level_mask = torch.tensor([[[True] * 6 + [True, False], [True] * 6 + [False, True]]])
        level = head.draft_level(head.embed_tokens(ids[6:])[None], hidden[6:][None],
                                 positions[6:][None], prefix, scratch, level_mask)[0]
        mask = torch.ones(8, 8, dtype=torch.bool).tril()
        mask[7, 6] = False
        dense = head.forward_dense(head.embed_tokens(ids)[None], hidden[None], positions[None],
                                   mask)[0]
    assert len(scratch) == 1 and scratch[0][0].shape == (1, 2, KV_LORA + ROPE)
    torch.testing.assert_close(level, dense[6:], atol=1e-5, rtol=1e-5)


def test_latent_norms_use_the_configs_eps(tmp_path: Path) -> None:
    head = load_draft_head(save(tmp_path / "head", mla_tensors(), mla_config()),
                           target_embedding())
    assert isinstance(head, MlaDraftHead)
    assert head.attn.kv_a_layernorm.eps == EPS and head.attn.q_a_layernorm.eps == EPS


@pytest.mark.parametrize(("config", "message"), [
    (mla_config(rope_interleave=False), "rope_interleave must be true"),
    (mla_config(rope_scaling={"rope_type": "llama3", "factor": 2.0}), "unsupported rope type"),
    (mla_config(attention_bias=True), "attention_bias must be false"),
    (mla_config(num_hidden_layers=2), "one-layer"),
    (mla_config(quantization_config={"quant_method": "fp8"}),
     r"quantization_config \(quant_method 'fp8'\) is not supported"),
])
def test_mla_configs_it_cannot_serve_are_refused_naming_the_field(
        tmp_path: Path, config: dict[str, Any], message: str) -> None:
    path = save(tmp_path / "head", mla_tensors(), config)
    with pytest.raises(ValueError, match=message) as info:
        load_draft_head(path, target_embedding())
    assert "\n" not in str(info.value) and str(path / "config.json") in str(info.value)
