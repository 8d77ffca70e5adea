"""Kimi-K2.5's TypeScript tool declaration (`specd/kimi_tools.py`), string for string against
the model's own `tool_declaration_ts.py` as tinker-cookbook ships it (`pip install --no-deps
tinker-cookbook==0.6.1`: its `renderers/kimi_k2_5_tool_declaration_ts.py` is "copied from
kimi-k2.5-hf-tokenizer/tool_declaration_ts.py" and imports only the standard library; it is
loaded by path, never through the package's `__init__`, whose dependencies are heavy).

Where the reference raises (any exception: the model's code then declares the tools as JSON),
specd raises ToolDeclarationError."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from specd.kimi_tools import ToolDeclarationError, typescript_tools

REFERENCE_FILE = Path("renderers") / "kimi_k2_5_tool_declaration_ts.py"


def _reference() -> ModuleType | None:
    spec = importlib.util.find_spec("tinker_cookbook")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / REFERENCE_FILE
    if not path.is_file():
        return None
    module_spec = importlib.util.spec_from_file_location("kimi_tool_declaration_ts", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


REFERENCE = _reference()
needs_reference = pytest.mark.skipif(
    REFERENCE is None, reason="tinker-cookbook is not installed (pip install --no-deps "
    "tinker-cookbook==0.6.1): it ships the reference tool_declaration_ts.py")


def fn(name: str, parameters: Any = None, description: Any = None, **extra: Any
       ) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, **extra}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def obj(properties: dict[str, Any], required: Any = None, **extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties, **extra}
    if required is not None:
        schema["required"] = required
    return schema


WEATHER = fn("get_weather", obj({
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
    "city": {"type": "string", "description": "City name"},
    "days": {"type": "integer", "minimum": 1, "maximum": 14, "default": 3}}, ["city"]),
    "Get the weather\n\nfor a city")

# name -> tools: every kind of schema the declaration knows, and the ones it refuses.
CASES: dict[str, list[Any]] = {
    "weather": [WEATHER],
    "two functions": [WEATHER, fn("get_time", obj({"tz": {"type": "string"}}), "Time")],
    "no parameters": [fn("ping")],
    "empty parameters": [fn("ping", {}, "Ping")],
    "object without properties": [fn("noop", {"type": "object"})],
    "parameters without a type": [fn("f", {"properties": {"a": {"type": "string"}}})],
    "nested objects": [fn("create_user", obj({
        "user": obj({"name": {"type": "string", "minLength": 1, "maxLength": 64,
                              "pattern": "^[a-z]+$"},
                     "address": obj({"zip": {"type": "string"}, "line": {"type": "string"}},
                                    ["line"], description="Where\nthey live")},
                    ["name"], description="The user"),
        "notify": {"type": "boolean", "default": False}}, ["user"]))],
    "arrays": [fn("tag", obj({
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        "described": {"type": "array", "items": {"type": "string", "description": "A tag"}},
        "objects": {"type": "array", "description": "Rows",
                    "items": obj({"id": {"type": "integer"}}, ["id"], description="A row")},
        "untyped": {"type": "array"}, "empty_items": {"type": "array", "items": {}}}))],
    "enums": [fn("pick", obj({
        "colour": {"enum": ["red", "green"], "description": "Colour"},
        "size": {"type": "integer", "enum": [1, 2, 3]},
        "ratio": {"type": "number", "enum": [0.5, 1, 2.25]},
        "flag": {"type": "boolean", "enum": [True, False]},
        "maybe": {"type": ["string", "null"], "enum": ["a", None]},
        "null_first": {"type": ["null", "string"], "enum": [None, "b"]},
        "untyped": {"enum": ["x", 1, None, True]}}, ["colour"]))],
    "anyOf and type lists": [fn("union", obj({
        "id": {"anyOf": [{"type": "string"}, {"type": "integer"}], "description": "An id"},
        "value": {"type": ["string", "number", "integer", "boolean", "null", "object",
                           "array"]},
        "nested": {"anyOf": [obj({"a": {"type": "string"}}), {"type": "array",
                                                              "items": {"type": "string"}},
                             {"type": "null"}]},
        "none": {"anyOf": []}}))],
    "$defs and $ref": [fn("order", obj({
        "item": {"$ref": "#/$defs/Item", "description": "What to order"},
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
        "colour": {"$ref": "#/$defs/Colour"}}, ["item"],
        **{"$defs": {"Item": obj({"sku": {"type": "string"}, "qty": {"type": "integer"}},
                                 ["sku"], description="An item\nin stock"),
                     "Colour": {"enum": ["red", "blue"]}}}), "Place an order")],
    "self reference": [fn("tree", obj({
        "value": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}},
        "a_first": {"type": "integer"}}, ["value"]), "A tree")],
    "self reference and $defs": [fn("graph", obj({
        "node": {"$ref": "#/$defs/Node"}, "next": {"$ref": "#"}},
        **{"$defs": {"Node": obj({"id": {"type": "string"}})}}))],
    "self reference only inside a definition": [fn("g", obj(
        {"n": {"$ref": "#/$defs/N"}}, **{"$defs": {"N": obj({"up": {"$ref": "#"}})}}))],
    "additionalProperties": [fn("meta", obj({
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "additionalProperties": True},
        "closed": obj({"a": {"type": "string"}}, additionalProperties=False),
        "any_schema": {"type": "object", "additionalProperties": {}},
        "typed": {"type": "object", "additionalProperties": obj(
            {"x": {"type": "number"}}, description="A point")}}))],
    "boolean schemas": [fn("b", obj({"anything": True, "nothing": False}))],
    "defaults": [fn("d", obj({
        "s": {"type": "string", "default": "héllo \"q\""}, "i": {"type": "integer", "default": 0},
        "f": {"type": "number", "default": 1.5}, "b": {"type": "boolean", "default": True},
        "l": {"type": "array", "default": [1, "two", None]},
        "m": {"type": "object", "default": {"k": [1.0, False]}},
        "n": {"type": "string", "default": None}}))],
    "descriptions with blank lines and unicode": [fn(
        "u", obj({"q": {"type": "string", "description": "Line one\n\nline «three»\n"}}),
        "Première ligne\n\n  indented\n")],
    "scalars of every kind": [fn("s", obj({
        "a": {"type": "string"}, "b": {"type": "number", "minimum": 0.5},
        "c": {"type": "integer", "maximum": 10}, "d": {"type": "boolean"},
        "e": {"type": "null"}, "f": {"type": "custom_thing", "minimum": 1},
        "g": {}}))],
    "required names that are not properties": [fn("r", obj({"a": {"type": "string"}},
                                                           ["a", "zzz"]))],
    "non-function tools are left out": [{"type": "_plugin", "name": "x"}, WEATHER,
                                        {"type": "function"}],
    "only non-function tools": [{"type": "_plugin", "_plugin": {"name": "x"}}],
    "no tools": [],
    "function without a name": [{"type": "function", "function": {"description": "anon"}}],
}
# Schemas the reference cannot declare: it raises, and so does specd.
REFUSED: dict[str, list[Any]] = {
    "oneOf": [fn("o", obj({"x": {"oneOf": [{"type": "string"}, {"type": "integer"}]}}))],
    "description only": [fn("o", obj({"x": {"description": "no type"}}))],
    "const": [fn("o", obj({"x": {"const": 3}}))],
    "ref to definitions": [fn("o", obj({"x": {"$ref": "#/definitions/X"}},
                                       definitions={"X": {"type": "string"}}))],
    "ref to a missing definition": [fn("o", obj({"x": {"$ref": "#/$defs/Missing"}}))],
    "enum of the wrong type": [fn("o", obj({"x": {"type": "string", "enum": ["a", 1]}}))],
    "enum with three types": [fn("o", obj({"x": {"type": ["string", "integer", "null"],
                                                 "enum": ["a"]}}))],
    "unknown type in a list": [fn("o", obj({"x": {"type": ["string", "date"]}}))],
    "bad additionalProperties": [fn("o", obj({"x": {"type": "object",
                                                    "additionalProperties": "yes"}}))],
    "properties as a list": [fn("o", {"type": "object", "properties": [{"type": "string"}]})],
    "required not a list": [fn("o", {"type": "object", "properties": {"x": {"type": "string"}},
                                     "required": None})],
    "a schema that is a string": [fn("o", obj({"x": "string"}))],
    "parameters as a list": [fn("o", [{"type": "string"}])],
    "tool not a map": ["get_weather"],
    "description not a string": [fn("o", obj({"x": {"type": "string", "description": 5}}))],
}


def rendered(tools: list[Any]) -> str:
    return typescript_tools(copy.deepcopy(tools))


@needs_reference
@pytest.mark.parametrize("name", sorted(CASES))
def test_declaration_equals_the_models_own(name: str) -> None:
    assert REFERENCE is not None
    tools = CASES[name]
    expected = REFERENCE.encode_tools_to_typescript_style(copy.deepcopy(tools))
    assert rendered(tools) == expected


@needs_reference
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_schema_the_model_cannot_declare_is_refused(name: str) -> None:
    assert REFERENCE is not None
    tools = REFUSED[name]
    with pytest.raises(Exception):  # noqa: B017, PT011 - the reference raises many kinds
        REFERENCE.encode_tools_to_typescript_style(copy.deepcopy(tools))
    with pytest.raises(ToolDeclarationError):
        rendered(tools)


def test_the_declaration_reads_as_documented() -> None:
    """Independent of the reference: the shape the module docstring shows."""
    assert rendered([WEATHER]) == (
        "# Tools\n\n## functions\nnamespace functions {\n"
        "// Get the weather\n\n// for a city\n"
        "type get_weather = (_: {\n"
        "  // City name\n  city: string,\n"  # required fields first, then by name
        "  // maximum: 14, minimum: 1\n"  # constraints sorted by key
        "  // Default: 3\n  days?: number,\n"
        "  // Default: \"celsius\"\n  unit?: \"celsius\" | \"fahrenheit\"\n"
        "}) => any;\n}\n")
    assert rendered([]) == "" == rendered([{"type": "_plugin"}])


def test_a_schema_nested_too_deeply_is_refused_not_a_crash() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ToolDeclarationError, match="nested too deeply"):
        typescript_tools([fn("deep", obj({"x": schema}))])
