"""A model's tokenizer class, read from its Python file as data: parsed with `ast`, never
imported or run.

A `tiktoken.model` model names its tokenizer class in `tokenizer_config.json`'s `auto_map`
(`tokenization_kimi.TikTokenTokenizer` for Kimi). That class decides facts no data file
states, and Kimi's publications differ in them while naming the same class: Kimi-K2's (and
Kimi-Linear's) special block has `num_reserved_special_tokens + 2` ids, Kimi-K2.5's (and
K2-Thinking's, K2.6's) has `num_reserved_special_tokens` (256: ranks + 256 = the embedding's
163,840 rows); K2.5's `apply_chat_template` renders tools as TypeScript, K2's only sorts
their keys. specd reads, from the model's own `tokenization_kimi.py`:

* the special block's size: the class attribute `num_reserved_special_tokens` and the end of
  the `range(num_base_tokens, num_base_tokens + ...)` its `__init__` names the block with;
* the split pattern: the class attribute `pat_str` (a string, or `"|".join([...])` of them);
* whether `__init__` hands `added_tokens_decoder` on to transformers (K2.5's does, K2's does
  not): with it, transformers encodes a named token outside the block as that id, which the
  class then cannot decode; without it, the class ignores such names;
* `apply_chat_template`, statement by statement (`chat_preparation.py` does what it does):
  `tools = deep_sort_dict(tools)` (a module-level function), the TypeScript declaration
  (`if tools:` / `try:` `tools_ts_str = encode_tools_to_typescript_style(tools)` imported from
  `.tool_declaration_ts`, which must be in the directory / `except`: no declaration /
  `kwargs['tools_ts_str'] = tools_ts_str` when there is one), and the `return
  super().apply_chat_template(conversation, tools=tools, name=name, ..., **kwargs)` that hands
  its keyword arguments on; their literal defaults (besides transformers' own arguments) are
  template defaults.

Anything else in these places (another statement, a default that is not a literal, a block
whose size is not a sum of integers) fails with a ValueError naming the file and line: specd
serves only tokenizer code whose effect it knows. A model whose `auto_map` names this class
but lacks the file fails too (naming it): without it, the block and the chat rules would be
guesses.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from specd.chat_preparation import SORT_TOOLS, TYPESCRIPT_TOOLS, ChatPreparation

KIMI_CLASS = "tokenization_kimi.TikTokenTokenizer"
KNOWN_CLASSES = (KIMI_CLASS,)
TYPESCRIPT_MODULE = "tool_declaration_ts"
TYPESCRIPT_FUNCTION = "encode_tools_to_typescript_style"
SORT_FUNCTION = "deep_sort_dict"
# transformers' own apply_chat_template arguments: not template variables.
TRANSFORMERS_CHAT_ARGUMENTS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class TokenizerCode:
    """What a tokenizer class's file says (module docstring). `num_special_ids`: the ids of
    the special block above the BPE ranks; `pattern`: its split pattern;
    `registers_added_tokens`: whether its `__init__` hands `added_tokens_decoder` on to
    transformers; `chat`: what its `apply_chat_template` does before the template renders."""

    path: Path
    num_special_ids: int
    pattern: str
    registers_added_tokens: bool
    chat: ChatPreparation


def auto_map_class(config: Mapping[str, Any]) -> str | None:
    """The tokenizer class `tokenizer_config.json`'s `auto_map` names ("module.Class"; a
    "org/repo--" prefix, code kept in another repository, is dropped), or None."""
    auto = (config.get("auto_map") or {}).get("AutoTokenizer")
    class_ref = auto[0] if isinstance(auto, list) and auto else auto
    return str(class_ref).split("--")[-1] if class_ref else None


def read_tokenizer_code(root: Path, class_ref: str) -> TokenizerCode:
    """The facts of `class_ref` (one of KNOWN_CLASSES) from its file in the model directory
    `root`. Raises ValueError naming the file (and line) when it is missing or its structure
    is not one specd knows."""
    if class_ref not in KNOWN_CLASSES:
        raise ValueError(f"tokenizer_config.json: the tokenizer is {class_ref} (auto_map), "
                         f"which specd does not know (known: {list(KNOWN_CLASSES)})")
    module, class_name = class_ref.rsplit(".", 1)
    path = root / f"{module}.py"
    if not path.is_file():
        raise ValueError(f"{path}: tokenizer_config.json names {class_ref} (auto_map), whose "
                         "file is not in the model directory; specd reads it as data (never "
                         "runs it) for the special tokens and the chat rules: put the model's "
                         f"{path.name} back")
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{path}: cannot parse it: {exc}") from exc
    return _Reader(path, tree, class_name).read()


class _Reader:
    """One file's facts; every refusal names the file and line."""

    def __init__(self, path: Path, tree: ast.Module, class_name: str) -> None:
        self.path = path
        self.functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        self.imports = {alias.asname or alias.name: (node.module or "", node.level)
                        for node in tree.body if isinstance(node, ast.ImportFrom)
                        for alias in node.names}
        classes = [n for n in tree.body
                   if isinstance(n, ast.ClassDef) and n.name == class_name]
        if len(classes) != 1:
            raise ValueError(f"{path}: no class {class_name} at the top level")
        self.cls = classes[0]
        self.attributes = {t.id: n.value for n in self.cls.body if isinstance(n, ast.Assign)
                           for t in n.targets if isinstance(t, ast.Name)}
        self.methods = {n.name: n for n in self.cls.body if isinstance(n, ast.FunctionDef)}

    def read(self) -> TokenizerCode:
        init = self.methods.get("__init__")
        if init is None:
            self.refuse(self.cls, f"class {self.cls.name} has no __init__")
        method = self.methods.get("apply_chat_template")
        chat = ChatPreparation(source=str(self.path)) if method is None else self.chat(method)
        return TokenizerCode(self.path, self.block_size(init), self.pattern(),
                             self.registers_added_tokens(init), chat)

    def refuse(self, node: ast.AST, why: str) -> NoReturn:
        line = getattr(node, "lineno", None)
        where = f"{self.path}:{line}" if line else str(self.path)
        raise ValueError(f"{where}: {why}; specd reads this file as data and knows only the "
                         "structure of Kimi's published tokenizer classes")

    def integer(self, node: ast.expr) -> int:
        """A sum of integer literals and integer class attributes (`self.NAME`)."""
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and node.attr in self.attributes):
            return self.integer(self.attributes[node.attr])
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
            left, right = self.integer(node.left), self.integer(node.right)
            return left + right if isinstance(node.op, ast.Add) else left - right
        self.refuse(node, f"{ast.unparse(node)!r} is not a sum of integers")

    def block_size(self, init: ast.FunctionDef) -> int:
        """The end of `range(num_base_tokens, num_base_tokens + N)` minus its start: N."""
        if not any(isinstance(n, ast.Assign) and _is_call(n.value, "len")
                   and any(isinstance(t, ast.Name) and t.id == "num_base_tokens"
                           for t in n.targets) for n in ast.walk(init)):
            self.refuse(init, "__init__ does not set num_base_tokens = len(...)")
        blocks = [n for n in ast.walk(init) if isinstance(n, ast.Call)
                  and _is_call(n, "range") and len(n.args) == 2
                  and _is_name(n.args[0], "num_base_tokens")]
        if len(blocks) != 1:
            self.refuse(init, f"__init__ names its special block {len(blocks)} times "
                        "(range(num_base_tokens, ...)), not once")
        end = blocks[0].args[1]
        terms = _terms(end)
        base = [(sign, t) for sign, t in terms if _is_name(t, "num_base_tokens")]
        if [sign for sign, _ in base] != [1]:
            self.refuse(end, f"the special block ends at {ast.unparse(end)!r}, not at "
                        "num_base_tokens + N")
        size = sum(sign * self.integer(t) for sign, t in terms if (sign, t) not in base)
        if size < 0:
            self.refuse(end, f"the special block has {size} ids")
        return size

    def pattern(self) -> str:
        node = self.attributes.get("pat_str")
        if node is None:
            self.refuse(self.cls, "the class sets no pat_str")
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "join" and isinstance(node.func.value, ast.Constant)
                and isinstance(node.func.value.value, str) and len(node.args) == 1
                and not node.keywords and isinstance(node.args[0], ast.List | ast.Tuple)
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                        for e in node.args[0].elts)):
            parts = [str(e.value) for e in node.args[0].elts if isinstance(e, ast.Constant)]
            return str(node.func.value.value).join(parts)
        self.refuse(node, "pat_str is not a string or a join of strings")

    def registers_added_tokens(self, init: ast.FunctionDef) -> bool:
        calls = [n for n in ast.walk(init) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and n.func.attr == "__init__"
                 and _is_call(n.func.value, "super")]
        if len(calls) != 1:
            self.refuse(init, "__init__ does not call super().__init__ once")
        return any(k.arg == "added_tokens_decoder" for k in calls[0].keywords)

    def chat(self, method: ast.FunctionDef) -> ChatPreparation:
        defaults = self.signature(method)
        steps: list[str] = []
        handed_on = None
        for statement in _body(method):
            if _is_assign(statement, "tools", _call_of(SORT_FUNCTION, "tools")):
                if SORT_FUNCTION not in self.functions:
                    self.refuse(statement, f"{SORT_FUNCTION} is not defined in the file")
                steps.append(SORT_TOOLS)
            elif _is_assign(statement, "tools_ts_str", _is_none):
                continue
            elif isinstance(statement, ast.If) and _is_name(statement.test, "tools"):
                self.typescript(statement)
                steps.append(TYPESCRIPT_TOOLS)
            elif isinstance(statement, ast.If) and _is_not_none(statement.test, "tools_ts_str"):
                if TYPESCRIPT_TOOLS not in steps or not _stores_typescript(statement):
                    self.refuse(statement, "tools_ts_str is stored without being made, or "
                                "not as kwargs['tools_ts_str']")
                handed_on = statement
            elif isinstance(statement, ast.Return) and statement is _body(method)[-1]:
                self.super_call(statement, defaults)
            else:
                self.refuse(statement, f"apply_chat_template does {_short(statement)!r}")
        if TYPESCRIPT_TOOLS in steps and handed_on is None:
            self.refuse(method, "the TypeScript declaration is made but never handed on")
        if not isinstance(_body(method)[-1], ast.Return):
            self.refuse(method, "apply_chat_template does not end returning "
                        "super().apply_chat_template(...)")
        template_defaults = tuple((name, value) for name, value in defaults.items()
                                  if name not in TRANSFORMERS_CHAT_ARGUMENTS)
        return ChatPreparation(tuple(steps), template_defaults, str(self.path))

    def signature(self, method: ast.FunctionDef) -> dict[str, Any]:
        """Keyword arguments -> literal defaults; positional ones: self, conversation."""
        arguments = method.args
        names = [a.arg for a in arguments.posonlyargs + arguments.args]
        if names[:2] != ["self", "conversation"] or arguments.vararg or not arguments.kwarg:
            self.refuse(method, "apply_chat_template is not (self, conversation, ..., "
                        "**kwargs)")
        with_defaults = list(zip(arguments.args[-len(arguments.defaults):],
                                 arguments.defaults, strict=True)) if arguments.defaults else []
        with_defaults += [(a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults,
                                                 strict=True) if d is not None]
        defaults: dict[str, Any] = {}
        for argument, default in with_defaults:
            try:
                defaults[argument.arg] = ast.literal_eval(default)
            except ValueError:
                self.refuse(default, f"the default of {argument.arg} is not a literal")
        required = set(names[2:]) | {a.arg for a in arguments.kwonlyargs}
        missing = sorted(required - set(defaults) - {"tools"})
        if missing:
            self.refuse(method, f"apply_chat_template arguments {missing} have no default")
        return defaults

    def typescript(self, guard: ast.If) -> None:
        """`if tools: try: tools_ts_str = encode(tools) except ...: (no declaration)`."""
        if self.imports.get(TYPESCRIPT_FUNCTION) != (TYPESCRIPT_MODULE, 1):
            self.refuse(guard, f"{TYPESCRIPT_FUNCTION} is not imported from "
                        f".{TYPESCRIPT_MODULE}")
        declaration_file = self.path.parent / f"{TYPESCRIPT_MODULE}.py"
        if not declaration_file.is_file():
            self.refuse(guard, f"it imports {TYPESCRIPT_MODULE}, and {declaration_file} is "
                        "not in the model directory")
        body = guard.body
        if guard.orelse or len(body) != 1 or not isinstance(body[0], ast.Try):
            self.refuse(guard, "if tools: holds more than one try: statement")
        attempt = body[0]
        if (attempt.orelse or attempt.finalbody or len(attempt.body) != 1
                or not _is_assign(attempt.body[0], "tools_ts_str",
                                  _call_of(TYPESCRIPT_FUNCTION, "tools"))):
            self.refuse(attempt, f"the try: is not tools_ts_str = {TYPESCRIPT_FUNCTION}(tools)")
        for handler in attempt.handlers:
            for statement in handler.body:
                if not (isinstance(statement, ast.Expr | ast.Pass)
                        or _is_assign(statement, "tools_ts_str", _is_none)):
                    self.refuse(statement, f"the except: does {_short(statement)!r}")

    def super_call(self, statement: ast.Return, defaults: dict[str, Any]) -> None:
        call = statement.value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "apply_chat_template"
                and _is_call(call.func.value, "super")):
            self.refuse(statement, "apply_chat_template does not return "
                        "super().apply_chat_template(...)")
        if len(call.args) != 1 or not _is_name(call.args[0], "conversation"):
            self.refuse(call, "super().apply_chat_template is not given the conversation")
        passed = {k.arg: k.value for k in call.keywords if k.arg is not None}
        if not any(k.arg is None and _is_name(k.value, "kwargs") for k in call.keywords):
            self.refuse(call, "super().apply_chat_template is not given **kwargs")
        for name in ["tools", *defaults]:
            if not _is_name(passed.get(name), name):
                self.refuse(call, f"super().apply_chat_template is not given {name}={name}")
        extra = sorted(set(passed) - {"tools", *defaults})
        if extra:
            self.refuse(call, f"super().apply_chat_template is given {extra}")


def _terms(node: ast.expr, sign: int = 1) -> list[tuple[int, ast.expr]]:
    """`a + b - c` as [(1, a), (1, b), (-1, c)]."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
        right = sign if isinstance(node.op, ast.Add) else -sign
        return [*_terms(node.left, sign), *_terms(node.right, right)]
    return [(sign, node)]


def _body(method: ast.FunctionDef) -> list[ast.stmt]:
    """The statements, without a leading docstring."""
    body = method.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        return body[1:]
    return body


def _is_name(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _is_call(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Call) and _is_name(node.func, name)


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _call_of(function: str, argument: str) -> Any:
    """A test for `function(argument)`."""
    def test(node: ast.AST) -> bool:
        return (_is_call(node, function) and isinstance(node, ast.Call)
                and len(node.args) == 1 and _is_name(node.args[0], argument)
                and not node.keywords)
    return test


def _is_assign(statement: ast.stmt, target: str, value: Any) -> bool:
    return (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and _is_name(statement.targets[0], target) and bool(value(statement.value)))


def _is_not_none(test: ast.expr, name: str) -> bool:
    return (isinstance(test, ast.Compare) and _is_name(test.left, name)
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and _is_none(test.comparators[0]))


def _stores_typescript(guard: ast.If) -> bool:
    """`kwargs['tools_ts_str'] = tools_ts_str` is the whole body."""
    if guard.orelse or len(guard.body) != 1 or not isinstance(guard.body[0], ast.Assign):
        return False
    assign = guard.body[0]
    target = assign.targets[0] if len(assign.targets) == 1 else None
    return (isinstance(target, ast.Subscript) and _is_name(target.value, "kwargs")
            and isinstance(target.slice, ast.Constant) and target.slice.value == "tools_ts_str"
            and _is_name(assign.value, "tools_ts_str"))


def _short(statement: ast.stmt) -> str:
    text = ast.unparse(statement).splitlines()[0]
    return text if len(text) <= 80 else text[:77] + "..."
