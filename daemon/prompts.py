"""A generate request's prompt, turned into token ids without stalling the front.

The front has one event loop for every client, so the cost of one prompt must not land on
it. In order:

1. Checks that need no tokenizing: stop strings within bounds, the chat template renders
   (with the request's tools and template kwargs; a rendered chat is encoded without the
   tokenizer's own special tokens, since the template writes them),
   and the prompt's UTF-8 length is below what `max_model_len` tokens could possibly
   encode (`Tokenizer.max_bytes_per_token`, see token_bound.py). A longer prompt is
   refused `prompt_too_long` at once: tokenizing megabytes only to learn that would cost
   seconds of CPU and hundreds of MB.
2. Short prompts (below `INLINE_TOKENIZE_CHARS`) are tokenized on the loop: a few
   milliseconds at most, no thread hop.
3. Longer ones are tokenized on one worker thread (`encode_off_loop`; the tokenizer
   releases the GIL), one at a time, FIFO; freed memory goes back to the OS afterwards.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from specd.daemon.config import DaemonConfig
from specd.daemon.memory import TRIM_AVAILABLE, release_free_memory
from specd.ipc import messages as m
from specd.logs import log_event
from specd.tokenizer import TemplateError, Tokenizer

log = logging.getLogger("specd.prompts")

# About a millisecond of tokenizing on a slow core; longer prompts go to the worker thread.
INLINE_TOKENIZE_CHARS = 4096
MAX_UTF8_BYTES_PER_CHAR = 4


class RequestError(Exception):
    """A generate request refused before it reached the scheduler."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PromptText:
    """A prompt's text left for the worker thread, and how to encode it (`Tokenizer.encode`:
    False for a rendered chat)."""

    text: str
    add_special_tokens: bool


class PromptEncoder:
    """Prompt text -> token ids for the front: checks, then the loop or the worker thread.

    `prepare` runs on the event loop and returns either the token ids or, for a long
    prompt, its `PromptText` for `encode_off_loop`. `close` stops the worker thread.
    """

    def __init__(self, tokenizer: Tokenizer, config: DaemonConfig) -> None:
        self.tokenizer = tokenizer
        self._config = config
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-tokenize")
        if tokenizer.max_bytes_per_token is None:
            log_event(log, logging.WARNING, "prompt_bytes_unbounded",
                      "no byte bound per token for this tokenizer: long prompts are "
                      "tokenized (off the event loop) before their length is checked",
                      reason=tokenizer.bound_reason)
        if not TRIM_AVAILABLE:
            log_event(log, logging.WARNING, "malloc_trim_unavailable",
                      "malloc_trim is not available (not glibc): memory freed after large "
                      "prompts stays with the front process")

    def prepare(self, message: m.Generate, max_model_len: int) -> list[int] | PromptText:
        """Token ids when known at once (given, or a short prompt), else the prompt text.

        Raises RequestError: `bad_request` for stop strings out of bounds or a chat
        template that fails, `prompt_too_long` for text too long to fit in any case.
        """
        self._check_stop_strings(message.sampling.stop)
        if message.prompt_token_ids is not None:
            return message.prompt_token_ids
        prompt = self._render(message)
        self._check_bytes(prompt.text, max_model_len)
        if len(prompt.text) < INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(prompt.text, prompt.add_special_tokens)
        return prompt

    def render(self, message: m.Generate | m.Tokenize) -> PromptText:
        """The text of a request's `prompt` or rendered `messages`, and how to encode it
        (RequestError `bad_request` for a chat template that fails)."""
        return self._render(message)

    async def encode_off_loop(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize `text` on the worker thread, then give the freed memory back."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._worker, self._encode_and_trim, text, add_special_tokens)

    def release_memory_soon(self) -> None:
        """Give freed memory back to the OS, on the worker thread (after a large frame)."""
        self._worker.submit(release_free_memory).add_done_callback(_log_failure)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _encode_and_trim(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens)
        release_free_memory()  # the tokenizer's working memory is several times the text
        return ids

    def _check_stop_strings(self, stop: tuple[str, ...]) -> None:
        if len(stop) > self._config.max_stop_strings:
            raise RequestError("bad_request", f"{len(stop)} stop strings; at most "
                               f"{self._config.max_stop_strings} allowed")
        if any(len(s) > self._config.max_stop_chars for s in stop):
            raise RequestError("bad_request", f"a stop string is longer than "
                               f"{self._config.max_stop_chars} characters")

    def _render(self, message: m.Generate | m.Tokenize) -> PromptText:
        if message.messages is None:
            return PromptText(message.prompt or "", add_special_tokens=True)
        try:
            text = self.tokenizer.apply_chat_template(
                msgspec.to_builtins(message.messages), tools=message.tools,
                **(message.chat_template_kwargs or {}))
        except TemplateError as exc:
            raise RequestError("bad_request", f"chat template: {exc}") from exc
        return PromptText(text, add_special_tokens=False)

    def _check_bytes(self, text: str, max_model_len: int) -> None:
        per_token = self.tokenizer.max_bytes_per_token
        if per_token is None:
            return
        limit = max_model_len * per_token
        if len(text) * MAX_UTF8_BYTES_PER_CHAR < limit:
            return  # cannot reach the limit: skip measuring
        num_bytes = len(text.encode())
        if num_bytes >= limit:
            raise RequestError(
                "prompt_too_long", f"prompt of {num_bytes} bytes refused without "
                f"tokenizing: at {per_token} bytes per token at most, it cannot fit in "
                f"{max_model_len - 1} tokens (prompts of {limit} bytes or more are refused)")


def _log_failure(future: Future[bool]) -> None:
    exc = future.exception() if not future.cancelled() else None
    if exc is not None:
        log.error("releasing free memory failed", exc_info=exc,
                  extra={"event": "malloc_trim_failed"})
