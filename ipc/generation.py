"""One generate request on the client side: the request built from its options
(`make_generate`), and its frames (deltas, then a final) collected into what the caller
gets (`StreamDelta`, `GenerateResult`). Shared by the blocking and the asyncio client."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specd.ipc import messages as m
from specd.ipc.sampling import SamplingParams


@dataclass(frozen=True)
class StreamDelta:
    text: str
    token_ids: list[int]
    logprobs: list[m.Logprob] = field(default_factory=list)


@dataclass(frozen=True)
class GenerateResult:
    """The whole output of a request (for `stream`, what all deltas and the final held)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_drafted: int
    num_accepted: int
    acceptance_length: float
    stop_string: str | None
    logprobs: list[m.Logprob]


class Collector:
    """Accumulates deltas and the final frame of one request into a GenerateResult."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[m.Logprob] = []

    def add(self, delta: m.Delta) -> StreamDelta:
        self.texts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        return StreamDelta(delta.text, delta.token_ids, delta.logprobs)

    def partial(self) -> StreamDelta | None:
        """What the deltas held so far (None: nothing): the output of a request that ended
        with an error."""
        if not self.token_ids and not any(self.texts):
            return None
        return StreamDelta("".join(self.texts), list(self.token_ids), list(self.logprobs))

    def result(self, final: m.Final) -> GenerateResult:
        return GenerateResult(
            text="".join(self.texts) + final.text,
            token_ids=self.token_ids + final.token_ids,
            finish_reason=final.finish_reason,
            num_prompt_tokens=final.num_prompt_tokens,
            num_output_tokens=final.num_output_tokens,
            num_cached_tokens=final.num_cached_tokens,
            num_drafted=final.num_drafted,
            num_accepted=final.num_accepted,
            acceptance_length=final.acceptance_length,
            stop_string=final.stop_string,
            logprobs=self.logprobs + final.logprobs,
        )


def make_generate(request_id: int, prompt: str | None, messages: list[dict[str, str]] | None,
                  prompt_token_ids: list[int] | None, sampling: SamplingParams | None,
                  stream: bool, deadline_s: float | None,
                  sampling_options: dict[str, Any]) -> m.Generate:
    """Build a Generate request; `sampling_options` are SamplingParams fields."""
    if sampling is None:
        sampling = SamplingParams(**sampling_options)
    elif sampling_options:
        raise TypeError("pass either sampling= or sampling keyword options, not both")
    return m.Generate(
        id=request_id, prompt=prompt,
        messages=None if messages is None else [m.ChatMessage(**x) for x in messages],
        prompt_token_ids=prompt_token_ids, sampling=sampling, stream=stream,
        deadline_s=deadline_s)


def make_tokenize(request_id: int, prompt: str | None,
                  messages: list[dict[str, Any]] | None) -> m.Tokenize:
    """Build a Tokenize request (ValueError unless exactly one of prompt, messages)."""
    return m.Tokenize(
        id=request_id, prompt=prompt,
        messages=None if messages is None else [m.ChatMessage(**x) for x in messages])
