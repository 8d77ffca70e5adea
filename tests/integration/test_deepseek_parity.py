"""DeepSeek-V3 / Kimi-K2 over the paged latent cache against transformers as the oracle.

Tiny random models are made with transformers' DeepseekV3Config and `save_pretrained`
(safetensors, per-expert tensors), loaded by specd's loader and driven with hand-built block
tables and `build_attention_metadata` (no scheduler, no model runner: the runner does not
allocate the latent cache yet). Prefill groups of at least EXPAND_MIN_QUERY_LEN rows take
the expanded path, decode, short chunks and draft trees the absorbed one; every logit is
compared with transformers' logits of the same full sequence.

Configs: first layer dense then MoE, 8 routed experts, top-2, a shared expert, sigmoid
routing with a nonzero correction bias. "v3-yarn": q_lora_rank set, 4 groups of which 2
are kept, YaRN factor 8 with mscale != mscale_all_dim. "q-proj": q_lora_rank null (plain
q_proj), NeoX (non-interleaved) rope, attention biases, no top-k normalization. "kimi":
model_type kimi_k2, one expert group, YaRN with beta_fast == beta_slow. "kimi-k25": the kimi
model nested as Kimi-K2.5's language model (`language_model.` tensors, a vision tensor).

Tolerance: float32 throughout; specd sums in other orders (fused gate/up, experts sorted by
expert, absorbed W_UK/W_UV products instead of up-projected K/V, SDPA over padded blocks).
Measured differences are at most 6e-6 on logits up to ~4.7; ATOL 1e-4 keeps a wide margin
and still catches a wrong position, mask, scale or expert (which move logits by 1e-2 or
more). Greedy argmax must be equal as well.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specd.workers.models.config import ModelConfig
from specd.workers.models.deepseek_v3 import DeepseekV3ForCausalLM
from specd.workers.models.loader import load_model
from specd.workers.runner.attention import build_attention_metadata
from specd.workers.runner.attention_backend import LATENT, TorchLatentAttention

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 96
CPU = torch.device("cpu")
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
             initializer_range=0.15, n_group=4, topk_group=2, eos_token_id=None)
CONFIGS: dict[str, dict[str, Any]] = {
    "v3-yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                     "original_max_position_embeddings": 32, "beta_fast": 32,
                                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}),
    "q-proj": dict(q_lora_rank=None, rope_interleave=False, attention_bias=True,
                   norm_topk_prob=False, routed_scaling_factor=1.5, n_group=2, topk_group=1),
    "kimi": dict(n_group=1, topk_group=1, routed_scaling_factor=2.827, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64, "beta_fast": 1,
                                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def save_model(name: str, path: Path) -> Any:
    """A random transformers model of CONFIGS[name], saved to `path`, in eval mode."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**(SMALL | CONFIGS[name]))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # random norms, biases and correction biases: none may be skipped
        for param_name, p in model.named_parameters():
            if "norm" in param_name or param_name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.2)
    model.save_pretrained(path)
    if name == "kimi":
        config_path = path / "config.json"
        config_path.write_text(json.dumps(json.loads(config_path.read_text())
                                          | {"model_type": "kimi_k2"}))
    return model.eval()


def nest_as_kimi_k25(src: Path, dst: Path) -> None:
    """Kimi-K2.5's layout: the language model's config as text_config, its tensors under
    `language_model.`, beside a vision tensor that specd does not serve."""
    text = json.loads((src / "config.json").read_text())
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text, "vision_config": {"hidden_size": 8}}
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(wrapper))
    tensors = {f"language_model.{k}": v for k, v in load_file(src / "model.safetensors").items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3)
    save_file(tensors, str(dst / "model.safetensors"))


@pytest.fixture(scope="module", params=[*sorted(CONFIGS), "kimi-k25"])
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Any, DeepseekV3ForCausalLM]:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "kimi-k25":
        hf = save_model("kimi", path / "inner")
        nest_as_kimi_k25(path / "inner", path / "k25")
        path = path / "k25"
    else:
        hf = save_model(request.param, path)
    model = load_model(ModelConfig.from_dir(path), CPU, torch.float32)
    assert isinstance(model, DeepseekV3ForCausalLM)
    return hf, model


class Paged:
    """A model over its own latent cache, with blocks handed out from the top down (so
    sequences interleave and never sit in cache order)."""

    def __init__(self, model: DeepseekV3ForCausalLM) -> None:
        cfg = model.config
        self.model = model
        dtype = model.model.embed_tokens.weight.dtype
        self.caches = [torch.zeros(cfg.kv_layer_shape(NUM_BLOCKS, BLOCK_SIZE), dtype=dtype)
                       for _ in range(cfg.num_layers)]
        self.next_free = NUM_BLOCKS - 1
        self.blocks: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def step(self, work: list[tuple[int, list[int]]], tree_mask: torch.Tensor | None = None,
             depths: list[list[int]] | None = None) -> list[torch.Tensor]:
        """Each (sequence, new token ids) after the sequence's computed ones -> its logits
        [n, vocab]. With a tree, `depths` give each row's depth (rope position = computed +
        depth) and nothing is marked computed."""
        query_lens, seq_lens, tables, positions = [], [], [], []
        for i, (seq, tokens) in enumerate(work):
            start = self.computed.setdefault(seq, 0)
            table = self.blocks.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < start + len(tokens):
                table.append(self.next_free)
                self.next_free -= 1
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            tables.append(table)
            offsets = range(len(tokens)) if depths is None else depths[i]
            positions += [start + d for d in offsets]
            if tree_mask is None:
                self.computed[seq] = start + len(tokens)
        meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, CPU,
                                        tree_mask)
        ids = torch.tensor([t for _, tokens in work for t in tokens])
        with torch.inference_mode():
            hidden, _ = self.model(ids, torch.tensor(positions), self.caches, meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


def hf_logits(hf: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]  # [T, vocab]


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in (20, 17, 5, 1)]


def test_batched_prefill_then_decode_match_transformers(
        models: tuple[Any, DeepseekV3ForCausalLM]) -> None:
    """One step with query groups of 20 and 17 rows (expanded) and 5 and 1 (absorbed),
    then decode steps of the four sequences together (absorbed), crossing blocks."""
    hf, model = models
    paged = Paged(model)
    seqs = prompts(hf.config.vocab_size)
    logits = paged.step(list(enumerate(seqs)))
    for tokens, got in zip(seqs, logits, strict=True):
        assert_matches(got, hf_logits(hf, tokens))
    for step in range(5):
        for i, tokens in enumerate(seqs):
            tokens.append((7 * step + 3 * i) % hf.config.vocab_size)
        logits = paged.step([(i, tokens[-1:]) for i, tokens in enumerate(seqs)])
        for tokens, got in zip(seqs, logits, strict=True):
            assert_matches(got[0], hf_logits(hf, tokens)[-1])


def test_chunked_prefill_matches_transformers(
        models: tuple[Any, DeepseekV3ForCausalLM]) -> None:
    """An expanded chunk over a short cached prefix, and an absorbed chunk over a long one."""
    hf, model = models
    paged = Paged(model)
    tokens = prompts(hf.config.vocab_size)[0] + prompts(hf.config.vocab_size)[2]  # 25
    for split in (4, 18):
        first, second = paged.step([(split, tokens[:split])]), paged.step([(split, tokens[split:])])
        assert_matches(torch.cat([first[0], second[0]]), hf_logits(hf, tokens))


# A draft tree of 6 rows: row 0 is the root (depth 0), then children by parent row.
TREE_PARENTS = [-1, 0, 0, 1, 2, 3]


def tree_rows() -> tuple[list[int], list[int]]:
    """(each row's ancestors-or-self bit mask, its depth)."""
    masks: list[int] = []
    depths: list[int] = []
    for row, parent in enumerate(TREE_PARENTS):
        masks.append((masks[parent] if parent >= 0 else 0) | (1 << row))
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
    return masks, depths


def test_tree_verification_matches_transformers(
        models: tuple[Any, DeepseekV3ForCausalLM]) -> None:
    """Two sequences verify a draft tree each over their cached prefix (absorbed, tree bit
    mask, rope position = prefix + depth); each node's logits are transformers' logits of
    the prefix followed by the node's path."""
    hf, model = models
    paged = Paged(model)
    prefixes = prompts(hf.config.vocab_size)[:2]
    paged.step(list(enumerate(prefixes)))
    masks, depths = tree_rows()
    g = torch.Generator().manual_seed(2)
    trees = [torch.randint(hf.config.vocab_size, (6,), generator=g).tolist() for _ in range(2)]
    tree_mask = torch.tensor(masks * 2, dtype=torch.int64)
    logits = paged.step(list(enumerate(trees)), tree_mask, [depths, depths])
    for prefix, tree, got in zip(prefixes, trees, logits, strict=True):
        for row in range(6):
            path = [tree[j] for j in range(6) if masks[row] >> j & 1]
            assert_matches(got[row], hf_logits(hf, prefix + path)[-1])


def test_expanded_and_absorbed_paths_agree(models: tuple[Any, DeepseekV3ForCausalLM]) -> None:
    """The same prefill through either path (forced by the row threshold), fresh caches."""
    _, model = models
    tokens = prompts(model.config.vocab_size)[0]
    outputs = []
    for threshold in (1, 10**6):
        for layer in model.model.layers:
            layer.self_attn.attention = TorchLatentAttention(expand_min_query_len=threshold)
        outputs.append(Paged(model).step([(0, tokens)])[0])
    for layer in model.model.layers:
        layer.self_attn.attention = LATENT.on_cpu
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0)


def test_greedy_generation_matches_transformers(
        models: tuple[Any, DeepseekV3ForCausalLM]) -> None:
    hf, model = models
    paged = Paged(model)
    prompt = prompts(hf.config.vocab_size)[1]
    tokens, new = list(prompt), list(prompt)
    for _ in range(8):
        logits = paged.step([(0, new)])[0]
        new = [int(logits[-1].argmax())]
        tokens += new
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                               pad_token_id=0)[0].tolist()
    assert tokens == expected


def test_kimi_k25_skips_the_vision_part(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                        ) -> None:
    save_model("kimi", tmp_path / "inner")
    nest_as_kimi_k25(tmp_path / "inner", tmp_path / "k25")
    with caplog.at_level("INFO", logger="specd.loader"):
        load_model(ModelConfig.from_dir(tmp_path / "k25"), CPU, torch.float32)
    skipped = [r for r in caplog.records if getattr(r, "event", "") == "unserved_tensors_skipped"]
    assert len(skipped) == 1 and getattr(skipped[0], "count", 0) == 1


def test_multi_token_prediction_layer_is_skipped_and_missing_expert_named(
        tmp_path: Path) -> None:
    save_model("kimi", tmp_path / "src")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    # DeepSeek-V3 checkpoints hold a multi-token-prediction layer after the last one.
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    for name, files, change in (
            ("mtp", tensors | mtp, {"num_nextn_predict_layers": 1}),
            ("no-mtp", tensors | mtp, {"num_nextn_predict_layers": 0}),
            ("missing", {k: v for k, v in tensors.items()
                         if k != "model.layers.1.mlp.experts.5.up_proj.weight"}, {}),
            ("dense-expert", tensors | {"model.layers.0.mlp.experts.0.up_proj.weight":
                                        torch.zeros(32, 64)}, {})):
        path = tmp_path / name
        path.mkdir()
        shutil.copy(tmp_path / "src" / "config.json", path / "config.json")
        (path / "config.json").write_text(json.dumps(config | change))
        save_file(files, str(path / "model.safetensors"))
    load_model(ModelConfig.from_dir(tmp_path / "mtp"), CPU, torch.float32)
    with pytest.raises(ValueError, match="'model.layers.3.*' matches no parameter"):
        load_model(ModelConfig.from_dir(tmp_path / "no-mtp"), CPU, torch.float32)
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.1.mlp.experts.5.up_proj"):
        load_model(ModelConfig.from_dir(tmp_path / "missing"), CPU, torch.float32)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.experts.0.up_proj.weight' "
                                         "matches no parameter"):
        load_model(ModelConfig.from_dir(tmp_path / "dense-expert"), CPU, torch.float32)


def test_bfloat16_load_keeps_the_router_in_float32(tmp_path: Path) -> None:
    hf = save_model("v3-yarn", tmp_path)
    model = load_model(ModelConfig.from_dir(tmp_path), CPU, torch.bfloat16)
    assert isinstance(model, DeepseekV3ForCausalLM)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias,
                       hf.model.layers[1].mlp.gate.e_score_correction_bias)
    assert model.model.layers[1].self_attn.w_uk.dtype == torch.bfloat16
    logits = Paged(model).step([(0, prompts(hf.config.vocab_size)[0])])[0]
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
