"""A `tiktoken.model` tokenizer (Kimi-K2 ships one), loaded without running the model's own
Python code.

Kimi's `tokenization_kimi.py` builds a `tiktoken.Encoding`; this module builds the same
one from data (that file included, parsed, never run), so nothing from the model directory
is executed:

* `tiktoken.model`: one token a line, its bytes in base64, a space, its rank, which is its
  id. The ranks must be 0..n-1 and include every single byte (byte-level BPE: any text
  encodes). Read here rather than with `tiktoken.load`, which copies files into a cache.
* The tokenizer class `auto_map` names, when specd knows it (Kimi's
  `tokenization_kimi.TikTokenTokenizer`), is read from the model's own file as data
  (`tokenizer_code.py`): the size of its special block, its split pattern, whether it hands
  `added_tokens_decoder` on to transformers. A class specd does not know fails to load
  (guessing its rules would give ids the model was not trained on), unless
  `tokenizer_config.json` sets `pat_str`; then, as without any tokenizer class, the block
  is `DEFAULT_NUM_SPECIAL_IDS` long.
* Special tokens: the block above the n ranks (Kimi-K2's class: 258 ids, K2.5's: 256) is
  named by `tokenizer_config.json`'s `added_tokens_decoder`, the rest
  `<|reserved_token_{id}|>`. A named id outside the block: with no tokenizer class, one above
  the block extends it (transformers' converter does the same); Kimi-K2's class ignores such
  names, and so does specd; Kimi-K2.5's hands them on to transformers, which then encodes
  them to ids the class cannot decode, so specd refuses them. An entry with
  `"special": false` is kept by `decode(skip_special_tokens=True)`; every other id of the
  block is skipped. `num_named_ids`: one more than the highest id that is a rank or a named
  token (the embedding rows the tokenizer needs: unnamed reserved ids above it come only
  from their own text in a prompt, which the engine refuses when the model has no row).
* The split pattern: `pat_str` from `tokenizer_config.json` when it has one (specd reads
  that key; no publisher writes it today); else the tokenizer class's `pat_str`; else, with
  no tokenizer class at all, the pattern transformers uses for a bare `tiktoken.model`
  (`DEFAULT_PATTERN`).
* Encoding: special-token text in the prompt encodes as that special token (Kimi's
  `allowed_special="all"`; a rendered chat template holds them). The text is cut, as
  Kimi's code cuts it, into chunks of 400,000 characters and runs of at most 25,000
  whitespace or non-whitespace characters: tiktoken's regex engine fails on longer ones.
* Decoding: tokens are bytes, and a token may end inside a UTF-8 character; `decode`
  gives U+FFFD for an incomplete or invalid sequence (the detokenizer holds a trailing one
  back until the character completes). Ids without a token decode to nothing, as in
  `tokenizers`.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tiktoken

from specd.tokenizer_code import KNOWN_CLASSES, TokenizerCode, auto_map_class, read_tokenizer_code

TIKTOKEN_FILE = "tiktoken.model"
# The block without a tokenizer class specd reads: Kimi-K2's rule (256 reserved + 2).
DEFAULT_NUM_SPECIAL_IDS = 256 + 2
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
MAX_CHAR_BYTES = 4

# tokenization_kimi.py, TikTokenTokenizer.pat_str: Han runs, two cased-letter rules that
# exclude Han (with an optional English contraction), up to 3 digits, punctuation runs,
# newline runs, and two whitespace rules.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# transformers' TikTokenConverter default (Llama-3's and cl100k's pattern).
DEFAULT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                   r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Every character matches one of these patterns' alternatives, so no text is skipped and
# a token stands for at most its own bytes (the byte bound below holds).
_COVERING_PATTERNS = frozenset({KIMI_PATTERN, DEFAULT_PATTERN})
# A run longer than MAX_RUN_CHARS, found from its first character (the look-behind keeps
# the search linear: no match is tried from inside a run).
_LONG_RUN = re.compile(rf"(?<!\s)\s{{{MAX_RUN_CHARS + 1},}}|(?<!\S)\S{{{MAX_RUN_CHARS + 1},}}")


@dataclass(frozen=True)
class SpecialBlock:
    """The special tokens above the ranks: name -> id, the ids `decode` skips, and one more
    than the highest named id (0 when none is named)."""

    ids: Mapping[str, int]
    skipped: frozenset[int]
    named_end: int


class TiktokenBackend:
    """Encode and decode through a `tiktoken.Encoding`; immutable after construction.

    `max_bytes_per_token` / `bound_reason`: as `Tokenizer`'s (None when the pattern is not
    one known to match every character). `num_named_ids`: module docstring.
    """

    def __init__(self, encoding: tiktoken.Encoding, block: SpecialBlock, num_ranks: int,
                 max_bytes_per_token: int | None, bound_reason: str) -> None:
        self._encoding = encoding
        self._special_ids = dict(block.ids)
        self._skipped_ids = block.skipped
        self.vocab_size = encoding.n_vocab
        self.num_named_ids = max(num_ranks, block.named_end)
        self.max_bytes_per_token = max_bytes_per_token
        self.bound_reason = bound_reason

    @classmethod
    def from_dir(cls, root: Path, config: Mapping[str, Any],
                 code: TokenizerCode | None) -> TiktokenBackend:
        """Load `root/tiktoken.model`; `config` is the model's tokenizer_config.json, `code`
        its tokenizer class (`class_code`). Raises ValueError naming the file and what is
        wrong with it."""
        path = root / TIKTOKEN_FILE
        ranks = read_ranks(path)
        block = special_tokens(len(ranks), config, code)
        pattern = split_pattern(config, code)
        try:
            encoding = tiktoken.Encoding(name=str(path), pat_str=pattern,
                                         mergeable_ranks=ranks, special_tokens=dict(block.ids))
        except ValueError as exc:
            raise ValueError(f"{path}: tiktoken refused it (pattern {pattern!r}): {exc}") from exc
        if pattern not in _COVERING_PATTERNS:
            return cls(encoding, block, len(ranks), None,
                       "a split pattern that may skip characters")
        longest = max([*map(len, ranks), *(len(s.encode()) for s in block.ids), MAX_CHAR_BYTES])
        return cls(encoding, block, len(ranks), longest, f"longest token {longest} bytes")

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special-token text in it encodes as the special token."""
        ids: list[int] = []
        for piece in _pieces(text):
            ids.extend(self._encoding.encode(piece, allowed_special="all"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        kept = [i for i in ids if 0 <= i < self.vocab_size
                and not (skip_special_tokens and i in self._skipped_ids)]
        return self._encoding.decode_bytes(kept).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        """The id of a special token by name (None for other strings)."""
        return self._special_ids.get(token)


def read_ranks(path: Path) -> dict[bytes, int]:
    """The ranks of a tiktoken BPE file; ValueError naming the file and line when the file
    is malformed, the ranks are not 0..n-1, or a single byte has no token."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it: {exc}") from exc
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as exc:
            raise ValueError(f"{path}:{number}: expected 'base64-token rank': {exc}") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once, one per "
                         "distinct token")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: no token for {len(missing)} single bytes (first: "
                         f"{missing[0]:#04x}); a byte-level BPE needs all 256")
    return ranks


def class_code(root: Path, config: Mapping[str, Any]) -> TokenizerCode | None:
    """The tokenizer class `auto_map` names, read from its file in `root`; None when there
    is none, or an unknown one with a `pat_str` given. ValueError for an unknown class
    without `pat_str`, and for a known one whose file is missing or not as specd knows it."""
    class_ref = auto_map_class(config)
    if class_ref is None:
        return None
    if class_ref not in KNOWN_CLASSES:
        if isinstance(config.get("pat_str"), str):
            return None
        raise ValueError(f"tokenizer_config.json: the tokenizer is {class_ref} (auto_map), "
                         "whose code specd does not know; put its split pattern in "
                         f"tokenizer_config.json as \"pat_str\" (known: {list(KNOWN_CLASSES)})")
    return read_tokenizer_code(root, class_ref)


def special_tokens(num_base_tokens: int, config: Mapping[str, Any],
                   code: TokenizerCode | None) -> SpecialBlock:
    """The special block above `num_base_tokens` ranks, by `code`'s rule (module docstring)."""
    named = _added_tokens(config)
    size = code.num_special_ids if code is not None else DEFAULT_NUM_SPECIAL_IDS
    end = num_base_tokens + size
    outside = sorted(i for i in named if not num_base_tokens <= i < end)
    if code is None:
        end = max(end, max(named, default=0) + 1)
    elif outside and code.registers_added_tokens:
        raise ValueError(
            f"tokenizer_config.json: added_tokens_decoder names ids {outside[:5]} outside "
            f"the special block {num_base_tokens}..{end - 1} of {code.path.name}, which "
            "hands them on to transformers: it would encode them to ids its tiktoken "
            "encoding cannot decode")
    specials: dict[str, int] = {}
    skipped = set()
    named_end = 0
    for token_id in range(num_base_tokens, end):
        name, is_special = named.get(token_id, (f"<|reserved_token_{token_id}|>", True))
        if name in specials:
            raise ValueError(f"tokenizer_config.json: added token {name!r} has two ids "
                             f"({specials[name]} and {token_id})")
        specials[name] = token_id
        if is_special:
            skipped.add(token_id)
        if token_id in named:
            named_end = token_id + 1
    return SpecialBlock(specials, frozenset(skipped), named_end)


def _added_tokens(config: Mapping[str, Any]) -> dict[int, tuple[str, bool]]:
    """`added_tokens_decoder` as id -> (content, special); entries are AddedToken dicts
    (or plain strings, taken as special)."""
    out: dict[int, tuple[str, bool]] = {}
    for key, value in (config.get("added_tokens_decoder") or {}).items():
        if not str(key).isdigit():
            raise ValueError(f"tokenizer_config.json: added_tokens_decoder key {key!r} is not "
                             "a token id")
        if isinstance(value, Mapping) and isinstance(value.get("content"), str):
            out[int(key)] = (value["content"], bool(value.get("special", True)))
        elif isinstance(value, str):
            out[int(key)] = (value, True)
        else:
            raise ValueError(f"tokenizer_config.json: added_tokens_decoder[{key!r}] has no "
                             "content")
    return out


def split_pattern(config: Mapping[str, Any], code: TokenizerCode | None) -> str:
    """The pattern that splits text before BPE (see the module docstring for the order)."""
    if isinstance(config.get("pat_str"), str):
        return str(config["pat_str"])
    return code.pattern if code is not None else DEFAULT_PATTERN


def _pieces(text: str) -> Iterator[str]:
    """`text` in chunks of MAX_ENCODE_CHARS, each cut every MAX_RUN_CHARS characters into
    a longer run of whitespace or non-whitespace (the cuts Kimi's encode makes)."""
    for start in range(0, max(len(text), 1), MAX_ENCODE_CHARS):
        chunk = text[start:start + MAX_ENCODE_CHARS]
        cut = 0
        for run in _LONG_RUN.finditer(chunk):
            for at in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield chunk[cut:at]
                cut = at
        yield chunk[cut:]
