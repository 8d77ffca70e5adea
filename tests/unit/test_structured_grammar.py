"""Structured-output constraints: their wire form (ipc/structured.py) and their grammars
(workers/structured/): each kind takes the texts it describes and refuses others, compiled
once per distinct constraint; tool calls in the Kimi-K2, Hermes and Llama-3 formats over a
tokenizer.json vocabulary and over a tiktoken one with Kimi's special markers."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from specd.ipc.sampling import SamplingParams
from specd.ipc.structured import (
    MAX_PARALLEL_CALLS,
    Choice,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    StructuredOutput,
    ToolCall,
    ToolSpec,
    cache_key,
)
from specd.workers.config import FIXTURE_DIR
from specd.workers.models.config import ModelConfig
from specd.workers.structured.grammar import GrammarCompiler
from specd.workers.structured.vocabulary import load_vocabulary
from tests.unit.test_tiktoken_tokenizer import ADDED, EOS, NUM_BASE, write_model

CONFIG = ModelConfig.from_dir(FIXTURE_DIR)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [ToolSpec("get_weather", WEATHER), ToolSpec("noop")]
KIMI_MARKERS = {NUM_BASE + 20 + i: name for i, name in enumerate((
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>"))}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(load_vocabulary(FIXTURE_DIR, CONFIG.vocab_size, CONFIG.eos_token_ids))


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> GrammarCompiler:
    """A Kimi-like tiktoken vocabulary whose special block names the tool-call markers
    (`"special": false`, as Kimi's tokenizer_config.json has them)."""
    added = {str(i): {"content": text, "special": text not in KIMI_MARKERS.values()
                      and text != "<think>"}
             for i, text in {**ADDED, **KIMI_MARKERS}.items()}
    root = write_model(tmp_path_factory.mktemp("kimi-tools"), added_tokens_decoder=added)
    return GrammarCompiler(load_vocabulary(root, NUM_BASE + 258, [EOS]))


def takes(compiler: GrammarCompiler, constraint: StructuredOutput, text: str,
          parse_special: bool = False) -> bool:
    """Whether `text` (tokenized as the model would) is a whole sentence of `constraint`."""
    matcher = compiler.matcher(constraint)
    ids = compiler.tokenizer.tokenize_str(text, parse_special=parse_special)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_constraints_travel_inside_sampling_params() -> None:
    for constraint in (JsonSchema({"type": "object", "x": None}, any_whitespace=False),
                       JsonObject(), Regex("a+"), Grammar('root ::= "a"'), Choice(["a", "b"]),
                       ToolCall("kimi_k2", TOOLS, function="noop", parallel=False)):
        params = SamplingParams(max_tokens=3, structured=constraint)
        frame = msgspec.msgpack.encode(params)
        assert msgspec.msgpack.decode(frame, type=SamplingParams) == params
    assert "structured" not in msgspec.to_builtins(SamplingParams())  # omitted by default
    # Equal constraints share a key whatever the order of their maps' keys.
    assert (cache_key(JsonSchema({"a": 1, "b": {"c": 2, "d": 3}}))
            == cache_key(JsonSchema({"b": {"d": 3, "c": 2}, "a": 1})))


@pytest.mark.parametrize("raw, message", [
    ({"type": "tool_call", "format": "xml", "tools": [{"name": "f"}]}, "format"),
    ({"type": "tool_call", "format": "hermes", "tools": [{"name": "f"}, {"name": "f"}]},
     "unique"),
    ({"type": "tool_call", "format": "hermes", "tools": [{"name": "f"}], "function": "g"},
     "not one of the tools"),
    ({"type": "tool_call", "format": "hermes", "tools": [{"name": "f.g"}]}, "tool names"),
    ({"type": "tool_call", "format": "hermes", "tools": []}, "length"),
    ({"type": "regex", "pattern": ""}, "length"),
    ({"type": "choice", "choices": []}, "length"),
    ({"type": "json_schema"}, "schema"),
    ({"type": "xml"}, "xml"),
])
def test_malformed_constraints_are_refused_on_the_wire(raw: dict[str, Any], message: str
                                                       ) -> None:
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert({"structured": raw}, SamplingParams)


def test_each_kind_takes_what_it_describes(compiler: GrammarCompiler) -> None:
    schema = JsonSchema({"type": "object", "properties": {"n": {"type": "integer"}},
                         "required": ["n"], "additionalProperties": False})
    assert takes(compiler, schema, '{"n": 12}') and takes(compiler, schema, '{\n  "n":3\n}')
    assert not takes(compiler, schema, '{"n": "x"}') and not takes(compiler, schema, '{}')
    compact = JsonSchema(schema.schema, any_whitespace=False)
    assert takes(compiler, compact, '{"n":12}') and not takes(compiler, compact, '{"n": 12}')
    assert takes(compiler, JsonObject(), '{"a": [1, {"b": null}]}')
    assert not takes(compiler, JsonObject(), "[1]")
    assert takes(compiler, Regex(r"[a-c]{2}\d+"), "ab42")
    assert not takes(compiler, Regex(r"[a-c]{2}\d+"), "ad42")
    for grammar in ('root ::= "yes" | "no" ws\nws ::= " "?', 'start: "yes" | "no" " "?'):
        assert takes(compiler, Grammar(grammar), "no ") and not takes(compiler, Grammar(grammar),
                                                                       "maybe")
    assert takes(compiler, Choice(["x y", 'q"uote']), 'q"uote')
    assert not takes(compiler, Choice(["x y"]), "x")


def test_a_constraint_compiles_once(compiler: GrammarCompiler) -> None:
    before = compiler.num_compiled
    first = compiler.matcher(Regex("once+"))
    second = compiler.matcher(Regex("once+"))
    assert compiler.num_compiled == before + 1 and compiler.num_cache_hits >= 1
    # Copies: one request's tokens do not move another's matcher.
    assert first.consume_token(compiler.tokenizer.tokenize_str("on")[0])
    assert second.validate_tokens(compiler.tokenizer.tokenize_str("once")) == len(
        compiler.tokenizer.tokenize_str("once"))


@pytest.mark.parametrize("constraint, message", [
    (Regex("(a|"), "regex"),
    (Grammar("start: ::: x"), "grammar"),
    (JsonSchema({"type": 5}), "json_schema"),
    (ToolCall("hermes", [ToolSpec("f", {"type": "array"})]), "parameters must be an object"),
    (ToolCall("kimi_k2", TOOLS), "<|tool_call_begin|>"),  # the fixture has no such tokens
])
def test_constraints_that_do_not_compile_name_their_kind(
        compiler: GrammarCompiler, constraint: StructuredOutput, message: str) -> None:
    with pytest.raises(ValueError, match="structured output") as raised:
        compiler.matcher(constraint)
    assert message in str(raised.value)


HERMES = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
          '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
LLAMA = ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
         '{"name": "noop", "parameters": {}}')


@pytest.mark.parametrize("fmt, calls, separator", [
    ("hermes", HERMES, "\n"), ("llama3_json", LLAMA, "; ")], ids=["hermes", "llama3_json"])
def test_tool_calls_in_their_format(compiler: GrammarCompiler, fmt: str, calls: tuple[str, str],
                                    separator: str) -> None:
    required = ToolCall(fmt, TOOLS)
    assert takes(compiler, required, calls[0]) and takes(compiler, required, calls[1])
    assert takes(compiler, required, separator.join(calls))
    assert takes(compiler, required, separator.join([calls[1]] * MAX_PARALLEL_CALLS))
    assert not takes(compiler, required, separator.join([calls[1]] * (MAX_PARALLEL_CALLS + 1)))
    assert not takes(compiler, required, "")  # required: at least one call
    assert not takes(compiler, required, calls[0].replace('"Paris"', "3"))  # schema enforced
    assert not takes(compiler, required, calls[0].replace("get_weather", "other"))
    single = ToolCall(fmt, TOOLS, parallel=False)
    assert takes(compiler, single, calls[0]) and not takes(compiler, single,
                                                            separator.join(calls))
    named = ToolCall(fmt, TOOLS, function="noop")
    assert takes(compiler, named, calls[1]) and not takes(compiler, named, calls[0])


def kimi_call(name: str, index: int, arguments: Any) -> str:
    return (f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>"
            f"{json.dumps(arguments)}<|tool_call_end|>")


def test_kimi_tool_calls_take_its_special_markers(kimi: GrammarCompiler) -> None:
    def section(*calls: str) -> str:
        return f"<|tool_calls_section_begin|>{''.join(calls)}<|tool_calls_section_end|>"

    required = ToolCall("kimi_k2", TOOLS)
    one = section(kimi_call("get_weather", 0, {"city": "Paris"}))
    two = section(kimi_call("get_weather", 0, {"city": "Paris"}), kimi_call("noop", 1, {}))
    assert takes(kimi, required, one, parse_special=True)
    assert takes(kimi, required, two, parse_special=True)
    # Calls are numbered from 0, in order.
    assert not takes(kimi, required, section(kimi_call("noop", 1, {})), parse_special=True)
    # The markers are special tokens: their text spelled out is not a marker.
    assert not takes(kimi, required, one, parse_special=False)
    assert not takes(kimi, required, section(kimi_call("get_weather", 0, {"town": "x"})),
                     parse_special=True)
    named = ToolCall("kimi_k2", TOOLS, function="noop")
    assert takes(kimi, named, section(kimi_call("noop", 0, {})), parse_special=True)
    assert not takes(kimi, named, one, parse_special=True)
