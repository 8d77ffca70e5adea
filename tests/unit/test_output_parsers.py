"""The tool-call and reasoning parsers (daemon/parsers/) on recorded outputs of each format:
what each output parses to, written out by hand, and the same result whatever the pieces
the text arrives in: split at every byte of its UTF-8 (decoded as a stream decodes it), fed
byte by byte, and fed token by token through the front's detokenizer, with Kimi's markers
as the special tokens its tokenizer keeps in decoded text."""

from __future__ import annotations

import codecs
import itertools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pytest

from specd.daemon.detokenizer import IncrementalDetokenizer
from specd.daemon.parsers import registry
from specd.daemon.parsers.events import (
    Event,
    Reasoning,
    Text,
    ToolCallArguments,
    ToolCallStart,
    held_marker_prefix,
    merged,
)
from specd.daemon.parsers.json_scan import JsonValueEnd
from specd.daemon.parsers.kimi_k2 import function_name
from specd.daemon.parsers.reasoning import prompt_opens_reasoning
from specd.daemon.parsers.registry import AnswerParser
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR
from tests.unit.test_tiktoken_tokenizer import ADDED, NUM_BASE, write_model


@dataclass
class Parsed:
    """An answer as OpenAI's message holds it."""

    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments)


def collect(events: Iterable[Event]) -> Parsed:
    """The message that `events` (in order) stream; checks the stream's own rules: calls
    numbered 0, 1, ... as they start, arguments only for the call started last."""
    parsed = Parsed()
    for event in events:
        if isinstance(event, Text):
            parsed.content += event.text
        elif isinstance(event, Reasoning):
            parsed.reasoning += event.text
        elif isinstance(event, ToolCallStart):
            assert event.index == len(parsed.calls)
            parsed.calls.append((event.id, event.name, ""))
        else:
            assert event.index == len(parsed.calls) - 1
            call_id, name, arguments = parsed.calls[-1]
            parsed.calls[-1] = (call_id, name, arguments + event.text)
    return parsed


def counter_ids() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


@dataclass(frozen=True)
class Sample:
    name: str
    tools: str | None  # the tool-call parser
    reasoning: str | None  # the reasoning parser
    in_reasoning: bool
    text: str
    expected: Parsed

    def parser(self) -> AnswerParser:
        return AnswerParser.build(self.reasoning, self.in_reasoning, self.tools, counter_ids())


KIMI_TWO_CALLS = (
    "I'll check the weather in both cities.\n"
    "<|tool_calls_section_begin|>\n"
    "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "北京", "units": {"temp": "c", "list": [1, 2, {"a": "}"}]}}<|tool_call_end|>\n'
    "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|> "
    '{"city": "Zürich 🌧"} <|tool_call_end|>\n'
    "<|tool_calls_section_end|>")
SAMPLES = [
    Sample("kimi two calls", "kimi_k2", None, False, KIMI_TWO_CALLS, Parsed(
        content="I'll check the weather in both cities.",
        calls=[("functions.get_weather:0", "get_weather",
                '{"city": "北京", "units": {"temp": "c", "list": [1, 2, {"a": "}"}]}}'),
               ("functions.get_weather:1", "get_weather", '{"city": "Zürich 🌧"}')])),
    Sample("kimi K2.5 thinking, then a call", "kimi_k2", "kimi_k2", True,
           "The user wants the time in Tokyo; I have a tool for that.\n</think>\n\n"
           "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:3"
           '<|tool_call_argument_begin|>{"tz": "Asia/Tokyo"}<|tool_call_end|>'
           "<|tool_calls_section_end|>", Parsed(
               reasoning="The user wants the time in Tokyo; I have a tool for that.",
               calls=[("functions.get_time:3", "get_time", '{"tz": "Asia/Tokyo"}')])),
    Sample("kimi text only, with a marker-like start", "kimi_k2", None, False,
           "No tool needed: <|tool_c is not a marker, and 2 < 3.\n",
           Parsed(content="No tool needed: <|tool_c is not a marker, and 2 < 3.\n")),
    Sample("kimi cut off inside the arguments", "kimi_k2", None, False,
           "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0"
           '<|tool_call_argument_begin|>{"q": "abc',
           Parsed(calls=[("functions.search:0", "search", '{"q": "abc')])),
    Sample("kimi K2.5 thinking off: an answer", "kimi_k2", "kimi_k2", False,
           "Hello! How can I help?", Parsed(content="Hello! How can I help?")),
    Sample("kimi thinking cut off", "kimi_k2", "kimi_k2", True,
           "Let me think about 😀 this </thi",
           Parsed(reasoning="Let me think about 😀 this </thi")),
    Sample("hermes two calls, one with its name last", "hermes", None, False,
           "Let me look that up.\n\n<tool_call>\n"
           '{"name": "get_weather", "arguments": {"city": "Paris", '
           '"note": "a \\"quoted\\" } brace", "nested": {"deep": [{"x": null}]}}}\n'
           "</tool_call>\n<tool_call>\n"
           '{"arguments": {"tz": "UTC+1", "émoji": "🎉"}, "name": "get_time"}\n</tool_call>',
           Parsed(content="Let me look that up.", calls=[
               ("call_0", "get_weather", '{"city": "Paris", "note": "a \\"quoted\\" } brace", '
                                         '"nested": {"deep": [{"x": null}]}}'),
               ("call_1", "get_time", '{"tz": "UTC+1", "émoji": "🎉"}')])),
    Sample("qwen3 thinking, then a hermes call", "hermes", "deepseek_r1", False,
           "<think>\nThe user asks for 3 + 4; use the calculator.\n</think>\n\n<tool_call>\n"
           '{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
           Parsed(reasoning="The user asks for 3 + 4; use the calculator.",
                  calls=[("call_0", "add", '{"a": 3, "b": 4}')])),
    Sample("hermes: not a call", "hermes", None, False,
           "<tool_call>\nnot json\n</tool_call> Sorry.",
           Parsed(content="<tool_call>\nnot json\n</tool_call>Sorry.")),
    Sample("hermes: a call, then an answer", "hermes", None, False,
           '<tool_call>{"name": "ping", "arguments": {}}</tool_call>\nDone, all ✓.',
           Parsed(content="Done, all ✓.", calls=[("call_0", "ping", "{}")])),
    Sample("llama3 two calls", "llama3_json", None, False,
           '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco, CA", '
           '"days": [1, 2]}}; {"name": "get_time", "parameters": {}}',
           Parsed(calls=[("call_0", "get_weather", '{"city": "San Francisco, CA", "days": [1, 2]}'),
                         ("call_1", "get_time", "{}")])),
    Sample("llama3 typed call with unicode", "llama3_json", None, False,
           ' {"type": "function", "name": "search", "parameters": {"query": "naïve café ☕"}}',
           Parsed(calls=[("call_0", "search", '{"query": "naïve café ☕"}')])),
    Sample("llama3 answer", "llama3_json", None, False, "  The answer is {42}.",
           Parsed(content="  The answer is {42}.")),
    Sample("llama3 JSON that is no call", "llama3_json", None, False, '{"not": "a call"} ok',
           Parsed(content='{"not": "a call"} ok')),
    Sample("deepseek thinking and an answer, no tools", None, "deepseek_r1", True,
           "First, 2 + 2 = 4.\n</think>\n\nThe answer is **4**.",
           Parsed(reasoning="First, 2 + 2 = 4.", content="The answer is **4**.")),
]


def whole(sample: Sample) -> list[Event]:
    parser = sample.parser()
    return merged([*parser.feed(sample.text), *parser.finish()])


def in_pieces(sample: Sample, pieces: Iterable[bytes]) -> list[Event]:
    """The events of `sample` fed as its UTF-8 pieces decode, as a stream decodes them."""
    parser = sample.parser()
    decoder = codecs.getincrementaldecoder("utf-8")()
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(decoder.decode(piece))
    events += parser.feed(decoder.decode(b"", final=True))
    return events + parser.finish()


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_recorded_outputs_parse_to_the_message(sample: Sample) -> None:
    assert collect(whole(sample)) == sample.expected
    for _, _, arguments in sample.expected.calls:
        if not sample.name.endswith("cut off inside the arguments"):
            json.loads(arguments)  # the arguments are JSON


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_every_byte_split_gives_the_same_message(sample: Sample) -> None:
    data = sample.text.encode()
    expected = collect(whole(sample))
    for cut in range(len(data) + 1):
        assert collect(in_pieces(sample, [data[:cut], data[cut:]])) == expected, cut
    byte_by_byte = in_pieces(sample, [data[i:i + 1] for i in range(len(data))])
    assert collect(byte_by_byte) == expected
    # The streamed events are whole ones in more pieces: merged, they are the same events.
    assert merged(byte_by_byte) == whole(sample)


KIMI_MARKERS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                "</think>"]


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A Kimi-like tiktoken tokenizer whose tool-call markers and think tags are tokens
    with `"special": false`, as in Kimi's own tokenizer_config.json."""
    added = {**ADDED, **{NUM_BASE + 20 + i: text for i, text in enumerate(KIMI_MARKERS)}}
    decoder = {str(i): {"content": text, "lstrip": False, "normalized": False,
                        "rstrip": False, "single_word": False,
                        "special": text not in ("<think>", *KIMI_MARKERS)}
               for i, text in added.items()}
    root = write_model(tmp_path_factory.mktemp("kimi-markers"), added_tokens_decoder=decoder)
    return Tokenizer.from_dir(root)


def by_tokens(sample: Sample, tokenizer: Tokenizer) -> list[Event]:
    """The events of `sample` fed as the front's detokenizer gives its text out, one
    token at a time."""
    ids = tokenizer.encode(sample.text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    parser = sample.parser()
    events: list[Event] = []
    for token_id in ids:
        events += parser.feed(detokenizer.add([token_id]))
    events += parser.feed(detokenizer.finish())
    return events + parser.finish()


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_token_by_token_through_the_detokenizer(sample: Sample, kimi_tokenizer: Tokenizer
                                                ) -> None:
    tokenizer = (kimi_tokenizer if sample.tools == "kimi_k2"
                 else Tokenizer.from_dir(FIXTURE_DIR))
    if sample.tools == "kimi_k2":  # each marker is one token, kept in the decoded text
        ids = tokenizer.encode(sample.text, add_special_tokens=False)
        markers = [m for m in KIMI_MARKERS if m in sample.text]
        assert all(tokenizer.encode(m, add_special_tokens=False) != [] for m in markers)
        assert tokenizer.decode(ids) == sample.text
    assert collect(by_tokens(sample, tokenizer)) == collect(whole(sample))


def test_stream_holds_back_only_what_may_be_a_marker() -> None:
    parser = AnswerParser.build(None, False, "kimi_k2")
    # The trailing space waits too: before a call section it is not content.
    assert parser.feed("Sure, <|tool_") == [Text("Sure,")]
    assert parser.feed("thing|> and") == [Text(" <|tool_thing|> and")]
    hermes = AnswerParser.build(None, False, "hermes", counter_ids())
    assert hermes.feed("ok <tool") == [Text("ok")]
    assert hermes.feed('_call>{"name": "f", "arguments": {"a"') == [
        ToolCallStart(0, "call_0", "f"), ToolCallArguments(0, '{"a"')]
    assert hermes.feed(': 1}}</tool_call>') == [ToolCallArguments(0, ": 1}")]
    assert hermes.finish() == []


def test_helpers() -> None:
    assert held_marker_prefix("abc<|to", ["<|tool|>"]) == 4
    assert held_marker_prefix("abc", ["<|tool|>"]) == 0
    assert held_marker_prefix("<|tool|>", ["<|tool|>"]) == 0  # whole: found, not held
    assert function_name("functions.get_weather:12") == "get_weather"
    assert function_name("functions.ns.fn:0") == "ns.fn"
    assert function_name("plain") == "plain"
    scanner = JsonValueEnd()
    assert scanner.scan('{"a": "}"') is None and scanner.scan(', "b": [1]} tail') == 11
    assert JsonValueEnd().scan('"x\\"y" rest') == 6
    assert JsonValueEnd().scan("123, 4") == 3
    assert JsonValueEnd().scan('{"a": 1 <|end|>') == 8  # no JSON: ends at the stray "<"
    assert JsonValueEnd(depth=1).scan(' "k": 1} more') == 8
    assert prompt_opens_reasoning("<|im_assistant|>assistant<|im_middle|><think>")
    assert not prompt_opens_reasoning("<|im_middle|><think></think>")


def test_parsers_chosen_from_the_template() -> None:
    kimi = "{{'<|tool_calls_section_begin|>'}}{{'</think>'}}"
    assert registry.tool_call_parser_for("auto", [kimi]) == "kimi_k2"
    assert registry.reasoning_parser_for("auto", [kimi]) == "kimi_k2"
    qwen = "<tool_call>\n{{ tool_call | tojson }}\n</tool_call>{% if x %}</think>{% endif %}"
    assert registry.tool_call_parser_for("auto", [qwen]) == "hermes"
    assert registry.reasoning_parser_for("auto", [qwen]) == "deepseek_r1"
    assert registry.tool_call_parser_for("auto", ["<|python_tag|>"]) == "llama3_json"
    assert registry.tool_call_parser_for("auto", ["{{ messages }}"]) is None
    assert registry.reasoning_parser_for("auto", ["{{ messages }}"]) is None
    assert registry.tool_call_parser_for("none", [qwen]) is None
    assert registry.tool_call_parser_for("hermes", ["{{ messages }}"]) == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        registry.check_parser_name("tool_call_parser", "qwen", registry.TOOL_CALL_PARSERS)
