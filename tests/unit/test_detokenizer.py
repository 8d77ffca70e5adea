"""Incremental detokenization: same text as a full decode, never half a UTF-8 character,
stop strings cut exactly and never leaked into streamed text."""

from __future__ import annotations

import random

import pytest

from specd.daemon.detokenizer import IncrementalDetokenizer
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(FIXTURE_DIR)


def _stream(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...] = (),
            chunk: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.finish())
    return pieces, detok


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_full_decode(tokenizer: Tokenizer, chunk: int) -> None:
    text = "Héllo wörld — naïve café 日本語 🙂 done.\n  indented\tline"
    ids = tokenizer.encode(text)
    pieces, detok = _stream(tokenizer, ids, chunk=chunk)
    assert "".join(pieces) == tokenizer.decode(ids) == detok.text


def test_random_token_streams_match_full_decode_and_never_split_characters(
        tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        pieces, _ = _stream(tokenizer, ids)
        full = tokenizer.decode(ids)
        assert "".join(pieces) == full
        # No piece but the last ends with a replacement char unless the full text has one.
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in pieces)


def test_multibyte_character_is_held_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1, "the emoji spans several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🙂"


def test_stop_string_cuts_exactly_and_never_streams_its_prefix(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("alpha beta STOP gamma")
    pieces, detok = _stream(tokenizer, ids, stop=("STOP",))
    assert "".join(pieces) == "alpha beta "
    assert detok.text == "alpha beta "
    assert detok.stop_string == "STOP"
    assert all("S" not in p for p in pieces)
    assert detok.add(tokenizer.encode(" more")) == ""


def test_earliest_stop_string_wins_and_unmatched_prefix_is_released(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three")
    pieces, detok = _stream(tokenizer, ids, stop=("three", "two"))
    assert "".join(pieces) == "one " and detok.stop_string == "two"
    pieces, detok = _stream(tokenizer, tokenizer.encode("ab STO end"), stop=("STOP",))
    assert "".join(pieces) == "ab STO end" and detok.stop_string is None


def test_finish_flushes_an_incomplete_character_as_a_replacement(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🙂")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids) == "ok "
    assert detok.finish() == tokenizer.decode(ids)[len("ok "):]
    assert detok.text == tokenizer.decode(ids)
