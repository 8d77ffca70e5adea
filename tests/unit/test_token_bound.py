"""The byte bound per token: a prompt of max_model_len x bound bytes cannot encode to fewer
than max_model_len tokens, so the front may refuse it without tokenizing; tokenizers that
can drop text have no bound."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from specd.token_bound import UNICODE_SHRINK, bytes_per_token_bound
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR

BYTE_ALPHABET = {chr(0x100 + i): i for i in range(256)}  # stands in for byte-level's map


def spec(normalizer: Any = None, pre_tokenizer: Any = None, **model: Any) -> dict[str, Any]:
    """A small BPE tokenizer.json: the 256 single-character tokens plus 'abcdef'."""
    vocab = {**BYTE_ALPHABET, "abcdef": 256}
    return {"normalizer": normalizer, "added_tokens": [],
            "pre_tokenizer": pre_tokenizer or {"type": "ByteLevel"},
            "model": {"type": "BPE", "vocab": vocab, **model}}


def test_fixture_bound_is_its_longest_token_and_holds_for_real_text() -> None:
    tokenizer = Tokenizer.from_dir(FIXTURE_DIR)
    vocab = json.loads((FIXTURE_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    assert tokenizer.max_bytes_per_token == max(len(t.encode()) for t in vocab)
    rng = random.Random(0)
    source = (FIXTURE_DIR / "heldout_prompts.jsonl").read_text()
    pieces = [source, " " * 5000, "-" * 5000, "é日本😀" * 500, "\x00\x01" * 500]
    for _ in range(20):
        start = rng.randrange(len(source))
        pieces.append(source[start:start + rng.randrange(1, 4000)])
    for text in pieces:
        num_bytes = len(text.encode())
        assert len(tokenizer.encode(text)) * tokenizer.max_bytes_per_token >= num_bytes


def test_a_unicode_normalizer_multiplies_the_bound() -> None:
    bound, _ = bytes_per_token_bound(spec({"type": "NFKC"}))
    assert bound == 6 * UNICODE_SHRINK  # 'abcdef' is the longest token


def test_a_shortening_replace_multiplies_the_bound_by_its_ratio() -> None:
    replace = {"type": "Replace", "pattern": {"String": "    "}, "content": "\t"}
    bound, _ = bytes_per_token_bound(spec({"type": "Sequence", "normalizers": [replace]}))
    assert bound == 6 * 4


@pytest.mark.parametrize("tokenizer_json, reason", [
    (spec({"type": "Strip", "strip_left": True, "strip_right": True}), "normalizer Strip"),
    (spec({"type": "BertNormalizer", "clean_text": True}), "normalizer BertNormalizer"),
    (spec({"type": "Replace", "pattern": {"String": " "}, "content": ""}), "may drop text"),
    (spec(pre_tokenizer={"type": "WhitespaceSplit"}), "pre-tokenizer WhitespaceSplit"),
    (spec(pre_tokenizer={"type": "Split", "behavior": "Removed"}), "behavior Removed"),
    (spec(unk_token="<unk>", fuse_unk=True), "fuses unknown"),
    (spec(pre_tokenizer={"type": "Metaspace"}), "drops unknown characters"),
    ({**spec(), "model": {"type": "Unigram", "vocab": [["a", 0.0]]}}, "model Unigram"),
    ({**spec(), "added_tokens": [{"content": "<mask>", "lstrip": True}]}, "swallows"),
])
def test_tokenizers_that_can_drop_text_have_no_bound(tokenizer_json: dict[str, Any],
                                                       reason: str) -> None:
    bound, why = bytes_per_token_bound(tokenizer_json)
    assert bound is None and reason in why


def test_byte_fallback_or_an_unknown_token_keeps_a_bound_without_byte_level() -> None:
    metaspace = {"type": "Metaspace"}
    assert bytes_per_token_bound(spec(pre_tokenizer=metaspace, byte_fallback=True))[0] == 6
    # An unknown character is one token of up to 4 bytes; '<unk>' is 5 bytes of string.
    short_vocab = {**spec(pre_tokenizer=metaspace, unk_token="<unk>")}
    short_vocab["model"]["vocab"] = {"a": 0, "<unk>": 1}
    assert bytes_per_token_bound(short_vocab)[0] == 5
