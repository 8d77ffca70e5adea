"""Structured output: the constraint a request's output must satisfy (`SamplingParams.structured`).

One tagged union (`"type"` names the kind), validated here, shared by the wire, the front and
the engine like the rest of `SamplingParams`. Nothing here compiles a grammar: the scheduler
does (workers/structured/), against the model's own tokenizer, and refuses a constraint it
cannot compile (`bad_request`). No torch, no grammar library.

* `json_schema`: the output is one JSON value valid for `schema` (a JSON Schema object).
* `json_object`: the output is one JSON object (any keys and values).
* `regex`: the output matches `pattern` whole (Rust `regex` syntax, as vLLM's `guided_regex`).
* `grammar`: the output is a sentence of `grammar`, a context-free grammar in Lark syntax or
  in llama.cpp's GBNF (vLLM's `guided_grammar`; EBNF with `::=` rules is GBNF).
* `choice`: the output is exactly one of `choices` (vLLM's `guided_choice`).
* `tool_call`: the output is one or more calls of `tools`, in the model's own tool-call
  format (`format`, one of TOOL_CALL_FORMATS), each call's arguments a JSON object valid for
  that tool's `parameters`; `function` names the one tool that must be called (once), else
  any of them may be, up to MAX_PARALLEL_CALLS times (once without `parallel`). This is how
  `tool_choice` `required` and a named function are served.

For the two JSON kinds, `any_whitespace` (default true) allows any JSON whitespace between
tokens; false writes none (vLLM's `disable_any_whitespace`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

# The tool-call formats a `tool_call` constraint can write, by the names `--tool-call-parser`
# takes (the front's parsers read the same formats back):
#   kimi_k2:     <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
#                <|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>
#                (the markers are special tokens of Kimi's tokenizer)
#   hermes:      <tool_call>\n{"name": NAME, "arguments": {json}}\n</tool_call>, one per call
#   llama3_json: {"name": NAME, "parameters": {json}}, calls joined by "; "
TOOL_CALL_FORMATS = ("kimi_k2", "hermes", "llama3_json")
MAX_PARALLEL_CALLS = 8  # calls one constrained answer may hold (parallel tool calls)
MAX_TOOLS = 256
MAX_GRAMMAR_CHARS = 1 << 20  # a regex or grammar's text
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1 << 16
# OpenAI's rule for function names; it also keeps them unambiguous inside every format
# (Kimi's call id `functions.NAME:IDX` splits at the last ":").
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

GrammarText = Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)]


class _Constraint(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True,
                  tag_field="type"):
    """Every kind is a map whose `"type"` names it."""


class JsonSchema(_Constraint, frozen=True, tag="json_schema"):
    schema: dict[str, Any]
    any_whitespace: bool = True


class JsonObject(_Constraint, frozen=True, tag="json_object"):
    any_whitespace: bool = True


class Regex(_Constraint, frozen=True, tag="regex"):
    pattern: GrammarText


class Grammar(_Constraint, frozen=True, tag="grammar"):
    grammar: GrammarText


class Choice(_Constraint, frozen=True, tag="choice"):
    choices: Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_CHOICE_CHARS)]],
                       Meta(min_length=1, max_length=MAX_CHOICES)]


class ToolSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One callable tool: its name and the JSON Schema of its arguments (an object; empty:
    any object)."""

    name: str
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if TOOL_NAME.fullmatch(self.name) is None:
            raise ValueError(f"tool names must match [A-Za-z0-9_-]{{1,64}}, got {self.name!r}")


class ToolCall(_Constraint, frozen=True, tag="tool_call"):
    format: str
    tools: Annotated[list[ToolSpec], Meta(min_length=1, max_length=MAX_TOOLS)]
    function: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.format not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool-call format must be one of {list(TOOL_CALL_FORMATS)}, got "
                             f"{self.format!r}")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        if self.function is not None and self.function not in names:
            raise ValueError(f"function {self.function!r} is not one of the tools {names}")

    @property
    def max_calls(self) -> int:
        """The most calls the answer may hold."""
        return 1 if self.function is not None or not self.parallel else MAX_PARALLEL_CALLS


StructuredOutput = JsonSchema | JsonObject | Regex | Grammar | Choice | ToolCall
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "tool_call")


def cache_key(constraint: StructuredOutput) -> bytes:
    """A key equal for equal constraints (maps compared by content, key order ignored): the
    scheduler compiles each distinct constraint once."""
    return msgspec.json.encode(msgspec.to_builtins(constraint), order="sorted")
