"""Start-up checks that parts configured separately fit each other (no torch: the front runs
them before it starts the scheduler, the in-process API before it loads weights)."""

from __future__ import annotations

from pathlib import Path


def check_vocabulary(tokenizer_vocab_size: int, model_vocab_size: int, model_path: Path) -> None:
    """ValueError naming both sizes when the tokenizer can produce a token id (any id below
    its vocabulary size, added tokens included) that the model's embedding has no row for.

    A model with more rows than the tokenizer has tokens is common (embeddings padded to a
    multiple of 64 or 128) and fits; the other way, a request would fail on the first such
    token, blamed on the client, or read another row's garbage."""
    if tokenizer_vocab_size > model_vocab_size:
        raise ValueError(
            f"the tokenizer of {model_path} has {tokenizer_vocab_size} tokens but the "
            f"model's embedding has {model_vocab_size} rows (config.json vocab_size): ids "
            f"{model_vocab_size}..{tokenizer_vocab_size - 1} have no embedding; the "
            "tokenizer belongs to another model")
