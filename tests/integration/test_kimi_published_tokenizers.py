"""Kimi-K2's and Kimi-K2.5's published tokenizer directories, token for token against their
own code run by transformers (`AutoTokenizer.from_pretrained(dir, trust_remote_code=True)`,
here only: specd never runs a model's Python): tools, tool calls and results, thinking on
and off, multi-turn with `reasoning_content`.

The published files cannot be committed; give the directories (each with
`tokenization_kimi.py`, K2.5's `tool_declaration_ts.py`, `tokenizer_config.json`,
`chat_template.jinja` and `tiktoken.model`) in SPECD_KIMI_K2_TOKENIZER_DIR and
SPECD_KIMI_K25_TOKENIZER_DIR. The test skips without them."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from specd.model_fit import check_vocabulary
from specd.tokenizer import Tokenizer

DIRS = {"k2": "SPECD_KIMI_K2_TOKENIZER_DIR", "k25": "SPECD_KIMI_K25_TOKENIZER_DIR"}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city.\n\nUse it often.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}}
ORDER = {"type": "function", "function": {
    "name": "place_order", "description": "Order items",
    "parameters": {"type": "object", "required": ["items"], "$defs": {
        "Item": {"type": "object", "description": "One line", "required": ["sku"],
                 "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}}}},
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "meta": {"type": "object", "additionalProperties": {"type": "string"}}}}}}
NO_DECLARATION = {"type": "function", "function": {"name": "odd", "parameters": {
    "type": "object", "properties": {"x": {"oneOf": [{"type": "string"}]}}}}}
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}

USER: dict[str, Any] = {"role": "user", "content": "What is the weather in Paris?"}
TOOL_TURNS: list[dict[str, Any]] = [
    USER,
    {"role": "assistant", "content": "", "reasoning_content": "The user wants weather.",
     "tool_calls": [CALL]},
    {"role": "tool", "content": "{\"temp\": 18}", "tool_call_id": "functions.get_weather:0"}]
MULTI_TURN: list[dict[str, Any]] = [
    {"role": "system", "content": "You are Kimi."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
    {"role": "user", "content": "And 3+3?"}]
CASES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "plain": ([USER], None),
    "tools": ([USER], [WEATHER, ORDER]),
    "a tool without a TypeScript declaration": ([USER], [NO_DECLARATION, WEATHER]),
    "tool call and result": (TOOL_TURNS, [WEATHER]),
    "after the result": ([*TOOL_TURNS, {"role": "assistant", "content": "18 C.",
                                        "reasoning_content": "Report it."},
                          {"role": "user", "content": "Thanks"}], [WEATHER]),
    "multi-turn with reasoning": (MULTI_TURN, None),
    "text parts": ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}], None),
}
KWARGS = {"default": {}, "thinking off": {"thinking": False},
          "preserve thinking": {"preserve_thinking": True},
          "no generation prompt": {"add_generation_prompt": False}}


def directory(kind: str) -> Path:
    value = os.environ.get(DIRS[kind])
    if not value:
        pytest.skip(f"{DIRS[kind]} is not set: the published tokenizer directory of "
                    f"{'Kimi-K2' if kind == 'k2' else 'Kimi-K2.5'} is needed")
    return Path(value)


@pytest.fixture(scope="module", params=sorted(DIRS))
def pair(request: pytest.FixtureRequest) -> tuple[str, Tokenizer, Any]:
    from transformers import AutoTokenizer

    root = directory(request.param)
    theirs = AutoTokenizer.from_pretrained(str(root), trust_remote_code=True)
    return request.param, Tokenizer.from_dir(root), theirs


def their_ids(theirs: Any, messages: list[dict[str, Any]], tools: Any,
              kwargs: dict[str, Any]) -> list[int]:
    out = theirs.apply_chat_template(copy.deepcopy(messages), tools=copy.deepcopy(tools),
                                     tokenize=True, **kwargs)
    return list(out["input_ids"] if not isinstance(out, list) else out)


@pytest.mark.parametrize("kwargs_name", sorted(KWARGS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_ids_equal_the_models_own_code(pair: tuple[str, Tokenizer, Any], case: str,
                                              kwargs_name: str) -> None:
    _, ours, theirs = pair
    messages, tools = CASES[case]
    kwargs = {"add_generation_prompt": True, **KWARGS[kwargs_name]}
    text = ours.apply_chat_template(copy.deepcopy(messages), tools=copy.deepcopy(tools),
                                    **kwargs)
    assert text == theirs.apply_chat_template(copy.deepcopy(messages),
                                              tools=copy.deepcopy(tools), tokenize=False,
                                              **kwargs)
    assert ours.encode(text, add_special_tokens=False) == their_ids(theirs, messages, tools,
                                                                    kwargs)


def test_reasoning_sent_as_vllms_reasoning_renders_as_reasoning_content(
        pair: tuple[str, Tokenizer, Any]) -> None:
    _, ours, theirs = pair
    as_vllm = [{**msg, "reasoning": msg.pop("reasoning_content")}
               if "reasoning_content" in msg else msg for msg in copy.deepcopy(MULTI_TURN)]
    assert ours.apply_chat_template(as_vllm, preserve_thinking=True) == (
        theirs.apply_chat_template(copy.deepcopy(MULTI_TURN), tokenize=False,
                                   add_generation_prompt=True, preserve_thinking=True))


def test_vocabulary_and_special_tokens_equal_and_fit(pair: tuple[str, Tokenizer, Any]) -> None:
    kind, ours, theirs = pair
    assert ours.vocab_size == len(theirs)
    text = "".join(str(t) for t in theirs.all_special_tokens) + "<think></think> plain text"
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False)
    config = directory(kind) / "config.json"
    if config.is_file():
        rows = json.loads(config.read_text()).get("vocab_size")
        if rows is None:
            rows = json.loads(config.read_text())["text_config"]["vocab_size"]
        check_vocabulary(ours.num_named_ids, int(rows), directory(kind))
