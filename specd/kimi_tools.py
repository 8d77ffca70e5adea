"""Tool definitions as Kimi-K2.5 declares them to its chat template: a TypeScript namespace.

Kimi-K2.5's tokenizer code turns the request's `tools` (OpenAI function tools, JSON schemas)
into one string before the template renders, and passes it as the template variable
`tools_ts_str`; its template prints that string in the tool declaration (its JSON `tools`
only when the string is empty or absent). This module writes the same string from the same
tools; the model's own code is never run. The shape, for `get_weather(city, unit?)`:

    # Tools

    ## functions
    namespace functions {
    // Get the weather
    type get_weather = (_: {
      // City name
      city: string,
      unit?: "c" | "f"
    }) => any;
    }

How each JSON schema reads (`_parse` dispatches in this order):

* `true` is `any`, `false` is `null`; `{}` is `any`.
* `$ref`: `#` is the function's own parameters (named `parameters`, declared once as an
  `interface parameters`), `#/$defs/NAME` is `NAME` (the definition must be registered by a
  `$defs` met earlier in the walk); any other reference is an error.
* `anyOf`: its members joined with ` | `. `enum`: its values (strings quoted as they are,
  other values as Python prints them), checked against a `type` given beside them.
* `type` a list: the types joined with ` | ` (`object` is `{}`, `array` is `Array<any>`,
  `integer` is `number`). `object`: its properties, required ones first, each group sorted
  by name, `[k: string]: T` for `additionalProperties`. `array`: `Array<T>` of `items`.
  `integer` is `number`; any other type name is printed as it is.
* Anything else (a schema with neither of these keys, `oneOf`, `allOf`, `const`, ...) is an
  error: the model's code then sends no `tools_ts_str`, and the template declares the tools
  as JSON (`chat_preparation.py` does the same, logging why).

Comments: a schema's `description` becomes `// ` lines above the field or type it
describes (an empty line stays empty); `minLength`, `maxLength` and `pattern` (strings),
`minimum` and `maximum` (numbers), `minItems` and `maxItems` (arrays) one `// k: v, ...`
line after it, sorted by key; a property's `default` a `// Default: v` line (JSON for
strings, lists and maps; numbers and booleans as Python prints them). Each definition of
`$defs` becomes an `interface NAME T` above the function's type, its description above it.
Tools whose `type` is not `"function"`, or that have no function, are left out; with no
function left, the string is empty.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

INDENT = "  "
FIELD_SEPARATOR = ",\n"
SELF_REFERENCE = "#"
DEFINITION_PREFIX = "#/$defs/"
ROOT_INTERFACE = "parameters"
# The TypeScript spelling of each JSON type in a list of types.
UNION_NAMES = {"string": "string", "number": "number", "integer": "number",
               "boolean": "boolean", "null": "null", "object": "{}", "array": "Array<any>"}
# The keys each kind of schema shows as a constraints comment.
STRING_CONSTRAINTS = ("maxLength", "minLength", "pattern")
NUMBER_CONSTRAINTS = ("maximum", "minimum")
ARRAY_CONSTRAINTS = ("minItems", "maxItems")


class ToolDeclarationError(ValueError):
    """A tool or schema that has no TypeScript declaration (the template then gets JSON)."""


@dataclass(frozen=True)
class _Doc:
    """What is said about a type in comments: its description (as given: checked when it is
    printed, since some descriptions never are) and its constraints."""

    description: Any = None
    constraints: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class _Named:
    """A type printed by name: a scalar (`string`, `any`, ...) or a reference."""

    name: str
    doc: _Doc = _Doc()


@dataclass(frozen=True)
class _Joined:
    """Alternatives printed joined with ` | ` (enum values, anyOf members, type lists)."""

    parts: tuple[Any, ...]  # strings, or types to render
    doc: _Doc = _Doc()


@dataclass(frozen=True)
class _Array:
    item: Any  # a type
    doc: _Doc = _Doc()


@dataclass(frozen=True)
class _Field:
    name: str
    type: Any
    optional: bool
    default: Any


@dataclass(frozen=True)
class _Object:
    fields: tuple[_Field, ...] = ()
    # None (no additionalProperties), True, False, a type, or another value (an error
    # when printed)
    extra: Any = None
    doc: _Doc = _Doc()


@dataclass
class _Walk:
    """The state of one function's walk: `$defs` met so far, and whether `#` was used."""

    definitions: dict[str, Any] = field(default_factory=dict)
    uses_self: bool = False


def typescript_tools(tools: Sequence[Any]) -> str:
    """The `tools_ts_str` of `tools` (module docstring); "" when no function tool is left.
    Raises ToolDeclarationError for a tool or schema that has no declaration."""
    functions = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise ToolDeclarationError(f"a tool is a map, got {type(tool).__name__}")
        function = tool.get("function") or {}
        if tool.get("type") != "function" or not function:
            continue
        if not isinstance(function, Mapping):
            raise ToolDeclarationError(f"a tool's function is a map, got "
                                       f"{type(function).__name__}")
        try:
            functions.append(_function(function))
        except RecursionError as exc:
            raise ToolDeclarationError("a tool's schema is nested too deeply") from exc
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"


def _function(function: Mapping[str, Any]) -> str:
    walk = _Walk()
    parameters = _object(function.get("parameters") or {}, walk)
    uses_self = walk.uses_self  # a `#` met only inside a definition does not count
    interfaces = []
    if uses_self:
        body = FIELD_SEPARATOR.join(_field(f, INDENT) for f in parameters.fields)
        interfaces.append(f"interface {ROOT_INTERFACE} {{" + (f"\n{body}\n" if body else "")
                          + "}")
    for name, schema in list(walk.definitions.items()):
        rendered = _render(_parse(schema, walk), "")
        description = _description(_get(schema, "description"))
        above = _comment(description) + "\n" if description else ""
        interfaces.append(f"{above}interface {name} {rendered}")
    argument = ROOT_INTERFACE if uses_self else _render(parameters, "")
    description = _description(function.get("description"))
    return "\n".join(part for part in (
        "\n".join(interfaces), _comment(description) if description else "",
        f"type {function.get('name', 'function')} = (_: {argument}) => any;") if part)


def _parse(schema: Any, walk: _Walk) -> Any:
    """The type a JSON schema declares (module docstring for the order of the rules)."""
    if isinstance(schema, bool):
        return _Named("any" if schema else "null")
    if not isinstance(schema, Mapping):
        raise ToolDeclarationError(f"a schema is a map or a boolean, got {schema!r}")
    if "$ref" in schema:
        return _Named(_reference(schema["$ref"], walk), _doc(schema))
    if "anyOf" in schema:
        members = _list(schema["anyOf"], "anyOf")
        return _Joined(tuple(_parse(member, walk) for member in members), _doc(schema))
    if "enum" in schema:
        values = _list(schema["enum"], "enum")
        if "type" in schema:
            _check_enum(values, schema["type"])
        return _Joined(tuple(f'"{v}"' if isinstance(v, str) else str(v) for v in values),
                       _doc(schema))
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, list):
            names = [UNION_NAMES.get(k) if isinstance(k, str) else None for k in kind]
            if None in names:
                raise ToolDeclarationError(f"type list {kind!r}: each type is one of "
                                           f"{sorted(UNION_NAMES)}")
            return _Joined(tuple(names), _doc(schema))
        if kind == "object":
            return _object(schema, walk)
        if kind == "array":
            items = schema.get("items")
            item = _parse(items, walk) if items else _Named("any")
            return _Array(item, _doc(schema, ARRAY_CONSTRAINTS))
        if not isinstance(kind, str):
            raise ToolDeclarationError(f"type {kind!r} is not a string")
        keys = (STRING_CONSTRAINTS if kind == "string"
                else NUMBER_CONSTRAINTS if kind in ("number", "integer") else ())
        return _Named("number" if kind == "integer" else kind, _doc(schema, keys))
    if not schema:
        return _Named("any")
    raise ToolDeclarationError(f"schema {dict(schema)!r} has none of $ref, anyOf, enum, type")


def _object(schema: Any, walk: _Walk) -> _Object:
    """An object's fields; also the function's parameters, whatever their `type` says."""
    if not isinstance(schema, Mapping):
        raise ToolDeclarationError(f"parameters are a map, got {schema!r}")
    doc = _doc(schema)
    if not schema:
        return _Object(doc=doc)
    definitions = schema.get("$defs")
    if definitions:
        if not isinstance(definitions, Mapping):
            raise ToolDeclarationError("$defs is a map of schemas")
        walk.definitions.update(definitions)
    extra = schema.get("additionalProperties")
    if isinstance(extra, Mapping):
        extra = _parse(extra, walk)
    if "properties" not in schema:
        return _Object(extra=extra, doc=doc)
    properties = schema["properties"]
    if not isinstance(properties, Mapping):
        raise ToolDeclarationError("properties is a map of schemas")
    try:
        required = set(schema.get("required", []))
    except TypeError as exc:
        raise ToolDeclarationError(f"required {schema.get('required')!r} is not a list of "
                                   "names") from exc
    fields = tuple(_Field(name, _parse(prop, walk), name not in required,
                          prop.get("default") if isinstance(prop, Mapping) else None)
                   for name, prop in properties.items())
    return _Object(fields, extra, doc)


def _reference(ref: Any, walk: _Walk) -> str:
    if ref == SELF_REFERENCE:
        walk.uses_self = True
        return ROOT_INTERFACE
    if isinstance(ref, str) and ref.startswith(DEFINITION_PREFIX):
        name = ref.split("/")[-1]
        if name not in walk.definitions:
            raise ToolDeclarationError(f"$ref {ref!r}: no such definition (yet) in $defs")
        return name
    raise ToolDeclarationError(f"$ref {ref!r}: only '#' and '#/$defs/NAME' are declared")


def _check_enum(values: list[Any], kind: Any) -> None:
    """An enum's values must have the type given beside them (a list of one type, or of a
    type and "null", names that type); null values always pass."""
    if isinstance(kind, list):
        if not (len(kind) == 1 or (len(kind) == 2 and "null" in kind)):
            raise ToolDeclarationError(f"enum with type {kind!r}: one type, or one and null")
        kind = kind[1] if kind[0] == "null" and len(kind) == 2 else kind[0]
    checks = {"string": lambda v: isinstance(v, str),
              "number": lambda v: isinstance(v, int | float),
              "integer": lambda v: isinstance(v, int),
              "boolean": lambda v: isinstance(v, bool)}
    check = checks.get(kind) if isinstance(kind, str) else None
    bad = [v for v in values if v is not None and check is not None and not check(v)]
    if bad:
        raise ToolDeclarationError(f"enum value {bad[0]!r} is not of type {kind!r}")


def _render(node: Any, indent: str) -> str:
    """A type as TypeScript, its nested lines indented one step further than `indent`."""
    if isinstance(node, _Named):
        return node.name
    if isinstance(node, _Joined):
        return " | ".join(p if isinstance(p, str) else _render(p, indent) for p in node.parts)
    if isinstance(node, _Array):
        inner = indent + INDENT
        comments = _comments(node.item.doc, inner)
        if comments:
            return f"Array<\n{comments}{inner}{_render(node.item, inner)}\n{indent}>"
        return f"Array<{_render(node.item, indent)}>"
    inner = indent + INDENT
    ordered = sorted(node.fields, key=lambda f: (f.optional, f.name))
    lines = [_field(f, inner) for f in ordered]
    if node.extra is not None:
        lines.append(f"{inner}[k: string]: {_extra(node.extra, inner)}")
    if not lines:
        return "{}"
    return "{\n" + FIELD_SEPARATOR.join(lines) + f"\n{indent}}}"


def _extra(extra: Any, indent: str) -> str:
    if extra is True:
        return "any"
    if extra is False:
        return "never"
    if isinstance(extra, _Named | _Joined | _Array | _Object):
        return _render(extra, indent)
    raise ToolDeclarationError(f"additionalProperties {extra!r} is neither a boolean nor "
                               "a schema")


def _field(f: _Field, indent: str) -> str:
    """One property: its comments, its default, then `name?: type`."""
    text = _comments(f.type.doc, indent)
    if f.default is not None:
        shown = (repr(f.default) if isinstance(f.default, int | float)
                 else json.dumps(f.default, ensure_ascii=False))
        text += f"{indent}// Default: {shown}\n"
    return f"{text}{indent}{f.name}{'?' if f.optional else ''}: {_render(f.type, indent)}"


def _comments(doc: _Doc, indent: str) -> str:
    lines = []
    description = _description(doc.description)
    if description:
        lines.append(_comment(description, indent))
    if doc.constraints:
        lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in doc.constraints))
    return "".join(line + "\n" for line in lines)


def _comment(text: str, indent: str = "") -> str:
    """`text` as `// ` lines; an empty line stays empty (no indent, no slashes)."""
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _doc(schema: Mapping[str, Any], constraint_keys: Sequence[str] = ()) -> _Doc:
    constraints = tuple(sorted((k, v) for k, v in schema.items() if k in constraint_keys))
    return _Doc(schema.get("description"), constraints)


def _description(value: Any) -> str:
    if value and not isinstance(value, str):
        raise ToolDeclarationError(f"description {value!r} is not a string")
    return value or ""


def _get(schema: Any, key: str) -> Any:
    if not isinstance(schema, Mapping):
        raise ToolDeclarationError(f"a $defs entry is a map, got {schema!r}")
    return schema.get(key)


def _list(value: Any, key: str) -> list[Any]:
    if not isinstance(value, list):
        raise ToolDeclarationError(f"{key} is a list, got {value!r}")
    return value
