"""The parsers by name, which one a model gets, and the chain one answer goes through.

`--tool-call-parser` and `--reasoning-parser` name a parser, `auto` (the default) picks one
from the model's chat template, and `none` turns parsing off:

| tool-call parser | the template it is picked for |
| --- | --- |
| `kimi_k2` | one that writes `<|tool_calls_section_begin|>` (Kimi-K2, Kimi-K2.5) |
| `hermes` | one that writes `<tool_call>` (Qwen2.5, Qwen3, Hermes) |
| `llama3_json` | one that writes `<|python_tag|>` (Llama-3.1 and later) |

| reasoning parser | the template it is picked for |
| --- | --- |
| `kimi_k2` | a Kimi template that writes `</think>` (Kimi-K2-Thinking, Kimi-K2.5) |
| `deepseek_r1` | another template that writes `</think>` (DeepSeek-R1, Qwen3) |

Both reasoning parsers read `<think>`...`</think>` (reasoning.py). A template that names
none of these markers gets no parser: its model's tool calls and thinking stay in the
text, as written.

`AnswerParser` chains them for one answer: the reasoning parser first, its `Text` through
the tool-call parser (tool calls come after the thinking).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable

from specd.daemon.parsers.events import Event, OutputParser, Text, merged
from specd.daemon.parsers.hermes import HermesToolParser
from specd.daemon.parsers.kimi_k2 import KimiK2ToolParser
from specd.daemon.parsers.llama3_json import Llama3JsonToolParser
from specd.daemon.parsers.reasoning import ThinkParser

AUTO = "auto"
NONE = "none"
ToolParserFactory = Callable[[Callable[[], str]], OutputParser]
TOOL_CALL_PARSERS: dict[str, ToolParserFactory] = {
    "kimi_k2": KimiK2ToolParser,
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
REASONING_PARSERS = ("kimi_k2", "deepseek_r1")
# What a chat template writes when its model speaks each format, in the order looked for.
TOOL_CALL_MARKERS = (("<|tool_calls_section_begin|>", "kimi_k2"), ("<tool_call>", "hermes"),
                     ("<|python_tag|>", "llama3_json"))
REASONING_MARKER = "</think>"
KIMI_MARKER = "<|tool_calls_section_begin|>"


def check_parser_name(option: str, name: str, known: Iterable[str]) -> None:
    """ValueError naming the option unless `name` is auto, none or a parser."""
    names = (AUTO, NONE, *known)
    if name not in names:
        raise ValueError(f"{option} must be one of {list(names)}, got {name!r}")


def tool_call_parser_for(option: str, template_sources: Iterable[str]) -> str | None:
    """The tool-call parser a model gets: the option's, or with `auto` the one its
    templates' markers name (module docstring); None for none."""
    if option != AUTO:
        return None if option == NONE else option
    sources = list(template_sources)
    return next((name for marker, name in TOOL_CALL_MARKERS
                 if any(marker in source for source in sources)), None)


def reasoning_parser_for(option: str, template_sources: Iterable[str]) -> str | None:
    """The reasoning parser a model gets: the option's, or with `auto` the one its
    templates name (module docstring); None for none."""
    if option != AUTO:
        return None if option == NONE else option
    sources = list(template_sources)
    if not any(REASONING_MARKER in source for source in sources):
        return None
    return "kimi_k2" if any(KIMI_MARKER in source for source in sources) else "deepseek_r1"


def openai_call_id() -> str:
    """A tool call id in OpenAI's style."""
    return f"call_{uuid.uuid4().hex[:24]}"


class AnswerParser:
    """One answer's parsing: `reasoning` (or None), then `tools` (or None) over the text
    that is not reasoning. Either may be absent; with neither, text passes as it is."""

    def __init__(self, reasoning: ThinkParser | None, tools: OutputParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @classmethod
    def build(cls, reasoning_parser: str | None, in_reasoning: bool,
              tool_call_parser: str | None,
              new_call_id: Callable[[], str] = openai_call_id) -> AnswerParser:
        """The chain for parser names (None: that parser is off); `in_reasoning`: the
        prompt opened the model's reasoning (reasoning.prompt_opens_reasoning)."""
        reasoning = None if reasoning_parser is None else ThinkParser(in_reasoning)
        tools = (None if tool_call_parser is None
                 else TOOL_CALL_PARSERS[tool_call_parser](new_call_id))
        return cls(reasoning, tools)

    def feed(self, text: str) -> list[Event]:
        first = [Text(text)] if self.reasoning is None else self.reasoning.feed(text)
        return self._through_tools(first, finish=False)

    def finish(self) -> list[Event]:
        first = [] if self.reasoning is None else self.reasoning.finish()
        return self._through_tools(first, finish=True)

    def _through_tools(self, events: list[Event], finish: bool) -> list[Event]:
        if self.tools is None:
            return merged(events)
        out: list[Event] = []
        for event in events:
            out += self.tools.feed(event.text) if isinstance(event, Text) else [event]
        if finish:
            out += self.tools.finish()
        return merged(out)
