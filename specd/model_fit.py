"""Start-up checks that parts configured separately fit each other (no torch: the front runs
them before it starts the scheduler, the in-process API before it loads weights, and
`specctl plan` before it plans)."""

from __future__ import annotations

from pathlib import Path

from specd.tokenizer import TOKENIZER_FILES, Tokenizer


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
