"""Incremental detokenization with stop strings, one object per request (front process).

Text is decoded over a small window of token ids (`prefix_offset:read_offset` is text
already emitted, `read_offset:` is new), the way vLLM and mini-sglang do it: decoding a
window gives the same text as decoding everything for byte-level BPE, at a cost that does
not grow with the output. Two holds keep streamed text exact:

* a window whose text ends in U+FFFD ends in an incomplete UTF-8 character: text is taken
  only up to the last token that completes a character, and the rest waits for the next
  tokens (never half a character), unless `MAX_PENDING_TOKENS` pile up, which only a truly
  invalid byte sequence does, or the request finishes;
* the last `max(len(stop)) - 1` characters are held back while a stop string could still
  complete across them; when one matches, the text is cut exactly before it and
  `stop_string` names it. Text sent earlier never includes any part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

MAX_CHAR_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so spans at most 4 tokens
MAX_PENDING_TOKENS = 8  # undecodable tokens held before they are emitted as U+FFFD
REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feeds token ids in, gives text out. `text` is all text so far (cut at a stop string)."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self.num_emitted_chars = 0
        self.stop_string: str | None = None

    @property
    def is_stopped(self) -> bool:
        """A stop string matched: the request is over, later tokens are ignored."""
        return self.stop_string is not None

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now safe to emit (may be empty)."""
        if self.is_stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        self._decode_window(force=False)
        return self._take(final=self.is_stopped)

    def finish(self) -> str:
        """The request ended: decode what is pending and return all text not yet emitted."""
        while not self.is_stopped and self._read_offset < len(self.token_ids):
            read_offset = self._read_offset
            self._decode_window(force=True)
            if self._read_offset == read_offset:  # only skipped special tokens were left
                break
        return self._take(final=True)

    def _decode_window(self, force: bool) -> None:
        ids = self.token_ids
        if self._read_offset >= len(ids):
            return
        prefix = self._tokenizer.decode(ids[self._prefix_offset:self._read_offset])
        # Take the longest window that ends on a complete character; one character spans at
        # most the last MAX_CHAR_TOKENS tokens, so only those few ends are tried.
        lowest_end = max(self._read_offset, len(ids) - MAX_CHAR_TOKENS)
        for end in range(len(ids), lowest_end, -1):
            window = self._tokenizer.decode(ids[self._prefix_offset:end])
            if len(window) > len(prefix) and not window.endswith(REPLACEMENT):
                break
        else:
            # Only invalid bytes (or skipped special tokens) pending: wait, unless too many
            # piled up or the request is over.
            if not force and len(ids) - self._read_offset < MAX_PENDING_TOKENS:
                return
            end = len(ids)
            window = self._tokenizer.decode(ids[self._prefix_offset:end])
            if len(window) <= len(prefix):
                return
        self._prefix_offset = self._read_offset
        self._read_offset = end
        self._append(window[len(prefix):])

    def _append(self, delta: str) -> None:
        # A match can start up to `hold` characters before the new text.
        search_from = max(0, len(self.text) - self._hold)
        self.text += delta
        best: tuple[int, str] | None = None
        for s in self.stop:
            index = self.text.find(s, search_from)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, s)
        if best is not None:
            self.text = self.text[:best[0]]
            self.stop_string = best[1]

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(0, len(self.text) - self._hold)
        if end <= self.num_emitted_chars:
            return ""
        out = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return out
