"""DeepSeek-V3 / Kimi-K2 through the whole engine: the runner's latent paged cache, the
scheduler (chunked prefill, prefix caching, preemption) and speculation.

Checkpoints are random transformers models (test_deepseek_parity.save_model): "q-proj"
(q_lora_rank null) and "kimi" (model_type kimi_k2, one expert group, YaRN; q_lora_rank
set), first layer dense, then MoE layers of 8 routed experts, top-2, a shared expert. The
oracle is transformers' `generate` (greedy, float32), one prompt at a time.

Blocks of 4 tokens, so that prompts, chunks and draft trees cross blocks. Prefill groups of
at least 16 rows take the expanded attention, shorter ones and decode the absorbed one.

Speculation runs an untrained head of the right shape (`write_head`): its `fc` passes the
target's last hidden state through, its norm and lm_head are the target's, its attention
and MLP are random and small. It ranks the next draft by the target's distribution one
position back (it cannot look further), so drafts are accepted only where the target
repeats a token or continues with a runner-up: about one verify in ten at depth 1, often
at a tree node past the first rank, so accepted paths leave slot order and the latent rows
are compacted (ModelRunner.move_kv). Losslessness is what is tested, not acceptance.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import specd
from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from tests.integration.test_deepseek_parity import save_model

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 20
BLOCK_SIZE = 4
KV_BYTES = 4 * 2**20  # far more than any test needs, far less than the default budget
# (arrival step, prompt index): prompt 3 repeats prompt 0 and prompt 4 shares its first 20
# tokens, both arriving once prompt 0's blocks are computed (prefix caching).
ARRIVALS = [(0, 0), (0, 1), (1, 2), (8, 3), (9, 4)]


def make_prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    first, second, third = (torch.randint(vocab, (n,), generator=gen).tolist()
                            for n in (26, 7, 41))
    return [first, second, third, list(first), first[:20] + [5, 6, 7]]


def hf_generate(hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    torch.set_num_threads(2)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module", params=["q-proj", "kimi"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(model directory, prompts, transformers' greedy continuations)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_model(request.param, path)
    assert hf.config.eos_token_id is None  # generate stops only at NEW_TOKENS
    prompts = make_prompts(hf.config.vocab_size)
    return path, prompts, hf_generate(hf, prompts)


def run(model: Path, prompts: list[list[int]], **options: Any
        ) -> tuple[list[list[int]], list[int], EngineCore]:
    """Every prompt through an in-process engine (requests joining as ARRIVALS says):
    (greedy outputs, cached prompt tokens per request, the engine's core)."""
    torch.set_num_threads(1)
    options = {"dtype": "float32", "block_size": BLOCK_SIZE, "kv_cache_memory_bytes": KV_BYTES,
               "max_num_batched_tokens": 16} | options
    core = specd.Engine(str(model), **options).core
    out: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    pending = list(ARRIVALS)
    step = 0
    while pending or core.has_unfinished():
        while pending and pending[0][0] <= step:
            i = pending.pop(0)[1]
            core.add_request(f"r{i}", prompts[i],
                             SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
            out[f"r{i}"] = []
        for delta in core.step():
            out[delta.request_id] += delta.new_token_ids
            cached[delta.request_id] = delta.num_cached_tokens
        step += 1
    ids = [f"r{i}" for i in range(len(prompts))]
    return [out[r] for r in ids], [cached[r] for r in ids], core


def test_engine_matches_transformers_with_chunks_and_prefix_reuse(
        case: tuple[Path, list[list[int]], list[list[int]]]) -> None:
    model, prompts, expected = case
    got, cached, core = run(model, prompts, speculative_algorithm=None)
    assert got == expected
    # The repeated prompt reuses all its full blocks but the last (its last token is
    # recomputed to sample from), the one sharing 20 tokens its first 5 blocks.
    assert cached[3] == 24 and cached[4] == 20
    cfg = core.model_config
    assert cfg.mla is not None
    assert core.resolved.kv_bytes_per_token == cfg.num_layers * (
        cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 4
    # The budget buys blocks of the latent's size, not of expanded K/V.
    assert core.runner.num_kv_blocks == KV_BYTES // (core.resolved.kv_bytes_per_token
                                                     * BLOCK_SIZE)


def test_engine_matches_transformers_under_preemption(
        case: tuple[Path, list[list[int]], list[list[int]]]) -> None:
    model, prompts, expected = case
    # 20 blocks of 4 tokens cannot hold five sequences of 27-61 tokens at once.
    got, _, core = run(model, prompts, speculative_algorithm=None, num_kv_blocks=20)
    assert core.stats().num_preemptions > 0
    assert got == expected


# --- speculation -------------------------------------------------------------------------


def write_head(model: Path, out: Path) -> Path:
    """An EAGLE-3 head for `model` (see module docstring), reading its hidden states after
    blocks 1, 2 and L (transformers' output_hidden_states numbering)."""
    cfg = json.loads((model / "config.json").read_text())
    target = load_file(model / "model.safetensors")
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv_heads, head_dim, inter = 4, 2, 16, 2 * hidden
    gen = torch.Generator().manual_seed(7)

    def w(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * scale / math.sqrt(cols)

    fc = torch.zeros(hidden, 3 * hidden)
    fc[:, 2 * hidden:] = torch.eye(hidden)  # the third hidden state (after block L)
    tensors = {
        "fc.weight": fc,
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim, 0.05),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter, 0.05),
        "norm.weight": target["model.norm.weight"].clone(),
        "lm_head.weight": target["lm_head.weight"].clone(),
        "d2t": torch.zeros(vocab, dtype=torch.int64),
        "t2d": torch.ones(vocab, dtype=torch.bool),
    }
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "num_hidden_layers": 1, "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg["rms_norm_eps"], "rope_theta": 10000.0,
        "max_position_embeddings": cfg["max_position_embeddings"], "vocab_size": vocab,
        "draft_vocab_size": vocab, "target_hidden_size": hidden,
        # Hidden states 1, 2 and the last block's output, in the format's numbering.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, layers - 1]}}))
    return out


@pytest.fixture(scope="module")
def spec_case(tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, Path, list[list[int]], list[list[int]]]:
    """(model, head, prompts, the engine's greedy outputs without a head) on "kimi"."""
    path = tmp_path_factory.mktemp("spec")
    hf = save_model("kimi", path / "model")
    prompts = make_prompts(hf.config.vocab_size)
    head = write_head(path / "model", path / "head")
    plain, _, _ = run(path / "model", prompts, speculative_algorithm=None)
    return path / "model", head, prompts, plain


SPEC_MODES: dict[str, dict[str, Any]] = {
    "chain": {"spec_mode": "on", "spec_topk": 1, "spec_num_steps": 3},
    "tree": {"spec_mode": "on", "spec_topk": 3, "spec_num_steps": 3,
             "spec_num_draft_tokens": 8},
    "auto": {"spec_mode": "auto", "spec_disable_batch_threshold": 3,
             "spec_auto_measure": False},
}


@pytest.mark.parametrize("overlap", [False, True], ids=["whole-step", "overlap"])
@pytest.mark.parametrize("mode", list(SPEC_MODES))
def test_speculation_is_lossless(spec_case: tuple[Path, Path, list[list[int]], list[list[int]]],
                                 mode: str, overlap: bool) -> None:
    model, head, prompts, plain = spec_case
    got, _, core = run(model, prompts, draft_model=str(head), overlap_schedule=overlap,
                       **SPEC_MODES[mode])
    assert got == plain
    stats = core.stats()
    assert stats.num_drafted > 0
    if mode == "auto":  # four requests at the peak: off above 3, on again at 2 or below
        assert stats.spec_transitions >= 2
    else:
        assert stats.num_accepted > 0
    if overlap:
        assert core.spec is not None and core.spec.verifier.num_lagged_verifies > 0


def test_tree_acceptance_compacts_latent_rows(
        spec_case: tuple[Path, Path, list[list[int]], list[list[int]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepted tree paths off slot order move latent rows; the output stays the plain one,
    under preemption too."""
    from specd.workers.runner.model_runner import ModelRunner

    model, head, prompts, plain = spec_case
    moved: list[int] = []
    real = ModelRunner.move_kv

    def move_kv(self: ModelRunner, src: torch.Tensor, dst: torch.Tensor) -> None:
        moved.append(int((src != dst).sum()))
        real(self, src, dst)

    monkeypatch.setattr(ModelRunner, "move_kv", move_kv)
    for options in ({}, {"num_kv_blocks": 24}):
        moved.clear()
        got, _, core = run(model, prompts, draft_model=str(head), **SPEC_MODES["tree"],
                           **options)
        assert got == plain
        assert sum(moved) > 0
        if options:
            assert core.stats().num_preemptions > 0


def test_aux_hidden_states_are_transformers_hidden_states(tmp_path: Path) -> None:
    """The head's inputs come from the MoE model's layers as transformers numbers them
    (0 = embeddings, k = after block k - 1), captured by the runner in a prefill."""
    from specd.workers.runner.attention import build_attention_metadata
    from specd.workers.runner.model_runner import ModelRunner
    from specd.workers.runner.step_inputs import StepInputs

    hf = save_model("kimi", tmp_path)
    ids = make_prompts(hf.config.vocab_size)[2]
    layers = (0, 1, 2)
    runner = ModelRunner(EngineConfig(model=str(tmp_path), dtype="float32",
                                      block_size=BLOCK_SIZE, num_kv_blocks=16),
                         capture_layers=layers)
    n = len(ids)
    meta = build_attention_metadata([n], [n], [list(range(-(-n // BLOCK_SIZE)))], BLOCK_SIZE,
                                    runner.device)
    with torch.inference_mode():
        runner.forward(StepInputs(torch.tensor(ids), torch.arange(n), meta,
                                  torch.tensor([n - 1]), []))
        expected = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert runner.last_aux_hidden is not None
    torch.testing.assert_close(runner.last_aux_hidden,
                               torch.cat([expected[i][0] for i in layers], dim=-1),
                               atol=1e-4, rtol=0)


def test_cpu_compile_skips_the_dense_kv_paths(
        spec_case: tuple[Path, Path, list[list[int]], list[list[int]]],
        caplog: pytest.LogCaptureFixture) -> None:
    """The kept decode K/V and the compiled decode read per-head K/V: a latent-cache model
    runs without them, says why once (an ERROR record and status), and is still exact."""
    from specd.workers.runner.cpu_backend import CpuBackend

    model, _, prompts, plain = spec_case
    with caplog.at_level(logging.ERROR, logger="specd.cpu_backend"):
        got, _, core = run(model, prompts, speculative_algorithm=None, cpu_compile=True)
    assert got == plain
    backend = core.runner.backend
    assert isinstance(backend, CpuBackend)
    assert backend.stage is None and backend.compiled_decode is None
    assert "latent KV cache" in core.resolved.graphs
    assert [getattr(r, "event", None) for r in caplog.records] == ["cpu_compile_unavailable"]


def test_default_aux_layers_of_a_small_target_are_refused_by_name() -> None:
    from specd.workers.spec.draft_config import DraftConfig, resolve_aux_layer_ids

    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=97, draft_vocab_size=97,
                      target_hidden_size=64)
    with pytest.raises(ValueError, match=r"\[2, 1, 0\] are not strictly ascending"):
        resolve_aux_layer_ids(cfg, 3)
    assert resolve_aux_layer_ids(cfg, 61) == (2, 30, 58)  # Kimi-K2's 61 layers


@pytest.mark.parametrize("mode", ["plain", "tree"])
def test_captured_forwards_replay_over_the_latent_cache(
        spec_case: tuple[Path, Path, list[list[int]], list[list[int]]], mode: str) -> None:
    """Graphs (their CPU stand-in) for decode and verify, padded to the capture sizes
    through the spare block of the latent cache: the output stays the plain engine's."""
    from specd.workers.runner.graph_backend import GraphBackend

    model, head, prompts, plain = spec_case
    options = ({"speculative_algorithm": None} if mode == "plain"
               else {"draft_model": str(head), **SPEC_MODES["tree"]})
    got, _, core = run(model, prompts, cuda_graphs=True, max_num_seqs=8, **options)
    assert got == plain
    backend = core.runner.backend
    assert isinstance(backend, GraphBackend)
    # Plain decode replays one-token graphs; every step of the tree mode verifies 8 tokens.
    assert {s.query_len for s in backend.graphs.replays} == ({1} if mode == "plain" else {8})
