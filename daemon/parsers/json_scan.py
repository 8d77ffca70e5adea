"""Where a JSON value ends, found in text that arrives piece by piece.

Tool-call parsers stream a call's arguments as the model writes them; `JsonValueEnd` tells
them where the value ends without parsing it: it tracks nesting and strings (with their
escapes), so a `}` or a marker inside a string is text of the value. A `<` outside a
string cannot be JSON: the value is taken to end there (a model that broke off its JSON to
write a marker), so the parser can find the marker.
"""

from __future__ import annotations

OPENERS = "{["
CLOSERS = "}]"
SCALAR_ENDS = ",}]< \t\r\n"


class JsonValueEnd:
    """Scans one JSON value (`depth` 0: from its first character), or the rest of a
    container already opened `depth` levels deep (ends with the bracket that closes the
    outermost). `scan` returns where in the text fed it the value ends, or None when it
    has not ended yet (all of the text belongs to it)."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self._in_string = False
        self._escaped = False
        self._is_scalar = False
        self._is_started = depth > 0
        self.is_done = False

    def scan(self, text: str) -> int | None:
        for i, char in enumerate(text):
            if self._step(char):
                self.is_done = True
                return i if self._ends_before(char) else i + 1
        return None

    def _ends_before(self, char: str) -> bool:
        """Whether the value ended before `char` (a scalar's delimiter, a stray `<`)."""
        return char == "<" or (self._is_scalar and char in SCALAR_ENDS)

    def _step(self, char: str) -> bool:
        """Take one character; True when the value ends at it (see `_ends_before`)."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                return self.depth == 0  # a string value ends with its quote
            return False
        if not self._is_started:
            self._is_started = True
            if char == '"':
                self._in_string = True
            elif char in OPENERS:
                self.depth = 1
            else:
                self._is_scalar = True
                return char in SCALAR_ENDS
            return False
        if self._is_scalar:
            return char in SCALAR_ENDS
        if char == "<":
            return True
        if char == '"':
            self._in_string = True
        elif char in OPENERS:
            self.depth += 1
        elif char in CLOSERS:
            self.depth -= 1
            return self.depth == 0
        return False
