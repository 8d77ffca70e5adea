"""Llama-3's JSON tool calls (`llama3_json`): the answer is the call, as a JSON object.

    {"name": "get_weather", "parameters": {"city": "Beijing"}}

Llama-3.1 and later (their templates ask for this form) may begin with `<|python_tag|>`
(a special token, usually gone from decoded text) and may write several calls separated by
`;`. An answer is calls only when its first text (after whitespace and the tag) is `{`;
otherwise it is all content, as written. Each call gets an id of `new_call_id`'s and is
read as `json_calls.py` says: arguments streamed when the name comes first, else the whole
object read once it closes. An object that is not a call ends the parsing: it and the rest
are content. Text after the calls is content too.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from specd.daemon.parsers.events import Event, Text, ToolCallArguments, ToolCallStart
from specd.daemon.parsers.json_calls import call_head, whole_call
from specd.daemon.parsers.json_scan import JsonValueEnd

PYTHON_TAG = "<|python_tag|>"
SEPARATORS = ";"


class _State(enum.Enum):
    START = "start"  # whitespace and the tag only, so far
    HEAD = "head"  # inside a call object, before its arguments
    ARGUMENTS = "arguments"
    TAIL = "tail"  # after the arguments, until the object closes
    BETWEEN = "between"  # after a call: separators, the next call, or content
    CONTENT = "content"  # no more calls: the rest as written


class Llama3JsonToolParser:
    """Llama-3's JSON form (module docstring) -> events."""

    def __init__(self, new_call_id: Callable[[], str]) -> None:
        self.new_call_id = new_call_id
        self._state = _State.START
        self._buffer = ""
        self._head_end = JsonValueEnd()  # where the call object ends (before its head parsed)
        self._head_scanned = 0  # characters of the buffer `_head_end` has seen
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
        if self._state in (_State.START, _State.HEAD, _State.CONTENT):
            return [Text(rest)] if rest else []
        if self._state is _State.BETWEEN and rest.strip(SEPARATORS + " \t\r\n"):
            return [Text(rest.strip())]
        return []

    def _step(self, events: list[Event]) -> bool:
        """Parse what the buffer allows in the current state; False when it must wait."""
        state = self._state
        if state is _State.START:
            return self._start()
        if state is _State.CONTENT:
            events.append(Text(self._buffer))
            self._buffer = ""
            return False
        if state is _State.HEAD:
            return self._head(events)
        if state is _State.ARGUMENTS:
            end = self._scanner.scan(self._buffer)
            cut = len(self._buffer) if end is None else end
            events.append(ToolCallArguments(self.num_calls - 1, self._buffer[:cut]))
            self._buffer = self._buffer[cut:]
            if end is None:
                return False
            self._state = _State.TAIL
            self._scanner = JsonValueEnd(depth=1)  # the rest of the call object
            return True
        if state is _State.TAIL:
            end = self._scanner.scan(self._buffer)
            self._buffer = "" if end is None else self._buffer[end:]
            if end is not None:
                self._state = _State.BETWEEN
            return end is not None
        return self._between()

    def _start(self) -> bool:
        stripped = self._buffer.lstrip()
        if stripped.startswith(PYTHON_TAG):
            self._buffer = stripped[len(PYTHON_TAG):]
            return True
        if not stripped or PYTHON_TAG.startswith(stripped):
            return False
        if stripped.startswith("{"):
            self._open_call(stripped)
        else:
            self._state = _State.CONTENT
        return True

    def _between(self) -> bool:
        stripped = self._buffer.lstrip(SEPARATORS + " \t\r\n")
        if not stripped:
            return False
        if stripped.startswith("{"):
            self._open_call(stripped)
        else:
            self._buffer = stripped
            self._state = _State.CONTENT
        return True

    def _open_call(self, text: str) -> None:
        self._buffer = text
        self._state = _State.HEAD
        self._head_end = JsonValueEnd()
        self._head_scanned = 0

    def _head(self, events: list[Event]) -> bool:
        head = call_head(self._buffer)
        if head is not None:
            events.append(ToolCallStart(self.num_calls, self.new_call_id(), head.name))
            self.num_calls += 1
            self._buffer = self._buffer[head.end:]
            self._scanner = JsonValueEnd()
            self._state = _State.ARGUMENTS
            return True
        end = self._head_end.scan(self._buffer[self._head_scanned:])
        if end is None:
            self._head_scanned = len(self._buffer)
            return False
        end += self._head_scanned
        call = whole_call(self._buffer[:end])
        if call is None:  # not a call: this and the rest are content
            self._state = _State.CONTENT
            return True
        events.append(ToolCallStart(self.num_calls, self.new_call_id(), call[0]))
        events.append(ToolCallArguments(self.num_calls, call[1]))
        self.num_calls += 1
        self._buffer = self._buffer[end:]
        self._state = _State.BETWEEN
        return True
