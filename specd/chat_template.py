"""A model's chat templates, found and rendered the way transformers finds and renders them.

Where the templates come from (transformers' order): `chat_template.jinja` beside the model
(the template named "default") and `additional_chat_templates/*.jinja` (named by their file
names); only when neither exists, `tokenizer_config.json`'s `chat_template`: one string, or
a list of `{"name", "template"}`. Which one renders: with a single template, that one; with
several, "tool_use" when tools are given and the model has it, else "default".

How it renders: a sandboxed jinja2 environment (`ImmutableSandboxedEnvironment`,
`trim_blocks`, `lstrip_blocks`, the `loopcontrols` extension) with transformers' globals
(`raise_exception`, `strftime_now`, `dict`, `namespace`), its `tojson` filter (no HTML
escaping, `indent`, `separators`, `sort_keys`) and a no-op `{% generation %}` tag, given
`messages`, `tools`, `documents`, `add_generation_prompt` and the named special tokens
(`bos_token`, `eos_token`, ...), which template kwargs may override. Message keys whose
value is None are dropped first, as transformers does (templates test for absent keys).

An assistant's earlier reasoning comes as `reasoning_content` (vLLM's and SGLang's responses)
or `reasoning` (vLLM's request field); templates read one name or the other (Kimi's, Qwen's
and GLM's read `reasoning_content`), so a message that has one gets the other with the same
value, as vLLM fills both from `reasoning`.

Content given as a list of text parts (`[{"type": "text", "text": ...}]`) reaches a
template that reads parts (one that looks up a `text` key or attribute anywhere) as it is;
for a template that never reads a part's text, which could only print the list, the parts'
texts are joined with newlines into one string (as vLLM does for such templates).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
# The named special tokens transformers passes to every template (when the tokenizer has them).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
REASONING_KEYS = ("reasoning_content", "reasoning")


class TemplateError(ValueError):
    """The chat template raised, or the model has none that fits the request."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for rendering a prompt it is its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace`, refusing underscore names as transformers' does (no way to
    reach CPython internals through a namespace's attributes)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's signature
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore names on a namespace: {name!r}")


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """One compiled template. Raises TemplateError when its source does not parse."""

    def __init__(self, name: str, source: str) -> None:
        env = _environment()
        try:
            ast = env.parse(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template {name!r} does not parse: {exc}") from exc
        self.name = name
        self.source = source
        self.reads_text_parts = any(
            (isinstance(node, nodes.Getattr) and node.attr == "text")
            or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
                and node.arg.value == "text")
            for node in ast.find_all((nodes.Getattr, nodes.Getitem)))
        self._template = env.from_string(ast)

    def render(self, messages: Sequence[Message], variables: Mapping[str, Any]) -> str:
        """The text for `messages` with the template `variables` (tools, special tokens,
        add_generation_prompt, ...). Raises TemplateError for anything the template raised."""
        chat = [self._message(i, message) for i, message in enumerate(messages)]
        try:
            return self._template.render({**variables, "messages": chat})
        except TemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template is user code; any error is its own
            raise TemplateError(f"{type(exc).__name__}: {exc}") from exc

    def _message(self, index: int, message: Message) -> dict[str, Any]:
        if not isinstance(message, Mapping) or "role" not in message:
            raise TemplateError(f"messages[{index}] must be a mapping with a 'role'")
        out = {key: value for key, value in message.items() if value is not None}
        given = [key for key in REASONING_KEYS if key in out]
        if len(given) == 1:
            out.update(dict.fromkeys(REASONING_KEYS, out[given[0]]))
        content = out.get("content")
        if isinstance(content, list) and not self.reads_text_parts:
            out["content"] = "\n".join(str(part.get("text", "")) for part in content)
        return out


class ChatTemplates:
    """A model's chat templates by name (empty when it has none)."""

    def __init__(self, sources: Mapping[str, str]) -> None:
        self.templates = {name: ChatTemplate(name, source) for name, source in sources.items()}

    @classmethod
    def from_dir(cls, root: Path, config: Mapping[str, Any]) -> ChatTemplates:
        """The templates of the model in `root`; `config` is its tokenizer_config.json."""
        sources: dict[str, str] = {}
        if (root / TEMPLATE_FILE).is_file():
            sources["default"] = _read(root / TEMPLATE_FILE)
        if (root / TEMPLATE_DIR).is_dir():
            for path in sorted((root / TEMPLATE_DIR).glob("*.jinja")):
                sources[path.name.removesuffix(".jinja")] = _read(path)
        if sources:
            return cls(sources)
        field = config.get("chat_template")
        if isinstance(field, str):
            return cls({"default": field})
        if isinstance(field, list):
            named = {item.get("name"): item.get("template") for item in field
                     if isinstance(item, Mapping)}
            return cls({str(k): v for k, v in named.items() if isinstance(v, str)})
        return cls({})

    def select(self, has_tools: bool) -> ChatTemplate:
        """The template for a request: the only one, else "tool_use" when tools are given
        and the model has it, else "default". Raises TemplateError when there is none."""
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        if has_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if not self.templates:
            raise TemplateError(f"this model has no chat template ({TEMPLATE_FILE} or "
                                "tokenizer_config.json's chat_template)")
        raise TemplateError(f"this model has several chat templates and none named "
                            f"'default': {sorted(self.templates)}")


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8: {exc}") from exc
