"""Grammars for tool calls in the model's own format (`tool_choice` `required` or a named
function): the output is one or more calls, each naming one of the tools and carrying JSON
arguments valid for that tool's `parameters` schema (ipc/structured.py's `ToolCall`).

A grammar in llguidance's Lark syntax per format, as the model's chat template writes calls
(no whitespace of its own around the markers; the arguments are JSON as `json.dumps` writes
it, ", " and ": " between items, no other whitespace: templates render arguments so, and a
model free to add whitespace may add it forever):

    kimi_k2      <|tool_calls_section_begin|>
                 <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>ARGS<|tool_call_end|>
                 <|tool_call_begin|>functions.NAME:1...<|tool_call_end|>
                 <|tool_calls_section_end|>
    hermes       <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>,
                 calls joined by \\n
    llama3_json  {"name": "NAME", "parameters": ARGS}, calls joined by "; "

Kimi's markers are special tokens of its tokenizer and are matched as such (a model without
them cannot take this format: ValueError); Hermes' `<tool_call>` and `</tool_call>` are
matched as special tokens where the tokenizer has them as special tokens, else as text. The
calls of a `kimi_k2` section are numbered from 0, as Kimi's template numbers them. Each
tool's schema is written once and referenced by every call position.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import llguidance

from specd.ipc.structured import ToolCall, ToolSpec

KIMI_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>")


def tool_call_grammar(call: ToolCall, tokenizer: llguidance.LLTokenizer) -> str:
    """The Lark grammar of `call`'s answer for `tokenizer`'s model. ValueError for a tool
    whose parameters are not an object schema, or a format the tokenizer cannot write."""
    tools = [t for t in call.tools if call.function is None or t.name == call.function]
    rules = [f"args_{i}: %json {json.dumps(_object_schema(t), sort_keys=True)}"
             for i, t in enumerate(tools)]
    writers: dict[str, Callable[[list[ToolSpec], int, llguidance.LLTokenizer], list[str]]] = {
        "kimi_k2": _kimi_k2, "hermes": _hermes, "llama3_json": _llama3_json}
    return "\n".join([*writers[call.format](tools, call.max_calls, tokenizer), *rules]) + "\n"


def _kimi_k2(tools: list[ToolSpec], max_calls: int, tokenizer: llguidance.LLTokenizer
             ) -> list[str]:
    missing = [m for m in KIMI_MARKERS if not _is_special(tokenizer, m)]
    if missing:
        raise ValueError(f"the kimi_k2 tool-call format needs the special tokens {missing}, "
                         "which this model's tokenizer does not have")
    section, begin, argument, end, section_end = KIMI_MARKERS
    lines = [f"start: {section} {_nested(lambda i: f'call_{i}', max_calls)} {section_end}"]
    for i in range(max_calls):
        lines.append(f"call_{i}: {begin} \"functions.\" invoke_{i} {end}")
        lines.append(f"invoke_{i}: " + " | ".join(
            f"{lark_string(f'{t.name}:{i}')} {argument} args_{k}" for k, t in enumerate(tools)))
    return lines


def _hermes(tools: list[ToolSpec], max_calls: int, tokenizer: llguidance.LLTokenizer
            ) -> list[str]:
    begin, end = (_marker(tokenizer, m) for m in ("<tool_call>", "</tool_call>"))
    return [f"start: {_nested(lambda _: 'call', max_calls, separator=lark_string(chr(10)))}",
            f"call: {begin} {lark_string(chr(10))} object {lark_string(chr(10))} {end}",
            _objects(tools, "arguments")]


def _llama3_json(tools: list[ToolSpec], max_calls: int, tokenizer: llguidance.LLTokenizer
                 ) -> list[str]:
    return [f"start: {_nested(lambda _: 'object', max_calls, separator=lark_string('; '))}",
            _objects(tools, "parameters")]


def _objects(tools: list[ToolSpec], key: str) -> str:
    """The rule `object`: one call's JSON, `{"name": "NAME", "KEY": ARGS}`."""
    return "object: " + " | ".join(
        f"{lark_string(json.dumps({'name': t.name})[:-1] + f', {json.dumps(key)}: ')} "
        f"args_{k} \"}}\"" for k, t in enumerate(tools))


def _nested(rule: Callable[[int], str], count: int, separator: str = "") -> str:
    """`R0 (SEP R1 (SEP R2)?)?` for the rules R0, R1, ... of positions 0, 1, ...: one to
    `count` of them, in order."""
    text = rule(count - 1)
    for i in range(count - 2, -1, -1):
        text = f"{rule(i)} ({separator} {text})?".replace("( ", "(")
    return text


def _object_schema(tool: ToolSpec) -> dict[str, Any]:
    """The tool's arguments schema, which must describe an object (empty: any object)."""
    schema = dict(tool.parameters)
    kind = schema.get("type", "object")
    if kind != "object":
        raise ValueError(f"tool {tool.name!r}: parameters must be an object schema, got type "
                         f"{kind!r}")
    schema["type"] = "object"
    # llguidance's own key: the JSON separators of `json.dumps`, no other whitespace.
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ",
                            "key_separator": ": "}
    return schema


def _marker(tokenizer: llguidance.LLTokenizer, text: str) -> str:
    """A marker as Lark matches it: the special token of that name, else the text."""
    return text if _is_special(tokenizer, text) else lark_string(text)


def _is_special(tokenizer: llguidance.LLTokenizer, text: str) -> bool:
    ids = tokenizer.tokenize_str(text, parse_special=True)
    return len(ids) == 1 and tokenizer.is_special_token(ids[0])


def lark_string(text: str) -> str:
    """A Lark string literal of `text` (JSON's escapes are Lark's)."""
    return json.dumps(text)
