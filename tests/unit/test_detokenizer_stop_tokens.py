"""A stop string cuts the token ids as well as the text: the kept ids end with the token
that completed the first match, whatever the chunking (a speculative step gives several
tokens at once). Oracle: the shortest prefix of the ids whose full decode holds a stop
string, found by brute force."""

from __future__ import annotations

import random

import pytest

from specd.daemon.detokenizer import IncrementalDetokenizer
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(FIXTURE_DIR)


def shortest_prefix_with_a_stop(tokenizer: Tokenizer, ids: list[int],
                                stop: tuple[str, ...]) -> int | None:
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        if any(s in text for s in stop):
            return k
    return None


def feed(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...],
         chunk: int) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, stop)
    for i in range(0, len(ids), chunk):
        detok.add(ids[i:i + chunk])
    detok.finish()
    return detok


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_kept_ids_end_with_the_token_that_completed_the_stop_string(
        tokenizer: Tokenizer, chunk: int) -> None:
    ids = tokenizer.encode("alpha beta STOP gamma delta epsilon", add_special_tokens=False)
    detok = feed(tokenizer, ids, ("STOP",), chunk)
    k = shortest_prefix_with_a_stop(tokenizer, ids, ("STOP",))
    assert k is not None and k < len(ids)
    assert detok.token_ids == ids[:k]
    assert detok.text == "alpha beta " and detok.stop_string == "STOP"


def test_random_streams_cut_ids_where_brute_force_finds_the_first_match(
        tokenizer: Tokenizer) -> None:
    rng = random.Random(1)
    num_cut = 0
    for _ in range(40):
        ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randrange(4, 40))]
        full = tokenizer.decode(ids)
        start = rng.randrange(0, max(1, len(full) - 3))
        stop = full[start:start + rng.randrange(1, 4)]
        if not stop or "\ufffd" in stop:
            continue
        stops = (stop, "never-in-this-text")
        k = shortest_prefix_with_a_stop(tokenizer, ids, stops)
        assert k is not None
        for chunk in (1, 3, len(ids)):
            detok = feed(tokenizer, ids, stops, chunk)
            assert detok.token_ids == ids[:k], (ids, stop, chunk)
            assert detok.text == full[:full.index(stop)]
        num_cut += 1
    assert num_cut >= 20


def test_without_a_match_every_token_is_kept(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("no stop string here", add_special_tokens=False)
    detok = feed(tokenizer, ids, ("STOP",), 3)
    assert detok.token_ids == ids and detok.stop_string is None
