"""Held-out prompts as token ids, cut to mixed lengths, for the integration tests that
drive the engine step by step (never the fixture's training text)."""

from __future__ import annotations

import json

from specd.workers.config import FIXTURE_DIR


def heldout_prompt_ids(count: int, first_len: int, len_step: int) -> list[list[int]]:
    """The first `count` held-out prompts, prompt i cut to first_len + len_step * i tokens."""
    from specd.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(FIXTURE_DIR)
    lines = (FIXTURE_DIR / "heldout_prompts.jsonl").read_text().splitlines()
    return [tok.encode(json.loads(line)["prompt"])[: first_len + len_step * i]
            for i, line in enumerate(lines[:count])]
