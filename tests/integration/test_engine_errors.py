"""Bad input to the in-process engine is a clear error naming the field, never a wrong answer."""

from __future__ import annotations

from typing import Any

import pytest

import specd


@pytest.fixture(scope="module")
def engine() -> specd.Engine:
    return specd.Engine(None, spec_mode="off", max_model_len=64)


def test_prompt_longer_than_the_model_allows_names_the_limit(engine: specd.Engine) -> None:
    with pytest.raises(ValueError, match=r"prompt has 100 tokens.*at most 63"):
        engine.generate([[5] * 100])


def test_token_ids_outside_the_vocabulary_are_refused(engine: specd.Engine) -> None:
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 4096\)"):
        engine.generate([[1, 2, 99999]])


def test_out_of_range_sampling_values_name_the_field() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"min_p": 1.5}, "min_p")]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field):
            specd.SamplingParams(**kwargs)


def test_unknown_engine_option_lists_the_known_ones() -> None:
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) \['max_batch'\]"):
        specd.Engine(None, max_batch=3)


def test_bad_option_value_names_the_option() -> None:
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        specd.Engine(None, block_size=12)


def test_max_model_len_beyond_the_model_is_refused() -> None:
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds"):
        specd.Engine(None, spec_mode="off", max_model_len=100_000)


def test_a_failed_request_leaves_the_engine_serving(engine: specd.Engine) -> None:
    with pytest.raises(ValueError):
        engine.generate([[7, 8, 9], [5] * 100])  # the good prompt is not left queued
    out = engine.generate(["def f(x):\n"], specd.SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out) == 1 and len(out[0].token_ids) == 4
    assert not engine.core.has_unfinished()
