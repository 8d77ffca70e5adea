"""The front's prompt stage: a prompt too long in bytes is refused without tokenizing,
long prompts are tokenized off the event loop, and their memory goes back to the OS."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from specd.daemon.config import DaemonConfig
from specd.daemon.memory import TRIM_AVAILABLE, resident_bytes
from specd.daemon.prompts import INLINE_TOKENIZE_CHARS, PromptEncoder, PromptText, RequestError
from specd.ipc import messages as m
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR

MAX_MODEL_LEN = 2048
SOURCE = Path(threading.__file__).read_text()  # real text: a few tokens per word


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(FIXTURE_DIR)


@pytest.fixture
def encoder(tokenizer: Tokenizer) -> Iterator[PromptEncoder]:
    encoder = PromptEncoder(tokenizer, DaemonConfig())
    yield encoder
    encoder.close()


def text_of(num_chars: int) -> str:
    return (SOURCE * (num_chars // len(SOURCE) + 1))[:num_chars]


def test_a_prompt_too_long_in_bytes_is_refused_without_tokenizing(
        encoder: PromptEncoder, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_tokenize(text: str) -> list[int]:
        raise AssertionError("tokenized a prompt the byte bound refuses")

    monkeypatch.setattr(tokenizer, "encode", must_not_tokenize)
    per_token = tokenizer.max_bytes_per_token
    assert per_token is not None
    limit = MAX_MODEL_LEN * per_token
    for prompt in ("x" * limit, "é" * (limit // 2), text_of(3_900_000)):
        with pytest.raises(RequestError) as refused:
            encoder.prepare(m.Generate(id=1, prompt=prompt), MAX_MODEL_LEN)
        assert refused.value.code == "prompt_too_long"
        assert f"{limit} bytes or more are refused" in str(refused.value)
    chat = m.Generate(id=1, messages=[m.ChatMessage("user", "x" * limit)])
    with pytest.raises(RequestError, match="without tokenizing"):
        encoder.prepare(chat, MAX_MODEL_LEN)


def test_short_prompts_are_tokenized_at_once_and_long_ones_left_for_the_worker(
        encoder: PromptEncoder, tokenizer: Tokenizer) -> None:
    short = text_of(INLINE_TOKENIZE_CHARS - 1)
    assert encoder.prepare(m.Generate(id=1, prompt=short), MAX_MODEL_LEN) == \
        tokenizer.encode(short)
    long = text_of(INLINE_TOKENIZE_CHARS)
    assert encoder.prepare(m.Generate(id=1, prompt=long), MAX_MODEL_LEN) == PromptText(long, True)
    ids = [5, 6, 7]
    assert encoder.prepare(m.Generate(id=1, prompt_token_ids=ids), MAX_MODEL_LEN) == ids


def test_the_event_loop_runs_while_a_long_prompt_is_tokenized(
        encoder: PromptEncoder, tokenizer: Tokenizer) -> None:
    text = text_of(300_000)

    async def run() -> tuple[list[int], int]:
        ticks = 0
        encoding = asyncio.create_task(encoder.encode_off_loop(text))
        while not encoding.done():
            await asyncio.sleep(0.001)
            ticks += 1
        return encoding.result(), ticks

    ids, ticks = asyncio.run(run())
    assert ids == tokenizer.encode(text)
    # Tokenizing 300 kB takes a few hundred ms; a tokenizer holding the GIL would let the
    # loop tick only at the interpreter's 5 ms switch interval, if at all.
    assert ticks >= 20


@pytest.mark.skipif(not TRIM_AVAILABLE, reason="malloc_trim is glibc's")
def test_memory_goes_back_after_a_long_prompt(encoder: PromptEncoder) -> None:
    text = text_of(1_000_000)

    async def run() -> int:
        await encoder.encode_off_loop(text_of(INLINE_TOKENIZE_CHARS))  # start the thread
        before = resident_bytes()
        ids = await encoder.encode_off_loop(text)
        assert len(ids) > 100_000
        del ids
        return resident_bytes() - before

    # The tokenizer's working memory for 1 MB of text is ~100 MB, kept by glibc unless
    # trimmed; what stays after the trim is caches (measured: 16-40 MB).
    assert asyncio.run(run()) < 64 * 2**20
