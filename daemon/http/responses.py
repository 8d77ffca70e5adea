"""The request flow's frames (`Delta`, `Final`) as OpenAI objects and stream chunks.

One `Answer` per request keeps what the chunks of one stream share: the id, the creation
time, whether the chat role was sent, the text offset of completions' logprobs. Streamed
chunks are server-sent events (`data: {json}\\n\\n`), ended by `data: [DONE]`; with
`stream_options.include_usage` the last chunk before it has no choices and the usage.

Usage counts prompt, completion and cached tokens (`prompt_tokens_details.cached_tokens`)
and carries specd's speculation figures as an extension field, `usage.speculation`
(`drafted_tokens`, `accepted_tokens`, `acceptance_length`: output tokens per engine step
that produced tokens for the request).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from specd.daemon.http.params import Options
from specd.ipc import messages as m
from specd.tokenizer import Tokenizer

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event holding `payload` as JSON."""
    return b"data: " + _encode(payload) + b"\n\n"


def usage(final: m.Final) -> dict[str, Any]:
    return {
        "prompt_tokens": final.num_prompt_tokens,
        "completion_tokens": final.num_output_tokens,
        "total_tokens": final.num_prompt_tokens + final.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens},
        "speculation": {"drafted_tokens": final.num_drafted,
                        "accepted_tokens": final.num_accepted,
                        "acceptance_length": final.acceptance_length},
    }


class Answer:
    """The OpenAI answer to one request (`model`: the served model's name)."""

    def __init__(self, options: Options, model: str, tokenizer: Tokenizer) -> None:
        self.options = options
        self.model = model
        self.tokenizer = tokenizer
        prefix = "chatcmpl" if options.is_chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if options.is_chat else "text_completion"
        self._is_role_sent = False
        self._text_offset = 0  # completions' logprobs.text_offset, across chunks

    # ---- streamed ----------------------------------------------------------------------

    def delta_event(self, delta: m.Delta) -> bytes:
        """The chunk of a Delta; b"" when it has nothing to show (text lagging its token
        ids, no logprobs asked)."""
        logprobs = self._logprobs(delta.token_ids, delta.logprobs)
        if not delta.text and logprobs is None:
            return b""
        return sse(self._chunk(delta.text, logprobs, None))

    def final_events(self, final: m.Final) -> bytes:
        """The last chunk (the rest of the text, the finish reason), the usage chunk when
        asked for, and [DONE]."""
        logprobs = self._logprobs(final.token_ids, final.logprobs)
        events = [sse(self._chunk(final.text, logprobs, final.finish_reason))]
        if self.options.include_usage:
            events.append(sse({"id": self.id, "object": self.object, "created": self.created,
                               "model": self.model, "choices": [], "usage": usage(final)}))
        events.append(DONE)
        return b"".join(events)

    def _chunk(self, text: str, logprobs: dict[str, Any] | None,
               finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.options.is_chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            if not self._is_role_sent:
                delta = {"role": "assistant", "content": text}
                self._is_role_sent = True
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        chunk = {"id": self.id, "object": self.object, "created": self.created,
                 "model": self.model, "choices": [choice]}
        if self.options.include_usage:
            chunk["usage"] = None
        return chunk

    # ---- whole ---------------------------------------------------------------------------

    def whole(self, final: m.Final) -> dict[str, Any]:
        """The non-streamed answer: the Final of a request that did not stream holds all
        of its text, token ids and logprobs."""
        choice: dict[str, Any] = {"index": 0}
        if self.options.is_chat:
            choice["message"] = {"role": "assistant", "content": final.text}
        else:
            choice["text"] = final.text
        choice["logprobs"] = self._logprobs(final.token_ids, final.logprobs)
        choice["finish_reason"] = final.finish_reason
        return {"id": self.id,
                "object": "chat.completion" if self.options.is_chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(final)}

    # ---- logprobs ------------------------------------------------------------------------

    def _logprobs(self, token_ids: list[int], logprobs: list[m.Logprob]
                  ) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens; None when the request asked for none
        (or, streamed, when these frames hold no token)."""
        num_top = self.options.num_top_logprobs
        if num_top is None or not logprobs:
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
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self._token(i): value for i, value in
                                  zip(lp.top_ids[:num_top], lp.top_logprobs[:num_top],
                                      strict=True)} for lp in logprobs],
                "text_offset": offsets}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
