"""A tool call written as a JSON object, `{"name": N, "arguments": {...}}`, read as it streams.

Hermes' `<tool_call>` form and Llama-3's JSON form write a call this way (`"parameters"`
for `"arguments"` in Llama's, sometimes after `"type": "function"`). When the name comes
first, the call starts as soon as the arguments' first character arrives (`call_head`), and
the arguments stream as the model writes them, raw, up to where the value ends
(`JsonValueEnd`). Otherwise the parser waits for the whole object and reads it
(`whole_call`), the arguments then written out as compact JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

ARGUMENT_KEYS = ("arguments", "parameters")
# Anchored at the object's start; the lookahead makes the match end at the arguments' first
# character, wherever the text was split.
_HEAD = re.compile(
    r'\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
    r'"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass(frozen=True)
class CallHead:
    """The function name and where its arguments begin in the text."""

    name: str
    end: int


def call_head(text: str) -> CallHead | None:
    """The head of a call object that names its function before its arguments; None while
    the text does not (yet) begin so."""
    match = _HEAD.match(text)
    if match is None:
        return None
    name = json.loads(match.group(1))
    return CallHead(name, match.end())


def whole_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a complete call object in any key order; None when
    `text` is not one."""
    try:
        value: Any = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in ARGUMENT_KEYS if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)
