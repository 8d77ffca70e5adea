"""The model's vocabulary as the grammar library sees it: every token id's bytes, which ids are
special, and which end a sequence (llguidance's `LLTokenizer`).

The scheduler process reads the tokenizer files itself (the front owns the `Tokenizer` that
encodes prompts, and stays torch- and grammar-free): `tokenizer.json` as llguidance reads it
(the `tokenizers` library's format: byte-level and byte-fallback vocabularies), or
`tiktoken.model` read by specd's own tiktoken reader (specd/tiktoken_tokenizer.py: the same
ranks, special block and split pattern the front encodes with). `tokenizer.json` wins when a
model has both, as in the front. Special tokens (Kimi's `<|tool_call_begin|>`, `<|im_end|>`)
are matched only by a grammar that names them (`<|tool_call_begin|>` in Lark), never by
text that spells them.

The vocabulary has the model's size (its embedding rows, so one mask bit per logit); ids past
the tokenizer's are never allowed. Its end-of-sequence ids are the model's: a grammar allows
them exactly where its output is complete.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llguidance

from specd.tiktoken_tokenizer import (
    TIKTOKEN_FILE,
    class_code,
    read_ranks,
    special_tokens,
    split_pattern,
)
from specd.tokenizer import TOKENIZER_FILES

HF_TOKENIZER_FILE = TOKENIZER_FILES[0]


def tokenizer_file(model_dir: Path) -> Path | None:
    """The tokenizer file a vocabulary is read from (the first of TOKENIZER_FILES the
    directory has), or None."""
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            return model_dir / name
    return None


def load_vocabulary(model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int]
                    ) -> llguidance.LLTokenizer:
    """The vocabulary of the model in `model_dir` with `vocab_size` ids, `eos_token_ids`
    ending a sequence. ValueError naming the file when there is no tokenizer or it does not
    load."""
    path = tokenizer_file(model_dir)
    if path is None:
        raise ValueError(f"{model_dir}: no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    eos = list(eos_token_ids) or None
    try:
        if path.name == HF_TOKENIZER_FILE:
            return llguidance.LLTokenizer(path.read_text(encoding="utf-8"), n_vocab=vocab_size,
                                          eos_token=eos)
        return _tiktoken_vocabulary(model_dir, vocab_size, eos)
    except (ValueError, RuntimeError, OSError) as exc:  # llguidance raises ValueError
        raise ValueError(f"{path}: the grammar library cannot read this tokenizer: "
                         f"{exc}") from exc


def _tiktoken_vocabulary(model_dir: Path, vocab_size: int, eos: list[int] | None
                         ) -> llguidance.LLTokenizer:
    """A `tiktoken.model` vocabulary with the special block specd's reader gives it."""
    config = _tokenizer_config(model_dir)
    code = class_code(model_dir, config)
    ranks = read_ranks(model_dir / TIKTOKEN_FILE)
    block = special_tokens(len(ranks), config, code)
    # from_tiktoken is in llguidance's extension module but not in its type stub.
    tokenizer: llguidance.LLTokenizer = llguidance.LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]
        encoder=ranks, special_tokens=dict(block.ids), pattern=split_pattern(config, code),
        eos_token=eos, n_vocab=vocab_size)
    return tokenizer


def _tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
