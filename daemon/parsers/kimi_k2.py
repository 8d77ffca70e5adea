"""Kimi-K2's tool calls (`kimi_k2`): a section of calls between special tokens.

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Beijing"}<|tool_call_end|>
    <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>
    <|tool_calls_section_end|>

(the first call on one line in the model's output).

The markers are special tokens that Kimi's tokenizer keeps in decoded text (`"special":
false`). A call's id is the model's own, `functions.{name}:{n}` (the chat template renders
a result as `## Return of {id}`, so the id goes back as the model wrote it); the name is
what stands between `functions.` and the last `:`. The arguments are the text between
`<|tool_call_argument_begin|>` and `<|tool_call_end|>`, without surrounding whitespace,
streamed as it comes. Text before the section is the answer's content (its trailing
whitespace dropped); text after it too. The singular spelling of the section markers
(`<|tool_call_section_begin|>`) that some Kimi versions write is taken as well.

Output that ends inside a call (the token limit): a call whose arguments began keeps what
came; a call header without arguments is returned as text.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from specd.daemon.parsers.events import (
    Event,
    Text,
    ToolCallArguments,
    ToolCallStart,
    Trimmed,
    find_first,
    held_marker_prefix,
)

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
FUNCTION_PREFIX = "functions."


def function_name(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather` (an id without either part: itself)."""
    name = call_id.removeprefix(FUNCTION_PREFIX)
    head, sep, tail = name.rpartition(":")
    return head if sep and tail.isdigit() else name


class _State(enum.Enum):
    CONTENT = "content"  # before the section, or after it
    SECTION = "section"  # between calls
    HEADER = "header"  # after <|tool_call_begin|>: the id
    ARGUMENTS = "arguments"


class KimiK2ToolParser:
    """Kimi-K2's tool-call format (module docstring) -> events. `new_call_id` is unused:
    the model writes its own ids."""

    def __init__(self, new_call_id: Callable[[], str] | None = None) -> None:
        del new_call_id
        self._state = _State.CONTENT
        self._buffer = ""
        self._content = Trimmed(strip_leading=False)
        self._arguments = Trimmed()
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._buffer and self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        events: list[Event] = []
        if self._state is _State.ARGUMENTS:
            events.append(ToolCallArguments(self.num_calls - 1, self._arguments.add(rest)))
        elif self._state is _State.HEADER:
            events.append(Text(CALL_BEGIN + rest))
        elif self._state is _State.SECTION:
            events.append(Text(rest.strip()))
        elif self._state is _State.CONTENT:
            events += [Text(self._content.add(rest))]
            if not self.num_calls:
                events.append(Text(self._content.flush()))
        return [e for e in events if not isinstance(e, Text | ToolCallArguments) or e.text]

    def _step(self, events: list[Event]) -> bool:
        """Parse what the buffer allows in the current state; False when it must wait."""
        if self._state is _State.CONTENT:
            return self._until(SECTION_BEGIN, events, self._content_text, _State.SECTION)
        if self._state is _State.SECTION:
            return self._section(events)
        if self._state is _State.HEADER:
            found = self._buffer.find(ARGUMENT_BEGIN)
            if found < 0:
                return False
            call_id = self._buffer[:found].strip()
            self._buffer = self._buffer[found + len(ARGUMENT_BEGIN):]
            events.append(ToolCallStart(self.num_calls, call_id, function_name(call_id)))
            self.num_calls += 1
            self._arguments = Trimmed()
            self._state = _State.ARGUMENTS
            return True
        return self._until((CALL_END,), events, self._argument_text, _State.SECTION)

    def _until(self, markers: tuple[str, ...], events: list[Event],
               emit: Callable[[str, list[Event]], None], then: _State) -> bool:
        """Emit the buffer's text up to the first of `markers` and go to state `then`; or,
        with no marker yet, emit all but a possible start of one and wait."""
        found = find_first(self._buffer, markers)
        if found is None:
            held = held_marker_prefix(self._buffer, markers)
            emit(self._buffer[:len(self._buffer) - held], events)
            self._buffer = self._buffer[len(self._buffer) - held:]
            return False
        index, marker = found
        emit(self._buffer[:index], events)
        self._buffer = self._buffer[index + len(marker):]
        if then is _State.SECTION and self._state is _State.CONTENT:
            self._content.close()  # whitespace before the calls is not content
        self._state = then
        return True

    def _content_text(self, text: str, events: list[Event]) -> None:
        out = self._content.add(text)
        if out:
            events.append(Text(out))

    def _argument_text(self, text: str, events: list[Event]) -> None:
        out = self._arguments.add(text)
        if out:
            events.append(ToolCallArguments(self.num_calls - 1, out))

    def _section(self, events: list[Event]) -> bool:
        """Between calls: the next call, or the section's end. Whitespace between them is
        dropped; other text is kept as content (waiting whole for the next marker, so that
        it is stripped the same however it arrives)."""
        found = find_first(self._buffer, (CALL_BEGIN, *SECTION_END))
        if found is None:
            return False
        index, marker = found
        stray = self._buffer[:index].strip()
        if stray:
            events.append(Text(stray))
        self._buffer = self._buffer[index + len(marker):]
        if marker == CALL_BEGIN:
            self._state = _State.HEADER
        else:
            self._state = _State.CONTENT
            self._content = Trimmed()
        return True
