"""Incremental detokenization with stop strings, one object per request (front process).

Text is decoded over a small window of token ids (`prefix_offset:read_offset` is text
already emitted, `read_offset:` is new), the way vLLM and mini-sglang do it: decoding a
window gives the same text as decoding everything for byte-level BPE, at a cost that does
not grow with the output. Two holds keep streamed text exact:

* a window whose text ends in U+FFFD may end inside a UTF-8 character: a byte-level token
  (tiktoken's, or a byte-level BPE's) can hold the end of one character and the start of
  the next, so a character may never end on a token boundary for several tokens. The text
  before the trailing U+FFFDs is emitted (bytes before an incomplete character decode the
  same whatever follows), the last `MAX_HELD_REPLACEMENTS` of them wait for the next
  tokens (never half a character), and the window moves on once it ends on a whole
  character, or when the request finishes, or after `MAX_WINDOW_TOKENS` tokens (bounds the
  cost of decoding; in practice only a run of invalid bytes gets there);
* the last `max(len(stop)) - 1` characters are held back while a stop string could still
  complete across them; when one matches, the text is cut exactly before it and
  `stop_string` names it. Text sent earlier never includes any part of a stop string.

With stop strings, tokens are decoded one at a time, so the token whose text completes
the first match is known: `token_ids` end with it, and tokens after it (a speculative step
gives several at once) are dropped. The output's text, token ids and their count then
agree: the text is `decode(token_ids)` cut before the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# An incomplete UTF-8 character (at most 3 bytes of 4) decodes to one U+FFFD with
# byte-level tokens, one per byte with byte-fallback tokens: never more than 3.
MAX_HELD_REPLACEMENTS = 3
MAX_WINDOW_TOKENS = 256
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
        self._num_pending_chars = 0  # text past `read_offset` already appended
        self.text = ""
        self.num_emitted_chars = 0
        self.stop_string: str | None = None

    @property
    def is_stopped(self) -> bool:
        """A stop string matched: the request is over, later tokens are ignored."""
        return self.stop_string is not None

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now safe to emit (may be empty). After a
        stop string matched, the tokens past the one that completed it are not kept:
        `len(token_ids)` tells how many of `new_token_ids` were."""
        if self.is_stopped:
            return ""
        if not self.stop:
            self.token_ids.extend(new_token_ids)
            self._decode_window(force=False)
            return self._take(final=False)
        for token_id in new_token_ids:  # one at a time: the token that completes a match
            self.token_ids.append(token_id)
            self._decode_window(force=False)
            if self.is_stopped:
                break
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
        window = self._tokenizer.decode(ids[self._prefix_offset:])
        force = force or len(ids) - self._read_offset >= MAX_WINDOW_TOKENS
        num_trailing = len(window) - len(window.rstrip(REPLACEMENT))
        held = 0 if force else min(num_trailing, MAX_HELD_REPLACEMENTS)
        start = len(prefix) + self._num_pending_chars  # chars of `window` already appended
        end = len(window) - held
        if end > start:
            self._append(window[start:end])
        if held == 0 and len(window) > len(prefix):
            # The window ends on a whole character: all its text is out; move on.
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            self._num_pending_chars = 0
        else:
            # Wait for the character to complete (or, with no new text, for tokens that
            # decode to something: skipped special tokens stay in the window).
            self._num_pending_chars = max(self._num_pending_chars, end - len(prefix))

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
