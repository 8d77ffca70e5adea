"""Compiling a request's constraint (ipc/structured.py) into a grammar matcher, once per
distinct constraint.

The grammar library is llguidance: every kind becomes an llguidance grammar (JSON Schema
through its JSON compiler, regexes and choices as Lark, GBNF converted to Lark, tool calls
as tool_grammar.py writes them) and is compiled against the model's vocabulary
(vocabulary.py) into an `LLMatcher`. A constraint that does not compile is a ValueError
naming its kind and the library's message (the request is refused `bad_request`).

`GrammarCompiler.matcher(constraint)` returns a fresh matcher in the start state: a copy of a
compiled one kept in a cache (least recently used out past `max_cached`), so the same schema
sent by many requests is parsed and compiled once. llguidance builds its lexer lazily, so
compiling costs about a millisecond for ordinary schemas; the work of a pathological one is
bounded by llguidance's parser limits (grammar size, lexer fuel per step), past which
compiling fails or the request's grammar fails while it runs.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance

from specd.ipc.structured import (
    Choice,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    StructuredOutput,
    ToolCall,
    cache_key,
)
from specd.workers.structured.tool_grammar import lark_string, tool_call_grammar

if TYPE_CHECKING:  # the type lives in llguidance's stub only
    from llguidance._lib import JsonCompileOptions

DEFAULT_MAX_CACHED = 256


class GrammarCompiler:
    """Constraints -> matchers for one vocabulary, with a cache of compiled grammars."""

    def __init__(self, tokenizer: llguidance.LLTokenizer,
                 max_cached: int = DEFAULT_MAX_CACHED) -> None:
        self.tokenizer = tokenizer
        self.max_cached = max_cached
        self._compiled: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()
        self.num_compiled = 0  # figures: grammars compiled, and matchers taken from the cache
        self.num_cache_hits = 0

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A matcher of `constraint` in its start state. ValueError if it does not compile."""
        key = cache_key(constraint)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(constraint)
            self.num_compiled += 1
            self._compiled[key] = compiled
            if len(self._compiled) > self.max_cached:
                self._compiled.popitem(last=False)
        else:
            self.num_cache_hits += 1
            self._compiled.move_to_end(key)
        return compiled.deep_copy()

    def _compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        try:
            grammar = grammar_text(constraint, self.tokenizer)
        except ValueError as exc:
            raise ValueError(f"structured output ({constraint_kind(constraint)}): {exc}") from exc
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output ({constraint_kind(constraint)}) does not "
                             f"compile: {_first_lines(matcher.get_error())}")
        return matcher


def grammar_text(constraint: StructuredOutput, tokenizer: llguidance.LLTokenizer) -> str:
    """The llguidance grammar of `constraint` (ValueError when it cannot be written)."""
    if isinstance(constraint, JsonSchema | JsonObject):
        schema: dict[str, Any] = (constraint.schema if isinstance(constraint, JsonSchema)
                                  else {"type": "object"})
        overrides: JsonCompileOptions | None = (
            None if constraint.any_whitespace else {"whitespace_flexible": False})
        text: str = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
        return text
    if isinstance(constraint, Regex):
        return str(llguidance.LLMatcher.grammar_from_regex(constraint.pattern))
    if isinstance(constraint, Grammar):
        return llguidance.grammar_from("grammar", constraint.grammar)
    if isinstance(constraint, Choice):
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(lark_string(c) for c in constraint.choices))
    if isinstance(constraint, ToolCall):
        return llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(constraint, tokenizer))
    raise TypeError(f"not a structured-output constraint: {constraint!r}")


def constraint_kind(constraint: StructuredOutput) -> str:
    """The constraint's `type` tag (json_schema, regex, ...)."""
    return str(type(constraint).__struct_config__.tag)


def _first_lines(message: str, num_lines: int = 6) -> str:
    """The head of a library message (its tail repeats the whole grammar)."""
    lines = message.strip().splitlines()
    return "\n".join(lines[:num_lines]) + ("\n..." if len(lines) > num_lines else "")
