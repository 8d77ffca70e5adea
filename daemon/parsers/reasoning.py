"""The model's thinking, `<think>`...`</think>`, apart from its answer.

Kimi-K2-Thinking and Kimi-K2.5 (`kimi_k2`), DeepSeek-R1 and Qwen3 (`deepseek_r1`) write
their reasoning between these tags, before the answer. A template may open the block
itself: Kimi-K2.5's generation prompt ends with `<think>` while thinking is on, and then
the model writes only the closing tag. So the parser starts inside the reasoning when the
rendered prompt ends with the opening tag (`prompt_opens_reasoning`), and otherwise takes
an answer that begins with `<think>` (after whitespace) as opening it; text after an answer
has begun is never reasoning. A template that closes the block in the prompt (thinking
off: Kimi-K2.5's `<think></think>`, Qwen3's `enable_thinking: false`) leaves the parser
outside, so the model's thinking switch decides.

Reasoning and answer are each stripped of leading and trailing whitespace (the blank lines
the model writes around the tags). Reasoning cut off by the end of the output (the token
limit) is all reasoning: the answer is empty.
"""

from __future__ import annotations

import enum

from specd.daemon.parsers.events import Event, Reasoning, Text, Trimmed, held_marker_prefix

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_reasoning(prompt: str, start: str = THINK_START) -> bool:
    """Whether a rendered prompt leaves the model inside its reasoning: it ends (before
    whitespace) with the opening tag."""
    return prompt.rstrip().endswith(start)


class _State(enum.Enum):
    BEFORE = "before"  # nothing but whitespace yet: a `<think>` may open the reasoning
    REASONING = "reasoning"
    ANSWER = "answer"


class ThinkParser:
    """Splits one answer into `Reasoning` and `Text` events (module docstring).
    `in_reasoning`: the prompt opened the block (`prompt_opens_reasoning`)."""

    def __init__(self, in_reasoning: bool, start: str = THINK_START, end: str = THINK_END
                 ) -> None:
        self.start = start
        self.end = end
        self._state = _State.REASONING if in_reasoning else _State.BEFORE
        self._buffer = ""
        self._reasoning = Trimmed()
        self._answer = Trimmed(strip_leading=in_reasoning)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._buffer:
            if self._state is _State.BEFORE and not self._before(events):
                break
            if self._state is _State.REASONING and not self._reasoning_part(events):
                break
            if self._state is _State.ANSWER:
                events.append(Text(self._answer.add(self._buffer)))
                self._buffer = ""
        return [e for e in events if e.text]

    def finish(self) -> list[Event]:
        """The end of the output: text held as a possible tag is what it is."""
        rest, self._buffer = self._buffer, ""
        if self._state is _State.REASONING:
            events: list[Event] = [Reasoning(self._reasoning.add(rest)),
                                   Reasoning(self._reasoning.flush())]
        else:
            events = [Text(self._answer.add(rest)), Text(self._answer.flush())]
        return [e for e in events if e.text]

    def _before(self, events: list[Event]) -> bool:
        """At the answer's start; False when the buffer must wait for more text."""
        stripped = self._buffer.lstrip()
        if stripped.startswith(self.start):
            self._buffer = stripped[len(self.start):]
            self._state = _State.REASONING
            return True
        if self.start.startswith(stripped):
            return False  # whitespace, or a start of the tag
        self._state = _State.ANSWER
        return True

    def _reasoning_part(self, events: list[Event]) -> bool:
        """Inside the reasoning; False when the buffer must wait for more text."""
        index = self._buffer.find(self.end)
        if index >= 0:
            events.append(Reasoning(self._reasoning.add(self._buffer[:index])))
            self._reasoning.close()
            self._buffer = self._buffer[index + len(self.end):]
            self._state = _State.ANSWER
            self._answer = Trimmed(strip_leading=True)
            return True
        held = held_marker_prefix(self._buffer, (self.end,))
        events.append(Reasoning(self._reasoning.add(self._buffer[:len(self._buffer) - held])))
        self._buffer = self._buffer[len(self._buffer) - held:]
        return False
