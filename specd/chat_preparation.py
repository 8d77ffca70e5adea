"""What a tokenizer class's `apply_chat_template` computes before its chat template renders.

A model's tokenizer code may change a chat request on its way to the template; specd reads
what it does from that code as data (`tokenizer_code.py`) and does the same here, with its
own implementation. The steps Kimi's classes take, in the order their code takes them:

* `SORT_TOOLS` (Kimi-K2's and K2.5's `deep_sort_dict(tools)`): every map in `tools`, at any
  depth, gets its keys in sorted order; lists keep theirs. The template's `tools | tojson`
  then writes the keys sorted.
* `TYPESCRIPT_TOOLS` (K2.5's `encode_tools_to_typescript_style`): when `tools` is non-empty,
  the template variable `tools_ts_str` is the TypeScript declaration of the tools
  (`kimi_tools.py`). A tool schema that has no declaration leaves `tools_ts_str` out, as the
  model's code does (it catches the error and the template declares the tools as JSON); specd
  logs why. A `tools_ts_str` the client sets in `chat_template_kwargs` is kept as given.

`defaults`: the keyword arguments of that `apply_chat_template` (besides transformers' own)
with the values the method always hands on to the template, e.g. K2.5's `thinking=True`: a
template variable has that value unless the request's `chat_template_kwargs` sets it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specd.chat_template import TemplateError
from specd.kimi_tools import ToolDeclarationError, typescript_tools
from specd.logs import log_event

log = logging.getLogger("specd.chat")

SORT_TOOLS = "sort_tools"
TYPESCRIPT_TOOLS = "typescript_tools"
STEPS = (SORT_TOOLS, TYPESCRIPT_TOOLS)
TYPESCRIPT_VARIABLE = "tools_ts_str"


class PreparationError(TemplateError):
    """The request's tools cannot be prepared as the model's code would (nested too deeply
    to sort)."""


@dataclass(frozen=True)
class ChatPreparation:
    """The steps (in order) and the template defaults of one tokenizer class; the empty
    preparation hands tools and kwargs on unchanged. `source` names the file they were read
    from (empty when none was)."""

    steps: tuple[str, ...] = ()
    defaults: tuple[tuple[str, Any], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown:
            raise ValueError(f"unknown chat preparation steps {unknown}; known: {list(STEPS)}")

    def prepare(self, tools: Sequence[Mapping[str, Any]] | None,
                template_kwargs: Mapping[str, Any]
                ) -> tuple[list[Any] | None, dict[str, Any]]:
        """(the tools the template sees, the template variables from the kwargs) for a
        request's `tools` and `chat_template_kwargs`. Raises PreparationError."""
        prepared: list[Any] | None = None if tools is None else list(tools)
        variables = {**dict(self.defaults), **template_kwargs}
        for step in self.steps:
            if step == SORT_TOOLS:
                prepared = _sorted_deep(prepared)
            elif prepared and TYPESCRIPT_VARIABLE not in template_kwargs:
                declaration = self._typescript(prepared)
                if declaration is not None:
                    variables[TYPESCRIPT_VARIABLE] = declaration
        return prepared, variables

    def _typescript(self, tools: list[Any]) -> str | None:
        try:
            return typescript_tools(tools)
        except ToolDeclarationError as exc:
            log_event(log, logging.WARNING, "tools_declared_as_json",
                      "a tool has no TypeScript declaration: the chat template declares the "
                      "tools as JSON, as the model's own tokenizer code does",
                      reason=str(exc), source=self.source)
            return None


def _sorted_deep(value: Any) -> Any:
    """`value` with the keys of every map in it sorted (lists keep their order)."""
    try:
        return _sort(value)
    except RecursionError as exc:
        raise PreparationError("tools are nested too deeply to sort") from exc


def _sort(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _sort(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sort(item) for item in value]
    return value
