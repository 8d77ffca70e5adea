"""How many UTF-8 bytes of prompt text one token can stand for, read from a tokenizer.json.

The front refuses, without tokenizing it, a prompt of at least `max_model_len` times this
many bytes: such a prompt cannot encode to fewer than `max_model_len` tokens, and
tokenizing megabytes only to learn that costs seconds of CPU and hundreds of MB.

Why the bound holds: when no step of the tokenizer drops text, the strings of a prompt's
tokens concatenate to its normalized (and pre-tokenized) text, so

    tokens >= normalized bytes / longest token in bytes >= bytes / (longest * shrink)

where `shrink` is the most a normalizer can shorten UTF-8 text (Unicode normalization and
lowercasing turn a 4-byte character into a 1-byte one at worst: U+1D400 under NFKC).
Token strings over-count the bytes they stand for (byte-level `Ġ` is 2 bytes for 1,
`▁` 3 for 1, `<0x41>` 6 for 1), which only loosens the bound. Pipelines that can drop text
(strip, whitespace splitting, removed split matches, fused or missing unknown tokens,
added tokens that swallow whitespace) have no such bound: `bytes_per_token_bound` returns
None with the reason, and such prompts are tokenized whatever their length.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

# NFKC maps U+1D400 (4 bytes) to "A" (1 byte); no normalization form or case mapping
# shortens a character's UTF-8 more.
UNICODE_SHRINK = 4.0
# An unknown character becomes one unknown token: at most one 4-byte character per token.
MAX_CHAR_BYTES = 4

_UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
_EXPANDING_NORMALIZERS = frozenset({"Prepend", "ByteLevel"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation",
                                     "Split", "UnicodeScripts"})
_BYTE_LEVEL_ALPHABET_SIZE = 256


class Unbounded(Exception):
    """A tokenizer step that may drop text: no byte bound per token."""


def bytes_per_token_bound(spec: Mapping[str, Any]) -> tuple[int | None, str]:
    """(bound, how it was found) for a parsed tokenizer.json; (None, why) when unbounded."""
    try:
        shrink = _normalizer_shrink(spec.get("normalizer"))
        has_byte_level = _check_pre_tokenizer(spec.get("pre_tokenizer"))
        _check_model(spec.get("model") or {}, has_byte_level)
        _check_added_tokens(spec.get("added_tokens") or [])
    except Unbounded as exc:
        return None, str(exc)
    longest = max(_token_strings(spec), key=lambda t: len(t.encode()), default="")
    longest_bytes = max(len(longest.encode()), MAX_CHAR_BYTES)
    bound = math.ceil(longest_bytes * shrink)
    return bound, (f"longest token {longest_bytes} bytes x normalizer shrink {shrink:g}")


def _normalizer_shrink(node: Mapping[str, Any] | None) -> float:
    if node is None:
        return 1.0
    kind = node.get("type")
    if kind == "Sequence":
        return math.prod(_normalizer_shrink(n) for n in node.get("normalizers", []))
    if kind in _UNICODE_NORMALIZERS:
        return UNICODE_SHRINK
    if kind in _EXPANDING_NORMALIZERS:
        return 1.0
    if kind == "Replace":
        pattern = node.get("pattern") or {}
        content = str(node.get("content", ""))
        if "String" not in pattern or not content:
            raise Unbounded(f"normalizer Replace {pattern} -> {content!r} may drop text")
        return max(1.0, len(str(pattern["String"]).encode()) / len(content.encode()))
    raise Unbounded(f"normalizer {kind} may drop text")


def _check_pre_tokenizer(node: Mapping[str, Any] | None) -> bool:
    """Raises Unbounded for a pre-tokenizer that drops text; True when it is byte-level."""
    if node is None:
        return False
    kind = node.get("type")
    if kind == "Sequence":
        return any([_check_pre_tokenizer(n) for n in node.get("pretokenizers", [])])
    if kind not in _KEEPING_PRE_TOKENIZERS or node.get("behavior") == "Removed":
        raise Unbounded(f"pre-tokenizer {kind} (behavior {node.get('behavior')}) may drop text")
    return kind == "ByteLevel"


def _check_model(model: Mapping[str, Any], has_byte_level: bool) -> None:
    kind = model.get("type")
    if kind != "BPE":
        raise Unbounded(f"model {kind}: only BPE is analysed")
    if model.get("byte_fallback"):
        return  # every character has tokens: its bytes
    if model.get("unk_token") is not None:
        if model.get("fuse_unk"):
            raise Unbounded("BPE fuses unknown characters into one token")
        return
    vocab = model.get("vocab") or {}
    if not has_byte_level or sum(len(t) == 1 for t in vocab) < _BYTE_LEVEL_ALPHABET_SIZE:
        raise Unbounded("BPE without unk_token or byte fallback drops unknown characters")


def _check_added_tokens(added: Iterable[Mapping[str, Any]]) -> None:
    for token in added:
        if token.get("lstrip") or token.get("rstrip"):
            raise Unbounded(f"added token {token.get('content')!r} swallows whitespace")


def _token_strings(spec: Mapping[str, Any]) -> list[str]:
    vocab = (spec.get("model") or {}).get("vocab") or {}
    added = [str(t.get("content", "")) for t in spec.get("added_tokens") or []]
    return [*vocab, *added]
