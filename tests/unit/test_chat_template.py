"""Chat templates render as transformers' `apply_chat_template` renders them: the
`chat_template.jinja` beside the model, named templates ("default", "tool_use"), tools,
template kwargs, content as text parts; and through the socket protocol's generate."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from transformers import AutoTokenizer

from specd.chat_template import TemplateError
from specd.daemon.config import DaemonConfig
from specd.daemon.prompts import PromptEncoder, RequestError
from specd.ipc import messages as m
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR

# A Llama-3.1-style template with tool use: system text from a string or text parts, the
# tools as indented JSON, tool calls and tool results, today's date, a namespace,
# raise_exception, and the `generation` tag transformers defines.
TOOL_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}
    {%- if messages[0]['content'] is string %}
        {%- set ns.system = messages[0]['content'] | trim %}
    {%- else %}
        {%- set ns.system = messages[0]['content'][0]['text'] | trim %}
    {%- endif %}
    {%- set messages = messages[1:] %}
{%- endif %}
{{- '<|im_start|>system\\n' }}
{{- 'Today: ' + strftime_now('%Y') + '\\n' }}
{%- if tools is not none %}
    {{- 'Tools:\\n' }}
    {%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- ns.system + '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.tool_calls is defined %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception('one tool call per turn') }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|im_start|>assistant\\n' + {'name': call.name, 'parameters': call.arguments}
            | tojson + '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>ipython\\n' + message.content | tojson + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' }}
        {%- if message['content'] is string %}{{- message['content'] }}
        {%- else %}{%- for part in message['content'] %}{{- part['text'] }}{%- endfor %}
        {%- endif %}
        {%- generation %}{{- '<|im_end|>\\n' }}{%- endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city (°C, \"quoted\" <b>)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CHAT: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly. "},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 °C, sunny", "tool_call_id": "c1"},
        {"role": "user", "content": [{"type": "text", "text": "And "},
                                     {"type": "text", "text": "tomorrow?"}]}]


def model_dir(root: Path, **config: Any) -> Path:
    """The fixture's tokenizer with `config` over its tokenizer_config.json."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURE_DIR / "tokenizer.json", root / "tokenizer.json")
    base = json.loads((FIXTURE_DIR / "tokenizer_config.json").read_text())
    base.pop("chat_template")
    (root / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return root


@pytest.fixture(scope="module")
def jinja_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = model_dir(tmp_path_factory.mktemp("jinja"), chat_template="{{ 'ignored' }}")
    (root / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return root


def both(root: Path) -> tuple[Tokenizer, Any]:
    return Tokenizer.from_dir(root), AutoTokenizer.from_pretrained(str(root))


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False},
                                    {"add_generation_prompt": False}])
def test_chat_template_jinja_renders_as_transformers(
        jinja_dir: Path, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> None:
    ours, theirs = both(jinja_dir)
    # With tools: a tool call and its result; both ways, a turn given as text parts.
    chat = CHAT if tools is not None else [
        CHAT[0], CHAT[1], {"role": "assistant", "content": "Sunny."}, CHAT[4]]
    kwargs = {"add_generation_prompt": True, **kwargs}
    text = ours.apply_chat_template(chat, tools=tools, **kwargs)
    assert text == theirs.apply_chat_template(chat, tools=tools, tokenize=False, **kwargs)
    assert text.startswith("<|endoftext|><|im_start|>system\nToday: ")
    assert ("Tools:" in text) == (tools is not None) and "tomorrow?<|im_end|>" in text


def test_named_templates_pick_tool_use_when_tools_are_given(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "plain:{{ messages[0]['content'] }}"},
             {"name": "tool_use", "template": "tools:{{ tools | length }}"}]
    ours, theirs = both(model_dir(tmp_path, chat_template=named))
    chat = [{"role": "user", "content": "hi"}]
    for tools in (None, TOOLS):
        text = ours.apply_chat_template(chat, tools=tools)
        assert text == theirs.apply_chat_template(chat, tools=tools, tokenize=False,
                                                  add_generation_prompt=True)
        assert text == ("plain:hi" if tools is None else "tools:1")


def test_text_parts_are_joined_for_a_template_that_reads_only_strings() -> None:
    ours = Tokenizer.from_dir(FIXTURE_DIR)
    theirs = AutoTokenizer.from_pretrained(str(FIXTURE_DIR))
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert ours.apply_chat_template(parts) == theirs.apply_chat_template(
        [{"role": "user", "content": "a\nb"}], tokenize=False, add_generation_prompt=True)


def test_template_errors_and_the_sandbox(tmp_path: Path, jinja_dir: Path) -> None:
    ours = Tokenizer.from_dir(jinja_dir)
    two_calls = {**CHAT[2], "tool_calls": CHAT[2]["tool_calls"] * 2}
    with pytest.raises(TemplateError, match="one tool call per turn"):
        ours.apply_chat_template([CHAT[1], two_calls])
    escape = Tokenizer.from_dir(model_dir(
        tmp_path / "a", chat_template="{{ messages.__class__.__mro__ }}"))
    with pytest.raises(TemplateError, match="unsafe|SecurityError|Undefined"):
        escape.apply_chat_template(CHAT[:1])
    private = Tokenizer.from_dir(model_dir(
        tmp_path / "b", chat_template="{% set ns = namespace(_x=1) %}"))
    with pytest.raises(TemplateError, match="underscore"):
        private.apply_chat_template(CHAT[:1])
    none = Tokenizer.from_dir(model_dir(tmp_path / "c"))
    with pytest.raises(TemplateError, match="no chat template"):
        none.apply_chat_template(CHAT[:1])


@pytest.fixture
def encoder(jinja_dir: Path) -> Iterator[PromptEncoder]:
    encoder = PromptEncoder(Tokenizer.from_dir(jinja_dir), DaemonConfig())
    yield encoder
    encoder.close()


def test_generate_carries_tools_kwargs_and_text_parts(
        encoder: PromptEncoder, jinja_dir: Path) -> None:
    request = {"type": "generate", "id": 7, "messages": CHAT, "tools": TOOLS,
               "chat_template_kwargs": {"enable_thinking": False}}
    wire = msgspec.msgpack.encode(request)
    message = msgspec.msgpack.Decoder(m.ClientMessage).decode(wire)
    assert isinstance(message, m.Generate)
    assert msgspec.msgpack.Decoder(m.ClientMessage).decode(
        msgspec.msgpack.encode(message)) == message
    ids = encoder.prepare(message, max_model_len=1 << 20)
    theirs: Any = AutoTokenizer.from_pretrained(str(jinja_dir))
    expected = theirs.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True,
                                          enable_thinking=False, return_dict=False)
    assert ids == expected
    bad = generate_error(encoder, {**request, "chat_template_kwargs": {}, "messages": [
        CHAT[1], {**CHAT[2], "tool_calls": CHAT[2]["tool_calls"] * 2}]})
    assert bad.code == "bad_request" and "one tool call per turn" in str(bad)


def generate_error(encoder: PromptEncoder, request: dict[str, Any]) -> RequestError:
    message = msgspec.msgpack.Decoder(m.ClientMessage).decode(msgspec.msgpack.encode(request))
    assert isinstance(message, m.Generate)
    with pytest.raises(RequestError) as info:
        encoder.prepare(message, max_model_len=1 << 20)
    return info.value


@pytest.mark.parametrize("request_fields", [
    {"prompt": "x", "tools": []},
    {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": 1}},
    {"messages": [{"role": "user", "content": [{"type": "image", "text": "x"}]}]},
])
def test_generate_refuses_what_it_cannot_render(request_fields: dict[str, Any]) -> None:
    wire = msgspec.msgpack.encode({"type": "generate", "id": 1, **request_fields})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(m.ClientMessage).decode(wire)
