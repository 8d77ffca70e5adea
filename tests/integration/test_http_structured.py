"""Structured output over the HTTP API of a live daemon (`specd --http`), through the official
`openai` SDK: a `json_schema` answer (and the SDK's own `parse` with a pydantic model) that
validates with `jsonschema`, the same greedy text with speculation on and off (the request's
`speculative` field), and the acceptance the answer's usage reports; `tool_choice` required
and named give `tool_calls` whose arguments validate for their tool's schema (the daemon's
tool-call parser, Hermes' format, reading what the constraint wrote); vLLM's fields on
completions; a constraint that does not compile is the SDK's BadRequestError."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import jsonschema
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from specd.workers.config import FIXTURE_DIR
from tests.integration.daemon_harness import Daemon, model_under_test

MODEL = Path(model_under_test() or FIXTURE_DIR).name
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "size": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "size"], "additionalProperties": False}
CHAT: list[Any] = [{"role": "user", "content": "Describe the config as JSON."}]
# JSON without whitespace between tokens: a small code model would pad with newlines.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


class Answer(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    size: int = pydantic.Field(ge=0, le=999)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    tmp = tmp_path_factory.mktemp("http-structured")
    # float32: greedy text comparable with speculation on and off.
    daemon = Daemon(tmp, "--dtype", "float32", "--no-spec-auto-measure", "--spec-mode", "on",
                    "--tool-call-parser", "hermes", "--http", "127.0.0.1:0").wait_ready()
    record = daemon.events("http_listening")[0]
    yield openai.OpenAI(base_url=f"http://{record['host']}:{record['port']}/v1",
                        api_key="none", max_retries=0, timeout=300)
    daemon.stop()


def _speculation(usage: Any) -> dict[str, Any]:
    assert usage is not None and usage.model_extra is not None
    figures: dict[str, Any] = usage.model_extra["speculation"]
    return figures


def test_a_json_schema_answer_validates_and_speculation_changes_nothing(
        api: openai.OpenAI) -> None:
    response_format: Any = {"type": "json_schema",
                            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    answers = {}
    for speculative in (True, False):
        answers[speculative] = api.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=64, temperature=0,
            response_format=response_format, extra_body={**COMPACT, "speculative": speculative})
    on, off = answers[True], answers[False]
    text = on.choices[0].message.content
    assert text is not None and on.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert off.choices[0].message.content == text
    figures = _speculation(on.usage)
    assert figures["drafted_tokens"] > 0 and figures["acceptance_length"] > 1.0, figures
    assert _speculation(off.usage)["drafted_tokens"] == 0
    print(f"json_schema answer {text!r}: acceptance length {figures['acceptance_length']:.2f}"
          f" ({figures['accepted_tokens']} of {figures['drafted_tokens']} drafts accepted)")


def test_the_sdks_parse_with_a_pydantic_model(api: openai.OpenAI) -> None:
    completion = api.chat.completions.parse(model=MODEL, messages=CHAT, max_tokens=64,
                                            temperature=0, response_format=Answer,
                                            extra_body=COMPACT)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}}}]


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"])
def test_tool_choice_gives_calls_valid_for_their_schema(api: openai.OpenAI,
                                                        tool_choice: Any) -> None:
    answer = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=64, temperature=0, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    calls = choice.message.tool_calls
    assert all(isinstance(call, ChatCompletionMessageFunctionToolCall) for call in calls)
    functions = [cast(ChatCompletionMessageFunctionToolCall, call).function for call in calls]
    for function in functions:
        jsonschema.validate(json.loads(function.arguments), schemas[function.name])
    if isinstance(tool_choice, dict):
        assert [function.name for function in functions] == ["get_time"]
    figures = _speculation(answer.usage)
    print(f"tool_choice {tool_choice}: acceptance length {figures['acceptance_length']:.2f}")


def test_vllms_fields_on_completions(api: openai.OpenAI) -> None:
    regex = api.completions.create(model=MODEL, prompt="x = ", max_tokens=16, temperature=0,
                                   extra_body={"guided_regex": "[a-z]{3,6}"})
    text = regex.choices[0].text
    assert 3 <= len(text) <= 6 and text.isalpha() and text.islower()
    choice = api.completions.create(model=MODEL, prompt="mode = ", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": ["fast", "slow"]})
    assert choice.choices[0].text in ("fast", "slow")
    schema = api.completions.create(model=MODEL, prompt="data = ", max_tokens=64,
                                    temperature=0,
                                    extra_body={"guided_json": SCHEMA, **COMPACT})
    jsonschema.validate(json.loads(schema.choices[0].text), SCHEMA)


def test_a_constraint_that_does_not_compile_is_a_bad_request(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="regex"):
        api.completions.create(model=MODEL, prompt="x", max_tokens=4,
                               extra_body={"guided_regex": "(a|"})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, tools=TOOLS,
                                    tool_choice={"type": "function",
                                                 "function": {"name": "other"}})
