"""A GGUF file's tokenizer metadata as `tokenizer.json` and `tokenizer_config.json` (no torch).

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), the
merges, each token's type and the special ids as metadata, and names the split rule by
`tokenizer.ggml.pre`. Only byte-level BPE (`tokenizer.ggml.model` = "gpt2": GPT-2, SmolLM,
Llama 3, Qwen2) is imported; SentencePiece ("llama") and the others are refused by name.

* Vocabulary: token i has id i. A byte-level token is spelled in GPT-2's byte alphabet; one
  that is not (a control token such as `<|im_start|>`) is kept as it is written.
* Split rule (`tokenizer.ggml.pre`), as llama.cpp's `llama-vocab.cpp` splits: "gpt2" (and
  "default") the GPT-2 regex; "smollm" (and the StarCoder family) every digit on its own,
  then the GPT-2 regex; the Llama-3 and Qwen2 families their own regexes. An unknown name is
  refused: another split gives ids the model was not trained on.
* Token types: CONTROL (3) tokens are special added tokens (whole in any text, skipped when
  decoding with skip_special_tokens); USER_DEFINED (4) tokens are added tokens that are not
  special. No post-processor: `add_bos_token` / `add_eos_token` go to tokenizer_config.json,
  which specd reads for a tokenizer.json without one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's pre-tokenizer names -> how the text is split before byte-level BPE.
_GPT2 = "gpt2"
_DIGITS_THEN_GPT2 = "digits"
SPLITS: dict[str, str] = {
    "default": _GPT2, "gpt2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


def build_tokenizer(metadata: Mapping[str, Any]) -> tuple[str, dict[str, Any], dict[str, int]]:
    """(tokenizer.json text, tokenizer_config.json, special ids by config name) for a GGUF
    file's metadata. ValueError naming the key for a tokenizer this import does not build."""
    kind = str(metadata.get("tokenizer.ggml.model", ""))
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model {kind!r} is not imported; only byte-level "
                         "BPE ('gpt2') is")
    tokens = [str(t) for t in _required(metadata, "tokenizer.ggml.tokens")]
    merges = [str(m) for m in _required(metadata, "tokenizer.ggml.merges")]
    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in SPLITS:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} names a split rule the import does "
                         f"not know; known: {sorted(SPLITS)}")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens holds a token twice")
    pairs = [_merge_pair(m) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(SPLITS[pre])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(t, special=ty == TOKEN_TYPE_CONTROL, normalized=False)
                          for t, ty in zip(tokens, types, strict=True)
                          if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)])
    special_ids = _special_ids(metadata, len(tokens))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for name, token_id in special_ids.items():
        config[name.removesuffix("_id")] = tokens[token_id]
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = str(metadata["tokenizer.chat_template"])
    return tokenizer.to_str(), config, special_ids


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ValueError(f"GGUF tokenizer.ggml.merges entry {merge!r} is not 'left right'")
    return left, right


def _pre_tokenizer(split: str) -> pre_tokenizers.PreTokenizer:
    # The GPT-2 regex is ByteLevel's own; a Split ahead of it replaces it.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=split in (_GPT2, _DIGITS_THEN_GPT2))
    if split == _GPT2:
        return byte_level
    if split == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    byte_level])


def _special_ids(metadata: Mapping[str, Any], num_tokens: int) -> dict[str, int]:
    """bos/eos/unk/pad ids the file names, as config.json names them."""
    out: dict[str, int] = {}
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                      ("unknown", "unk_token_id"), ("padding", "pad_token_id")):
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if value is None:
            continue
        if not 0 <= int(value) < num_tokens:
            raise ValueError(f"GGUF tokenizer.ggml.{key}_token_id {int(value)} is not a token "
                             f"id (the vocabulary has {num_tokens})")
        out[name] = int(value)
    return out


def _required(metadata: Mapping[str, Any], key: str) -> Sequence[Any]:
    if key not in metadata:
        raise ValueError(f"GGUF file lacks {key}")
    value = metadata[key]
    return list(value)


def tokenizer_config_text(config: Mapping[str, Any]) -> str:
    return json.dumps(config, indent=2, ensure_ascii=False) + "\n"
