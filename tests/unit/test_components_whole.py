"""Components are whole or absent (DESIGN.md): every attribute an object of specd's own
classes ever has is set by its constructor. An attribute first set by some later method is
what the founding incident was: a worker reached its first decode without an attribute its
constructor should have set (the exception that skipped it had been swallowed), and only
the path that read it failed, long after start-up said all was well.

Checked statically over every product source file: for each class, the attributes its
methods assign on `self` (`self.x = ...`, `self.x += ...`, `setattr(self, ...)`,
`object.__setattr__(self, ...)`) outside `__init__` / `__post_init__` must also be assigned
there, or be declared in the class body (dataclass fields, class attributes, properties)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("specd", "daemon", "ipc", "workers", "kernels")
CONSTRUCTORS = ("__init__", "__post_init__")


def _self_assignments(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Attribute names `function` assigns on `self` (a dynamic name counts as '*')."""
    names: set[str] = set()
    for node in ast.walk(function):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"):
                    names.add(sub.attr)
        if isinstance(node, ast.Call):
            func = node.func
            is_setattr = (isinstance(func, ast.Name) and func.id == "setattr") or (
                isinstance(func, ast.Attribute) and func.attr == "__setattr__")
            args = node.args[1:] if isinstance(func, ast.Attribute) else node.args
            if is_setattr and args and isinstance(args[0], ast.Name) and args[0].id == "self":
                name = args[1] if len(args) > 1 else None
                names.add(name.value if isinstance(name, ast.Constant)
                          and isinstance(name.value, str) else "*")
    return names


def _declared(cls: ast.ClassDef) -> set[str]:
    """Names the class body itself declares: methods, properties, fields, class attributes."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def late_attributes(source: str) -> list[str]:
    """`Class.attribute (set in method)` for each attribute set only after construction."""
    found = []
    for cls in [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]:
        methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        constructed = set().union(*(_self_assignments(f) for f in methods
                                    if f.name in CONSTRUCTORS))
        known = constructed | _declared(cls)
        for method in methods:
            if method.name in CONSTRUCTORS:
                continue
            for name in sorted(_self_assignments(method) - known):
                found.append(f"{cls.name}.{name} (set in {method.name})")
    return found


def _product_files() -> list[Path]:
    return sorted(p for folder in PRODUCT for p in (ROOT / folder).rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_the_check_finds_an_attribute_set_after_construction() -> None:
    incident = '''
class Worker:
    def __init__(self, draft):
        self.draft = draft
    def warm_up(self):
        self.tree_buffers = make_buffers()   # skipped if warm-up raised and was swallowed
    def decode(self):
        return self.tree_buffers
'''
    assert late_attributes(incident) == ["Worker.tree_buffers (set in warm_up)"]
    assert late_attributes(incident.replace("self.tree_buffers =", "setattr(self, 'x', ")
                           .replace("make_buffers()", "make_buffers())")) == [
        "Worker.x (set in warm_up)"]


def test_the_check_accepts_attributes_the_constructor_or_the_class_declares() -> None:
    whole = '''
@dataclass
class Stats:
    steps: int = 0
    def step(self):
        self.steps += 1
class Runner:
    limit = 4
    def __init__(self):
        self.graphs = None
    def capture(self):
        self.graphs = capture_all()
        self.limit = 8
'''
    assert late_attributes(whole) == []


def test_every_attribute_of_every_product_class_is_set_by_its_constructor() -> None:
    files = _product_files()
    assert len(files) > 100  # the product's sources were found
    late = {str(p.relative_to(ROOT)): found for p in files
            if (found := late_attributes(p.read_text()))}
    assert late == {}
