"""Hermes' tool calls (`hermes`): each call a JSON object between `<tool_call>` tags.

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Beijing"}}
    </tool_call>

Qwen2.5, Qwen3 and the Hermes models write this form (their templates declare the tools
and ask for it); `<tool_call>` is an added token kept in decoded text. Each call gets an id
of `new_call_id`'s. The object is read as `json_calls.py` says: arguments streamed when the
name comes first, else the whole object read at `</tool_call>`. Text before the first call
is content (its trailing whitespace dropped), and so is text between or after calls. A call
whose object is not a call (no name) is returned as text, tags and all; so is one cut off
before its arguments began.
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
    held_marker_prefix,
)
from specd.daemon.parsers.json_calls import call_head, whole_call
from specd.daemon.parsers.json_scan import JsonValueEnd

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


class _State(enum.Enum):
    CONTENT = "content"
    HEAD = "head"  # after <tool_call>, before the arguments
    ARGUMENTS = "arguments"
    TAIL = "tail"  # after the arguments' value, until </tool_call>


class HermesToolParser:
    """The `<tool_call>` JSON form (module docstring) -> events."""

    def __init__(self, new_call_id: Callable[[], str]) -> None:
        self.new_call_id = new_call_id
        self._state = _State.CONTENT
        self._buffer = ""
        self._content = Trimmed(strip_leading=False)
        self._scanner = JsonValueEnd()
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._buffer and self._step(events):
            pass
        return [e for e in events if not isinstance(e, Text | ToolCallArguments) or e.text]

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        events: list[Event] = []
        if self._state is _State.CONTENT:
            events.append(Text(self._content.add(rest)))
            if not self.num_calls:
                events.append(Text(self._content.flush()))
        elif self._state is _State.HEAD:
            events.append(Text(CALL_START + rest))
        return [e for e in events if not isinstance(e, Text) or e.text]

    def _step(self, events: list[Event]) -> bool:
        """Parse what the buffer allows in the current state; False when it must wait."""
        if self._state is _State.CONTENT:
            return self._content_part(events)
        if self._state is _State.HEAD:
            return self._head(events)
        if self._state is _State.ARGUMENTS:
            end = self._scanner.scan(self._buffer)
            cut = len(self._buffer) if end is None else end
            events.append(ToolCallArguments(self.num_calls - 1, self._buffer[:cut]))
            self._buffer = self._buffer[cut:]
            if end is None:
                return False
            self._state = _State.TAIL
            return True
        index = self._buffer.find(CALL_END)
        if index < 0:  # the rest of the object: dropped
            self._buffer = self._buffer[len(self._buffer)
                                        - held_marker_prefix(self._buffer, (CALL_END,)):]
            return False
        self._after_call(index + len(CALL_END))
        return True

    def _content_part(self, events: list[Event]) -> bool:
        index = self._buffer.find(CALL_START)
        if index < 0:
            held = held_marker_prefix(self._buffer, (CALL_START,))
            events.append(Text(self._content.add(self._buffer[:len(self._buffer) - held])))
            self._buffer = self._buffer[len(self._buffer) - held:]
            return False
        events.append(Text(self._content.add(self._buffer[:index])))
        self._content.close()  # whitespace before a call is not content
        self._buffer = self._buffer[index + len(CALL_START):]
        self._state = _State.HEAD
        return True

    def _head(self, events: list[Event]) -> bool:
        end = self._buffer.find(CALL_END)
        head = call_head(self._buffer if end < 0 else self._buffer[:end])
        if head is not None:
            self._start(head.name, events)
            self._buffer = self._buffer[head.end:]
            self._scanner = JsonValueEnd()
            self._state = _State.ARGUMENTS
            return True
        if end < 0:
            return False
        body = self._buffer[:end]
        call = whole_call(body)
        if call is None:
            events.append(Text(CALL_START + body + CALL_END))
        else:
            self._start(call[0], events)
            events.append(ToolCallArguments(self.num_calls - 1, call[1]))
        self._after_call(end + len(CALL_END))
        return True

    def _start(self, name: str, events: list[Event]) -> None:
        events.append(ToolCallStart(self.num_calls, self.new_call_id(), name))
        self.num_calls += 1

    def _after_call(self, consumed: int) -> None:
        self._buffer = self._buffer[consumed:]
        self._state = _State.CONTENT
        self._content = Trimmed()
