"""A sliding-window model end to end: refused by name past its window, exact within it.

A small random-weight Mistral with a 24-token window, written by transformers. specd
attends over the whole sequence, so (1) by default start-up refuses it, naming the
window; (2) with `max_model_len` at the window its greedy output equals transformers'
(float32, eager attention, which applies the window); (3) the refusal is needed: past the
window transformers' logits with the window differ from those of full attention over the
same weights, and full attention is what specd computes. The daemon refuses such a model
by name before it starts the scheduler.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import specd
from specd.exit_codes import EXIT_CONFIG
from specd.workers.config import FIXTURE_DIR
from tests.integration.daemon_harness import Daemon

transformers = pytest.importorskip("transformers")

WINDOW = 24


def random_prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 297, (n,), generator=gen).tolist() for n in lengths]


# Prompt lengths inside the window, across the block size (16) and the chunk budget below.
PROMPTS = random_prompts([8, 13, 20])


def make_mistral(tmp: Path, window: int | None) -> Path:
    cfg = transformers.MistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=window, eos_token_id=299, bos_token_id=298)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharp logits: greedy ties are implausible
    out = tmp / f"mistral-{window}"
    model.save_pretrained(out, safe_serialization=True)
    return out


def hf_model(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation, one forward over the whole sequence per token
    (no cache, so the window is applied by the attention mask alone)."""
    model = hf_model(model_dir)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def specd_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: list[int],
                 **options: object) -> list[list[int]]:
    engine = specd.Engine(str(model_dir), dtype="float32", speculative_algorithm=None,
                          **options)
    return [engine.generate([p], specd.SamplingParams(max_tokens=n, ignore_eos=True))[0]
            .token_ids for p, n in zip(prompts, new_tokens, strict=True)]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mistral(tmp_path_factory.mktemp("sliding"), WINDOW)


def test_the_window_is_in_the_written_config(windowed: Path) -> None:
    assert json.loads((windowed / "config.json").read_text())["sliding_window"] == WINDOW


def test_start_up_refuses_the_default_length_naming_the_window(windowed: Path) -> None:
    with pytest.raises(ValueError, match=f"sliding_window {WINDOW} .* maximum length 128"):
        specd.Engine(str(windowed), dtype="float32", speculative_algorithm=None)


def test_up_to_the_window_specd_matches_transformers(windowed: Path) -> None:
    # Each sequence ends at the window: its last token is predicted at position WINDOW - 1.
    new_tokens = [WINDOW - len(p) for p in PROMPTS]
    expected = [hf_greedy(windowed, p, n) for p, n in zip(PROMPTS, new_tokens, strict=True)]
    assert specd_greedy(windowed, PROMPTS, new_tokens, max_model_len=WINDOW,
                        max_num_batched_tokens=16) == expected


def test_past_the_window_full_attention_differs_from_the_model(windowed: Path,
                                                               tmp_path: Path) -> None:
    full = make_mistral(tmp_path, None)  # the same weights (same seed), no window
    ids = torch.tensor(random_prompts([3 * WINDOW]))
    with torch.no_grad():
        windowed_logits = hf_model(windowed)(input_ids=ids).logits[0]
        full_logits = hf_model(full)(input_ids=ids).logits[0]
    # Positions below the window see every earlier token either way; past it they do not.
    torch.testing.assert_close(windowed_logits[:WINDOW], full_logits[:WINDOW])
    assert (windowed_logits[WINDOW:] - full_logits[WINDOW:]).abs().amax(-1).min() > 1e-3
    # specd computes full attention: past the window it follows the windowless model.
    prompt, new_tokens = PROMPTS[1], 2 * WINDOW
    assert specd_greedy(full, [prompt], [new_tokens]) == [hf_greedy(full, prompt, new_tokens)]


def test_the_daemon_refuses_it_before_starting_the_scheduler(tmp_path: Path) -> None:
    # The fixture as a Mistral with a 64-token window (2048 positions): the front names the
    # window on the first screen and exits 78 before any weight is read.
    model = tmp_path / "windowed-fixture"
    model.mkdir()
    for path in FIXTURE_DIR.iterdir():
        if path.is_file() and path.name != "config.json":
            (model / path.name).symlink_to(path)
    config = json.loads((FIXTURE_DIR / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    (model / "config.json").write_text(json.dumps(config))
    daemon = Daemon(tmp_path, "--model", str(model), "--speculative-algorithm", "none")
    try:
        assert daemon.wait(60) == EXIT_CONFIG
        (record,) = daemon.events("config_error")
        assert "sliding_window 64" in record["msg"] and "--max-model-len 64" in record["msg"]
        assert not daemon.events("scheduler_spawned")
    finally:
        daemon.stop()
