"""Start-up checks that parts configured separately fit each other (no torch: the front runs
them before it starts the scheduler, the in-process API before it loads weights, and
`specctl plan` before it plans).

A tokenizer that can produce ids the embedding has no row for is refused
(`check_vocabulary`). One that fits but shows it was made for another model is named
(`tokenizer_misfits`: the evidence, for a WARNING record and a problem status shows): far
fewer tokens than the embedding has rows (a model pads a few rows, not half of them), or
special tokens whose ids the model's config does not declare.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from specd.tokenizer import TOKENIZER_FILES, Tokenizer

# A tokenizer with fewer tokens than this share of the embedding's rows belongs to another
# model: padding to a multiple of 64 or 128 leaves well over 99% of the rows reachable.
MIN_TOKENIZER_SHARE = 0.5


def check_vocabulary(tokenizer_vocab_size: int, model_vocab_size: int, model_path: Path) -> None:
    """ValueError naming both sizes when the tokenizer can produce a token id that the
    model's embedding has no row for. `tokenizer_vocab_size` counts the ids a tokenizer
    needs rows for (`Tokenizer.num_named_ids`: its ids up to the last BPE rank or named
    token, added tokens included).

    A model with more rows than the tokenizer has tokens is common (embeddings padded to a
    multiple of 64 or 128) and fits; the other way, a request would fail on the first such
    token, blamed on the client, or read another row's garbage. Unnamed reserved specials
    above the last named one (Kimi-K2's class makes two beyond its 163,840 rows) are no
    misfit: no text but their own `<|reserved_token_N|>` encodes to them, and the engine
    refuses a prompt with an id outside the model's vocabulary."""
    if tokenizer_vocab_size > model_vocab_size:
        raise ValueError(
            f"the tokenizer of {model_path} has {tokenizer_vocab_size} tokens but the "
            f"model's embedding has {model_vocab_size} rows (config.json vocab_size): ids "
            f"{model_vocab_size}..{tokenizer_vocab_size - 1} have no embedding; the "
            "tokenizer belongs to another model")


def check_tokenizer_fits(model_path: Path, model_vocab_size: int) -> bool:
    """`check_vocabulary` for the tokenizer in `model_path`, loaded as the engine loads it;
    False when the directory has no tokenizer (nothing to check: tiny test models, a
    config.json alone), True once it fits. ValueError (or OSError) as `Tokenizer.from_dir`
    and `check_vocabulary` raise."""
    if not any((model_path / name).is_file() for name in TOKENIZER_FILES):
        return False
    check_vocabulary(Tokenizer.from_dir(model_path).num_named_ids, model_vocab_size,
                     model_path)
    return True


def declared_special_ids(model_path: Path) -> dict[str, set[int]]:
    """The ids the model's config.json (its `text_config` too) and generation_config.json
    give its special tokens: {"eos_token": ..., "bos_token": ...}, an int or a list there;
    empty when unset (the files were read and checked by ModelConfig before: a missing or
    broken one reads as declaring nothing here)."""
    def read(name: str) -> dict[str, Any]:
        try:
            data = json.loads((model_path / name).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def ids(value: Any) -> set[int]:
        values = value if isinstance(value, list) else [value]
        return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}

    config, generation = read("config.json"), read("generation_config.json")
    text = config.get("text_config")  # a multimodal model's language model (Kimi-K2.5)
    language = text if isinstance(text, dict) else {}

    def declared(key: str) -> set[int]:
        return ids(config.get(key)) | ids(language.get(key))

    return {"eos_token": declared("eos_token_id") | ids(generation.get("eos_token_id")),
            "bos_token": declared("bos_token_id")}


def tokenizer_misfits(tokenizer: Tokenizer, model_vocab_size: int,
                      declared: Mapping[str, Collection[int]]) -> list[str]:
    """Evidence that `tokenizer`, though no larger than the embedding, belongs to another
    model (empty: none): fewer tokens than MIN_TOKENIZER_SHARE of the rows, a special token
    of tokenizer_config.json whose id the model's config does not declare (`declared`:
    `declared_special_ids`), or one that is no token of the tokenizer."""
    evidence = []
    num_tokens = tokenizer.num_named_ids
    if num_tokens < MIN_TOKENIZER_SHARE * model_vocab_size:
        evidence.append(f"the tokenizer has {num_tokens} tokens for the model's "
                        f"{model_vocab_size} embedding rows (config.json vocab_size): "
                        f"{1 - num_tokens / model_vocab_size:.0%} of the rows no text reaches")
    for name, model_ids in declared.items():
        text = tokenizer.special_tokens.get(name)
        if text is None or not model_ids:
            continue
        token_id = tokenizer.token_to_id(text)
        if token_id is None:
            evidence.append(f"tokenizer_config.json's {name} {text!r} is no token of the "
                            "tokenizer")
        elif token_id not in model_ids:
            evidence.append(f"tokenizer_config.json's {name} {text!r} is id {token_id} in the "
                            f"tokenizer, but the model's config gives {name}_id "
                            f"{sorted(model_ids)}")
    return evidence
