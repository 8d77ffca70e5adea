"""No exception is swallowed in specd's product code (every module of the installed package).

The incident behind specd: a constructor's exception was caught, logged as one warning line
without its traceback, and construction went on; the object reached its first decode
without an attribute. ruff's blind-except rules (BLE, pyproject.toml) flag a broad
`except` that neither re-raises nor logs; this test states the whole contract, by parsing
every product source file:

* A **broad** handler (bare `except`, `Exception`, `BaseException`, or
  `contextlib.suppress` of them) re-raises, or hands the exception on whole, traceback
  included: `log.exception(...)`, a call with `exc_info=`, `traceback.format_exc()` /
  `format_exception(...)`, or the exception object passed to a call that takes it
  (`report_compile_failure(log, ..., exc)`, the scheduler's `fail(io, stage, exc, code)`;
  not `str(exc)` or `repr(exc)`, which drop the traceback). A documented fallback records
  itself this way (it is logged once with the traceback, and `fallbacks` shows it).
* A **narrow** handler (a named exception type the code expects, such as `queue.Empty`,
  `FileNotFoundError`, `msgspec.DecodeError`) does something with it: returns, assigns,
  replies, logs. One whose body only passes is on `ALLOWED_PASS` with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The package's folders (pyproject.toml's package-dir: specd.* lives in these).
PACKAGE_DIRS = ("specd", "daemon", "ipc", "kernels", "workers", "systemd")
BROAD = {"Exception", "BaseException"}
# Calls that take an exception but keep only its text.
TEXT_ONLY = {"str", "repr", "type", "describe", "format"}
TRACEBACK_CALLS = {"exception", "format_exc", "format_exception", "print_exc",
                   "print_exception"}

# (file, handled types as written) -> why passing is the whole handling there.
ALLOWED_PASS: dict[tuple[str, str], str] = {
    ("daemon/server.py", "(TimeoutError, ConnectionError)"):
        "a refused client lingers or left while its last frame drains; it is closed next",
    ("daemon/server.py", "ConnectionClosed"):
        "the client closed between frames: a normal end of the connection",
    ("daemon/http/server.py", "ConnectionResetError"):
        "the HTTP client left mid-stream; the handler's finally aborts its request",
    ("daemon/ctl/top.py", "KeyboardInterrupt"):
        "Ctrl-C is specctl top's documented way out, like q",
}


def product_files() -> list[Path]:
    files = sorted(p for d in PACKAGE_DIRS for p in (REPO / d).rglob("*.py"))
    assert len(files) > 100  # the scan sees the package, not an empty folder
    return files


def type_names(node: ast.expr | None) -> set[str]:
    """The exception names a handler's type expression catches (last dotted part)."""
    if node is None:
        return {"BaseException"}  # a bare except
    if isinstance(node, ast.Tuple):
        return {n for elt in node.elts for n in type_names(elt)}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Name):
        return {node.id}
    return {ast.unparse(node)}


def call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def hands_on(body: list[ast.stmt], bound: str | None) -> bool:
    """Whether `body` re-raises or hands the exception on with its traceback."""
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Raise):
            return True
        if not isinstance(node, ast.Call):
            continue
        name = call_name(node)
        if name in TRACEBACK_CALLS or any(k.arg == "exc_info" for k in node.keywords):
            return True
        passed = [*node.args, *(k.value for k in node.keywords)]
        if (bound is not None and name not in TEXT_ONLY
                and any(isinstance(a, ast.Name) and a.id == bound for a in passed)):
            return True
    return False


def only_passes(body: list[ast.stmt]) -> bool:
    return all(isinstance(s, ast.Pass | ast.Continue)
               or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
               for s in body)


def violations(path: Path) -> list[str]:
    rel = path.relative_to(REPO).as_posix()
    tree = ast.parse(path.read_text(), filename=rel)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler):
            where = f"{rel}:{node.lineno}: except {ast.unparse(node.type) if node.type else ''}"
            caught = ast.unparse(node.type) if node.type is not None else "<bare>"
            if type_names(node.type) & BROAD:
                if not hands_on(node.body, node.name):
                    found.append(f"{where}: a broad handler that drops the traceback")
            elif only_passes(node.body) and (rel, caught) not in ALLOWED_PASS:
                found.append(f"{where}: passes without a reason in ALLOWED_PASS")
        elif (isinstance(node, ast.Call) and call_name(node) == "suppress"
              and any(type_names(a) & BROAD for a in node.args)):
            found.append(f"{rel}:{node.lineno}: suppress() of a broad exception")
    return found


def test_no_product_module_swallows_an_exception() -> None:
    found = [v for path in product_files() for v in violations(path)]
    assert found == []


def test_every_allowed_pass_still_exists() -> None:
    """An entry whose handler is gone is removed, so the list stays short and true."""
    present = set()
    for path in product_files():
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                present.add((rel, ast.unparse(node.type)))
    assert set(ALLOWED_PASS) - present == set()


@pytest.mark.parametrize(("source", "expected"), [
    ("try:\n    f()\nexcept Exception:\n    log.warning('failed')\n", 1),
    ("try:\n    f()\nexcept:\n    pass\n", 1),
    ("try:\n    f()\nexcept Exception as e:\n    log.warning('x %s', repr(e))\n", 1),
    ("with contextlib.suppress(Exception):\n    f()\n", 1),
    ("try:\n    f()\nexcept OSError:\n    pass\n", 1),
    ("try:\n    f()\nexcept Exception:\n    log.exception('failed')\n", 0),
    ("try:\n    f()\nexcept Exception as e:\n    log.error('x', exc_info=e)\n", 0),
    ("try:\n    f()\nexcept Exception as e:\n    fail(io, e)\n", 0),
    ("try:\n    f()\nexcept Exception:\n    cleanup()\n    raise\n", 0),
    ("try:\n    f()\nexcept OSError as e:\n    return str(e)\n", 0),
])
def test_the_rule_flags_what_swallows_and_passes_what_hands_on(
        source: str, expected: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    path = tmp_path / "m.py"
    path.write_text("def g():\n" + "".join(f"    {line}\n" for line in source.splitlines()))
    assert len(violations(path)) == expected
