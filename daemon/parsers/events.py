"""What the output parsers emit, and the helpers every parser shares.

A parser is fed the answer's text piece by piece (`feed`) and told when it ends
(`finish`); each call returns events, in order:

* `Text`: answer text (OpenAI's `content`);
* `Reasoning`: the model's thinking (`reasoning_content`);
* `ToolCallStart`: a call begins: its index in this answer (0, 1, ...), id and function
  name; `ToolCallArguments` then carries pieces of its arguments (a JSON text), in order.

Two helpers keep parsers exact across splits: `held_marker_prefix` (how much of a text's
end might be the start of a marker, and so must wait for the next piece) and `Trimmed`
(a segment of text streamed without its leading and trailing whitespace).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    text: str


Event = Text | Reasoning | ToolCallStart | ToolCallArguments


class OutputParser(Protocol):
    """An incremental parser of one answer's text (module docstring)."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def held_marker_prefix(text: str, markers: Iterable[str]) -> int:
    """The length of the longest end of `text` that is a proper start of some marker: those
    characters may still become the marker and must wait for more text."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def find_first(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """(index, marker) of the earliest marker in `text` (the longest at a tie); None when
    there is none."""
    best: tuple[int, str] | None = None
    for marker in markers:
        index = text.find(marker)
        if index >= 0 and (best is None or index < best[0]
                           or (index == best[0] and len(marker) > len(best[1]))):
            best = (index, marker)
    return best


class Trimmed:
    """One segment of streamed text without its trailing whitespace (and, with
    `strip_leading`, its leading whitespace): trailing whitespace waits until more text
    follows it (`add`) and is dropped when the segment closes (`close`), or given out by
    `flush` when the segment ends and its whitespace is kept."""

    def __init__(self, strip_leading: bool = True) -> None:
        self.strip_leading = strip_leading
        self.is_started = False  # some text was given out
        self._held = ""

    def add(self, text: str) -> str:
        """The part of `text` to give out now."""
        if not self.is_started:
            if self.strip_leading:
                text = text.lstrip()
            if not text:
                return ""
            self.is_started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return body

    def close(self) -> None:
        self._held = ""

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def merged(events: Iterable[Event]) -> list[Event]:
    """`events` with neighbours of one kind (text, reasoning, one call's arguments) joined;
    empty texts dropped. What a client sees does not change."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, Text | Reasoning | ToolCallArguments) and not event.text:
            continue
        last = out[-1] if out else None
        if isinstance(event, Text) and isinstance(last, Text):
            out[-1] = Text(last.text + event.text)
        elif isinstance(event, Reasoning) and isinstance(last, Reasoning):
            out[-1] = Reasoning(last.text + event.text)
        elif (isinstance(event, ToolCallArguments) and isinstance(last, ToolCallArguments)
              and last.index == event.index):
            out[-1] = ToolCallArguments(event.index, last.text + event.text)
        else:
            out.append(event)
    return out
