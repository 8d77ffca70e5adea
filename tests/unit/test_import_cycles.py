"""Imports flow one way (DESIGN.md): no two of specd's modules import each other, directly
or through others. Every import counts: at the top of a module, inside a function (a lazy
import only hides a cycle until the function runs) and under `TYPE_CHECKING` (a cycle of
types is a cycle of design).

Checked statically over the product folders of `package-dir` in pyproject.toml (daemon/,
workers/, ipc/, kernels/, specd/, systemd/), each file named by the module it is installed
as. A module depends on the modules its import statements name, on the package whose
`__init__` it imports, but not on its own enclosing packages (Python runs those first
whatever the module says). A cycle is a set of modules each of which reaches every other
through these edges.
"""

from __future__ import annotations

import ast
import textwrap
import tomllib
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

Graph = dict[str, set[str]]


def package_folders(root: Path) -> dict[str, Path]:
    """Each top-level package of the distribution -> its folder (`package-dir`)."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {package: root / folder for package, folder in setuptools["package-dir"].items()}


def module_files(folders: dict[str, Path]) -> dict[str, Path]:
    """Module name -> source file, for every .py file under the folders (a package's
    `__init__.py` is the package's own name)."""
    modules: dict[str, Path] = {}
    for package, folder in folders.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _named(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute dotted names an import statement names (a `from X import y` names X and
    X.y: y may be a module or a name defined in X)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: level 1 is the module's own package
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(modules: dict[str, Path]) -> Graph:
    """Module -> the modules among `modules` it imports, anywhere in its source."""
    graph: Graph = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _named(node, name, is_package):
                while target and target not in modules:  # `from m import a_function`: m
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def _reachable(graph: Graph, start: str) -> set[str]:
    """The modules `start` reaches through one import or more (itself only on a cycle)."""
    seen: set[str] = set()
    todo = deque(graph.get(start, ()))
    while todo:
        module = todo.popleft()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def cycles(graph: Graph) -> list[list[str]]:
    """The import cycles of `graph`: each a sorted group of modules that all reach one
    another (a strongly connected component of two or more), in sorted order."""
    reach = {module: _reachable(graph, module) for module in graph}
    found: list[list[str]] = []
    placed: set[str] = set()
    for module in sorted(graph):
        if module in placed or module not in reach[module]:
            continue
        group = sorted(other for other in reach[module] if module in reach[other])
        placed.update(group)
        found.append(group)
    return found


def cycle_path(graph: Graph, group: list[str]) -> list[str]:
    """One shortest way round the cycle through `group[0]`: [a, b, ..., a]."""
    start = group[0]
    came_from: dict[str, str] = {}
    todo = deque([start])
    while todo:
        module = todo.popleft()
        for nxt in sorted(graph[module]):
            if nxt == start:
                path = [start, module]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1]
            if nxt in group and nxt not in came_from:
                came_from[nxt] = module
                todo.append(nxt)
    raise ValueError(f"{group} is not a cycle of the graph")


def test_no_module_of_specd_is_on_an_import_cycle() -> None:
    graph = import_graph(module_files(package_folders(ROOT)))
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        " -> ".join(cycle_path(graph, group)) for group in found)


def test_the_graph_holds_the_imports_that_run_late() -> None:
    # The check sees the whole tree: top-level, TYPE_CHECKING and lazy imports alike.
    graph = import_graph(module_files(package_folders(ROOT)))
    assert {"specd.daemon.front", "specd.workers.engine.core", "specd.ipc.messages",
            "specd.kernels.tree_attention"} <= graph.keys()
    assert "specd.daemon.request_flow" in graph["specd.daemon.front"]
    assert "specd.workers.engine.api" in graph["specd"]  # `specd.Engine`, imported lazily
    assert "specd.ipc.sampling" in graph["specd"]


def test_cycles_finds_each_strongly_connected_group() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"},
             "g": set()}
    assert cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert cycle_path(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, source in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def test_a_cycle_through_a_lazy_or_a_type_checking_import_is_found(tmp_path: Path) -> None:
    _write(tmp_path / "pkg", {
        "__init__.py": "",
        "top.py": "from pkg.sub import leaf\n",
        "lazy.py": """\
            def late():
                from pkg import typed
                return typed
            """,
        "sub/__init__.py": "",
        "sub/leaf.py": "import os\n",
        "sub/back.py": "from .. import lazy\nfrom . import leaf\n",
        "typed.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.sub.back import thing
            """,
    })
    graph = import_graph(module_files({"pkg": tmp_path / "pkg"}))
    assert graph["pkg.top"] == {"pkg.sub", "pkg.sub.leaf"}
    assert graph["pkg.sub.back"] == {"pkg.lazy", "pkg.sub.leaf"}  # `..` is pkg, `.` pkg.sub
    assert graph["pkg.sub.leaf"] == set()  # os is not one of ours
    assert cycles(graph) == [["pkg.lazy", "pkg.sub.back", "pkg.typed"]]
    assert cycle_path(graph, cycles(graph)[0]) == [
        "pkg.lazy", "pkg.typed", "pkg.sub.back", "pkg.lazy"]


def test_a_package_whose_init_imports_its_importer_is_a_cycle(tmp_path: Path) -> None:
    _write(tmp_path / "pkg", {
        "__init__.py": "from pkg.api import run\n",
        "api.py": "def run() -> None: ...\n",
        "user.py": "from pkg import api\n",
        "other/__init__.py": "from pkg import user\n",
        "other/mod.py": "",
    })
    graph = import_graph(module_files({"pkg": tmp_path / "pkg"}))
    assert graph["pkg.api"] == set()  # its own package runs first: no edge
    assert cycles(graph) == []
    _write(tmp_path / "pkg", {"api.py": "from pkg.other import mod\n"})
    graph = import_graph(module_files({"pkg": tmp_path / "pkg"}))
    # api -> pkg.other (its __init__ runs) -> user -> api
    assert cycles(graph) == [["pkg.api", "pkg.other", "pkg.user"]]
