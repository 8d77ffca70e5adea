"""A chat request reaches the template as the model's tokenizer class hands it on
(specd/chat_preparation.py), checked against transformers' own `apply_chat_template` given
what that class's code computes: Kimi-K2's class sorts the tools' keys; Kimi-K2.5's also
declares them in TypeScript (`tools_ts_str`, here the reference declaration from
tinker-cookbook when it is installed) and always passes `thinking=True` and
`preserve_thinking=False` unless the request sets them. Assistant reasoning
(`reasoning_content`, or vLLM's `reasoning`), tool calls and tool results reach the template
as OpenAI sends them, through the socket's generate and the HTTP chat body too.

specd's one rule beyond the model's code: a `tools_ts_str` the client sets in
`chat_template_kwargs` is kept (K2.5's code would overwrite it when tools are given)."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
from transformers import AutoTokenizer

from specd.chat_preparation import ChatPreparation
from specd.daemon.config import DaemonConfig
from specd.daemon.http.params import ChatCompletionRequest, chat_to_generate, decode_body
from specd.daemon.prompts import PromptEncoder
from specd.ipc import messages as m
from specd.kimi_tools import typescript_tools
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR
from tests.unit.test_kimi_tools import REFERENCE
from tests.unit.test_tiktoken_tokenizer import write_model

# Prints every variable the Kimi classes' code may set, and every message field.
PROBE = (
    "{%- if tools -%}TOOLS {{ tools | tojson }}\nTS {{ tools_ts_str | default('<none>') }}\n"
    "{% endif -%}"
    "thinking={{ thinking | default('<undefined>') }} "
    "preserve={{ preserve_thinking | default('<undefined>') }}\n"
    "{% for m in messages -%}"
    "[{{ m.role }}] {{ m.content }} rc={{ m.get('reasoning_content', '-') }} "
    "r={{ m.get('reasoning', '-') }}"
    "{%- if m.tool_calls %} calls={{ m.tool_calls | tojson }}{% endif -%}"
    "{%- if m.tool_call_id %} id={{ m.tool_call_id }}{% endif -%}\n"
    "{% endfor -%}"
    "{%- if add_generation_prompt %}<gen>{% endif -%}")

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "city": {"type": "string", "description": "City"}}}}},
    {"function": {"parameters": {"properties": {"q": {"type": "string"}}, "type": "object"},
                  "name": "search"}, "type": "function"}]
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
     "tool_calls": [CALL]},
    {"role": "tool", "content": "18 C", "tool_call_id": "functions.get_weather:0"},
    {"role": "assistant", "content": "18 C and sunny.", "reasoning": "Answer now."},
    {"role": "user", "content": "Tomorrow?"}]


def as_openai_server_hands_it_on(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages the model's code receives: nil fields absent, an assistant's reasoning
    under both names (vLLM fills both from `reasoning`)."""
    out = []
    for message in copy.deepcopy(chat):
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning
        out.append(message)
    return out


def sorted_deep(tools: Any) -> Any:
    return json.loads(json.dumps(tools, sort_keys=True))


def declaration(tools: list[dict[str, Any]]) -> str:
    """The tools_ts_str the model's code computes (its own encoder when installed)."""
    if REFERENCE is not None:
        return str(REFERENCE.encode_tools_to_typescript_style(copy.deepcopy(tools)))
    return typescript_tools(tools)


@pytest.fixture(scope="module")
def transformers_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(FIXTURE_DIR))


def kimi_dir(root: Path, kind: str) -> Path:
    write_model(root, kind)
    (root / "chat_template.jinja").write_text(PROBE)
    return root


def expected(theirs: Any, kind: str, tools: list[dict[str, Any]] | None,
             kwargs: dict[str, Any]) -> str:
    """transformers' rendering with what Kimi's apply_chat_template computes for `kind`."""
    computed: dict[str, Any] = {}
    if kind == "k25":
        computed = {"thinking": True, "preserve_thinking": False}
        if tools:
            computed["tools_ts_str"] = declaration(sorted_deep(tools))
    text: str = theirs.apply_chat_template(
        as_openai_server_hands_it_on(CHAT), chat_template=PROBE,
        tools=None if tools is None else sorted_deep(tools), tokenize=False,
        **{"add_generation_prompt": True, **computed, **kwargs})
    return text


@pytest.mark.parametrize("kind", ["k2", "k25"])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("kwargs", [{}, {"thinking": False}, {"preserve_thinking": True},
                                    {"tools_ts_str": "client's own"},
                                    {"add_generation_prompt": False}])
def test_template_variables_are_the_models_codes(
        tmp_path: Path, transformers_tokenizer: Any, kind: str,
        tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> None:
    ours = Tokenizer.from_dir(kimi_dir(tmp_path, kind))
    text = ours.apply_chat_template(copy.deepcopy(CHAT), tools=copy.deepcopy(tools), **kwargs)
    assert text == expected(transformers_tokenizer, kind, tools, kwargs)
    if tools is not None:  # the probe shows the keys sorted, and (K2.5) the declaration
        assert 'TOOLS [{"function": {"description": "Weather' in text
        declared = kind == "k25" and "tools_ts_str" not in kwargs
        assert ("namespace functions {" in text) == declared


def test_a_tool_without_a_declaration_falls_back_to_json_as_the_models_code(
        tmp_path: Path, transformers_tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    odd = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"oneOf": [{"type": "string"}]}}}}}]
    ours = Tokenizer.from_dir(kimi_dir(tmp_path, "k25"))
    with caplog.at_level(logging.WARNING, logger="specd.chat"):
        text = ours.apply_chat_template(copy.deepcopy(CHAT), tools=odd)
    theirs = transformers_tokenizer.apply_chat_template(
        as_openai_server_hands_it_on(CHAT), chat_template=PROBE, tools=sorted_deep(odd),
        tokenize=False, add_generation_prompt=True, thinking=True, preserve_thinking=False)
    assert text == theirs and "TS <none>" in text
    (record,) = [r for r in caplog.records if getattr(r, "event", "") == "tools_declared_as_json"]
    assert "oneOf" in getattr(record, "reason", "")


def test_a_tokenizer_json_model_gets_tools_and_kwargs_as_given() -> None:
    tools = [{"type": "function", "function": {"parameters": {}, "name": "f"}}]
    prepared, variables = ChatPreparation().prepare(tools, {"thinking": False})
    assert prepared == tools and list(prepared[0]["function"]) == ["parameters", "name"]
    assert variables == {"thinking": False}


def test_the_socket_generate_carries_reasoning_tool_calls_and_results(
        tmp_path: Path, transformers_tokenizer: Any) -> None:
    root = kimi_dir(tmp_path, "k25")
    request = {"type": "generate", "id": 3, "messages": CHAT, "tools": TOOLS,
               "chat_template_kwargs": {"thinking": False}}
    message = msgspec.msgpack.Decoder(m.ClientMessage).decode(msgspec.msgpack.encode(request))
    assert isinstance(message, m.Generate) and message.messages is not None
    assert message.messages[2].reasoning_content == "I should call the tool."
    assert message.messages[4].reasoning == "Answer now."
    encoder = PromptEncoder(Tokenizer.from_dir(root), DaemonConfig())
    try:
        ids = encoder.prepare(message, max_model_len=1 << 20)
        text = expected(transformers_tokenizer, "k25", TOOLS, {"thinking": False})
        assert ids == encoder.tokenizer.encode(text, add_special_tokens=False)
    finally:
        encoder.close()


def test_the_http_chat_body_accepts_reasoning_in_history() -> None:
    body = {"model": "m", "messages": CHAT, "tools": TOOLS}
    generate, _ = chat_to_generate(decode_body(json.dumps(body).encode(),
                                               ChatCompletionRequest), 100)
    assert generate.messages is not None
    assert [(x.reasoning_content, x.reasoning) for x in generate.messages][2:5] == [
        ("I should call the tool.", None), (None, None), (None, "Answer now.")]
    assert generate.messages[2].tool_calls == [CALL]
    assert generate.messages[3].tool_call_id == "functions.get_weather:0"
