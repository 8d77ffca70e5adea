"""The request flow's frames (`Delta`, `Final`) as OpenAI objects and stream chunks.

One `Answer` per HTTP request, with one `ChoiceAnswer` per choice (`n`; a frame's `id` is
its choice's index). The answer keeps what the chunks of one stream share: the id, the
creation time, the usage once every choice ended. Each choice keeps its own: whether the
chat role was sent, the text offset of completions' logprobs, its output parser (tool calls
and reasoning: daemon/parsers/) and, for a whole answer, what it collected. A whole answer
is built from the same frames and through the same parsers as a streamed one, so the
streamed deltas, concatenated, are the whole answer's fields.

Streamed chunks are server-sent events (`data: {json}\\n\\n`), ended by `data: [DONE]`
once every choice ended; with `stream_options.include_usage` the last chunk before it has
no choices and the usage (and with `continuous_usage_stats` every chunk carries the usage
so far). A chat chunk's delta holds one kind of output: `content`, `reasoning_content`, or
`tool_calls` as OpenAI streams them (per call a first delta with its `index`, `id`, `type`
and `function.name`, arguments "", then deltas of argument text). The first chunk of a
choice carries `"role": "assistant"`; its last carries the finish reason, `tool_calls` when
the answer called tools and the model stopped by itself.

Usage counts prompt, completion and cached tokens (`prompt_tokens_details.cached_tokens`:
prompt tokens served from the prefix cache, every choice's) and carries specd's
speculation figures as an extension field, `usage.speculation` (`drafted_tokens`,
`accepted_tokens`, `acceptance_length`: output tokens per engine step that produced tokens
for the request). The prompt counts once however many choices share it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from specd.daemon.http.params import Options
from specd.daemon.parsers.events import Event, Reasoning, Text, ToolCallArguments, ToolCallStart
from specd.daemon.parsers.registry import AnswerParser
from specd.ipc import messages as m
from specd.tokenizer import Tokenizer

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode
ParserFactory = Callable[[], AnswerParser | None]


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event holding `payload` as JSON."""
    return b"data: " + _encode(payload) + b"\n\n"


def usage(finals: list[m.Final]) -> dict[str, Any]:
    """The usage of a request whose choices ended with `finals` (all of one prompt)."""
    num_prompt = finals[0].num_prompt_tokens
    num_output = sum(f.num_output_tokens for f in finals)
    steps = sum(f.num_output_tokens / f.acceptance_length for f in finals
                if f.acceptance_length > 0)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
        "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in finals)},
        "speculation": {"drafted_tokens": sum(f.num_drafted for f in finals),
                        "accepted_tokens": sum(f.num_accepted for f in finals),
                        "acceptance_length": num_output / steps if steps else 0.0},
    }


class ChoiceAnswer:
    """One choice of an answer: its parser and what it sent or collected."""

    def __init__(self, index: int, parser: AnswerParser | None) -> None:
        self.index = index
        self.parser = parser
        self.is_role_sent = False
        self.is_echoed = False  # completions' echo: the prompt went out
        self.text_offset = 0  # completions' logprobs.text_offset, across chunks
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0  # so far (continuous usage)
        self.final: m.Final | None = None
        # A whole answer's fields, collected from every frame.
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[dict[str, Any]] = []
        self.logprobs: dict[str, Any] | None = None

    def events(self, text: str, is_last: bool, include_reasoning: bool = True) -> list[Event]:
        """The parsed output of `text` (the whole of it, with no parser), and with
        `is_last` what the parser held; without its reasoning unless `include_reasoning`."""
        if self.parser is None:
            return [Text(text)] if text else []
        events = self.parser.feed(text) if text else []
        events = events + self.parser.finish() if is_last else events
        return events if include_reasoning else [
            e for e in events if not isinstance(e, Reasoning)]

    def collect(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Text):
                self.content += event.text
            elif isinstance(event, Reasoning):
                self.reasoning += event.text
            elif isinstance(event, ToolCallStart):
                self.tool_calls.append({"id": event.id, "type": "function",
                                        "function": {"name": event.name, "arguments": ""}})
            else:
                self.tool_calls[event.index]["function"]["arguments"] += event.text

    def finish_reason(self, final: m.Final) -> str:
        """The engine's reason, `tool_calls` for an answer that called tools and stopped."""
        return "tool_calls" if self.tool_calls and final.finish_reason == "stop" else (
            final.finish_reason)


class Answer:
    """The OpenAI answer to one request (`model`: the served model's name) of
    `options.num_choices` choices; `parser()` makes each choice's output parser (None:
    the text is the answer). `echo_text`: the prompt as completions' echo shows it."""

    def __init__(self, options: Options, model: str, tokenizer: Tokenizer,
                 parser: ParserFactory | None = None, echo_text: str = "") -> None:
        self.options = options
        self.model = model
        self.tokenizer = tokenizer
        self.echo_text = echo_text
        prefix = "chatcmpl" if options.is_chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if options.is_chat else "text_completion"
        make = parser or (lambda: None)
        self.choices = [ChoiceAnswer(i, make()) for i in range(options.num_choices)]

    @property
    def is_done(self) -> bool:
        return all(c.final is not None for c in self.choices)

    # ---- streamed ----------------------------------------------------------------------

    def prompt_event(self, prompt: m.Prompt) -> bytes:
        """A choice's prompt frame: its length (continuous usage) and, echoed with logprobs,
        the prompt's chunk (text and log-probabilities) at once."""
        choice = self.choices[prompt.id]
        choice.num_prompt_tokens = prompt.num_tokens
        if not (self.options.echo and prompt.logprobs):
            return b""
        logprobs = self._logprobs(choice, [], [], prompt.token_ids, prompt.logprobs)
        events = choice.events(self._echoed(choice, ""), is_last=False)
        return b"".join(sse(c) for c in self._chunks(choice, events, logprobs, None))

    def delta_event(self, delta: m.Delta) -> bytes:
        """The chunks of a Delta; b"" when it has nothing to show (text lagging its token
        ids or held by a parser, no logprobs asked)."""
        choice = self.choices[delta.id]
        choice.num_output_tokens += len(delta.token_ids)
        logprobs = self._logprobs(choice, delta.token_ids, delta.logprobs, [], [])
        events = choice.events(self._echoed(choice, delta.text), False,
                               self.options.include_reasoning)
        choice.collect(events)  # whether it called tools decides its finish reason
        return b"".join(sse(c) for c in self._chunks(choice, events, logprobs, None))

    def final_events(self, final: m.Final) -> bytes:
        """The choice's last chunks (the rest of its output, the finish reason); once every
        choice ended, the usage chunk when asked for, and [DONE]."""
        choice = self.choices[final.id]
        choice.final = final
        choice.num_output_tokens = final.num_output_tokens
        logprobs = self._logprobs(choice, final.token_ids, final.logprobs, [], [])
        events = choice.events(self._echoed(choice, self._tail(final)), True,
                               self.options.include_reasoning)
        choice.collect(events)
        chunks = self._chunks(choice, events, logprobs, choice.finish_reason(final))
        out = [sse(c) for c in chunks]
        if self.is_done:
            if self.options.include_usage:
                out.append(sse({"id": self.id, "object": self.object, "created": self.created,
                                "model": self.model, "choices": [],
                                "usage": self._usage()}))
            out.append(DONE)
        return b"".join(out)

    def _chunks(self, choice: ChoiceAnswer, events: list[Event],
                logprobs: dict[str, Any] | None, finish_reason: str | None
                ) -> list[dict[str, Any]]:
        """One chunk per event (the logprobs on the first, the finish reason on the last);
        a chunk without output when there are logprobs or a finish reason to send."""
        if self.options.is_chat:
            bodies: list[dict[str, Any]] = [{"delta": self._delta(e)} for e in events]
        else:
            bodies = [{"text": e.text} for e in events if isinstance(e, Text)]
        if not bodies:
            if logprobs is None and finish_reason is None:
                return []
            bodies = [{"delta": {}} if self.options.is_chat else {"text": ""}]
        if self.options.is_chat and not choice.is_role_sent:
            bodies[0]["delta"] = {"role": "assistant", **bodies[0]["delta"]}
            if len(bodies[0]["delta"]) == 1:
                bodies[0]["delta"]["content"] = ""
            choice.is_role_sent = True
        chunks = []
        for i, body in enumerate(bodies):
            entry = {"index": choice.index, **body,
                     "logprobs": logprobs if i == 0 else None,
                     "finish_reason": finish_reason if i == len(bodies) - 1 else None}
            chunk = {"id": self.id, "object": self.object, "created": self.created,
                     "model": self.model, "choices": [entry]}
            if self.options.include_usage:
                chunk["usage"] = self._usage_so_far() if self.options.continuous_usage else None
            chunks.append(chunk)
        return chunks

    @staticmethod
    def _delta(event: Event) -> dict[str, Any]:
        if isinstance(event, Text):
            return {"content": event.text}
        if isinstance(event, Reasoning):
            return {"reasoning_content": event.text}
        if isinstance(event, ToolCallStart):
            return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        assert isinstance(event, ToolCallArguments), event
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

    def _usage_so_far(self) -> dict[str, Any]:
        num_prompt = max(c.num_prompt_tokens for c in self.choices)
        num_output = sum(c.num_output_tokens for c in self.choices)
        return {"prompt_tokens": num_prompt, "completion_tokens": num_output,
                "total_tokens": num_prompt + num_output}

    # ---- whole ---------------------------------------------------------------------------

    def add(self, frame: m.Prompt | m.Delta | m.Final) -> None:
        """Collect a frame of a request answered whole (frames stream from the flow)."""
        choice = self.choices[frame.id]
        if isinstance(frame, m.Prompt):
            choice.num_prompt_tokens = frame.num_tokens
            if not (self.options.echo and frame.logprobs):
                return
            text, is_last = "", False
            logprobs = self._logprobs(choice, [], [], frame.token_ids, frame.logprobs)
        else:
            if isinstance(frame, m.Final):
                choice.final = frame
                text, is_last = self._tail(frame), True
            else:
                text, is_last = frame.text, False
            logprobs = self._logprobs(choice, frame.token_ids, frame.logprobs, [], [])
        choice.collect(choice.events(self._echoed(choice, text), is_last,
                                     self.options.include_reasoning))
        choice.logprobs = _joined(choice.logprobs, logprobs)

    def whole(self, final: m.Final | None = None) -> dict[str, Any]:
        """The non-streamed answer, once every choice ended (`final`: the last frame, when
        it was not `add`ed)."""
        if final is not None:
            self.add(final)
        choices = []
        for choice in self.choices:
            assert choice.final is not None, choice.index
            entry: dict[str, Any] = {"index": choice.index}
            if self.options.is_chat:
                message: dict[str, Any] = {"role": "assistant",
                                           "content": choice.content or None, "refusal": None}
                if choice.reasoning:
                    message["reasoning_content"] = choice.reasoning
                if choice.tool_calls:
                    message["tool_calls"] = choice.tool_calls
                elif choice.parser is None or choice.parser.tools is None:
                    message["content"] = choice.content  # no parser: the text, "" included
                entry["message"] = message
            else:
                entry["text"] = choice.content
            entry["logprobs"] = choice.logprobs
            entry["finish_reason"] = choice.finish_reason(choice.final)
            choices.append(entry)
        return {"id": self.id,
                "object": "chat.completion" if self.options.is_chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self._usage()}

    def _usage(self) -> dict[str, Any]:
        return usage([c.final for c in self.choices if c.final is not None])

    def _tail(self, final: m.Final) -> str:
        """The final frame's text, with the stop string that ended it when asked for."""
        if self.options.include_stop_str and final.stop_string is not None:
            return final.text + final.stop_string
        return final.text

    def _echoed(self, choice: ChoiceAnswer, text: str) -> str:
        """`text`, after the prompt in a choice's first output when the request echoes."""
        if not self.options.echo or choice.is_echoed:
            return text
        choice.is_echoed = True
        return self.echo_text + text

    # ---- logprobs ------------------------------------------------------------------------

    def _logprobs(self, choice: ChoiceAnswer, token_ids: list[int], logprobs: list[m.Logprob],
                  prompt_ids: list[int], prompt_logprobs: list[m.Logprob]
                  ) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens (after the prompt's, with echo); None
        when the request asked for none (or these frames hold no token)."""
        num_top = self.options.num_top_logprobs
        if num_top is None or not (logprobs or prompt_logprobs):
            return None
        tokens = [self._token(t) for t in token_ids[:len(logprobs)]]
        if self.options.is_chat:
            return {"content": [
                {"token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
                 "top_logprobs": [{"token": (alt := self._token(i)), "logprob": value,
                                   "bytes": list(alt.encode())}
                                  for i, value in zip(lp.top_ids[:num_top],
                                                      lp.top_logprobs[:num_top],
                                                      strict=True)]}
                for token, lp in zip(tokens, logprobs, strict=True)], "refusal": None}
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if prompt_logprobs:
            # Echo: the prompt's tokens first; its first token has no log-probability.
            tokens = [self._token(t) for t in prompt_ids] + tokens
            token_logprobs.append(None)
            tops.append(None)
        for lp in [*prompt_logprobs, *logprobs]:
            token_logprobs.append(lp.logprob)
            tops.append({self._token(i): value for i, value in
                         zip(lp.top_ids[:num_top], lp.top_logprobs[:num_top], strict=True)})
        offsets = []
        for token in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _joined(whole: dict[str, Any] | None, more: dict[str, Any] | None
            ) -> dict[str, Any] | None:
    """Two logprobs objects of one choice as one (each list field extended)."""
    if whole is None or more is None:
        return whole if more is None else more
    return {key: value + more[key] if isinstance(value, list) else value
            for key, value in whole.items()}
