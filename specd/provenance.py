"""Provenance: which code a process runs, from where, at which version.

`code_version()` hashes the source files of every specd package (path relative to the
package + contents), so an editable checkout and an installed wheel built from the same
tree agree, and any edit, stale install or half-upgraded site-packages disagrees. The front
refuses a scheduler whose version differs from its own (exit 78).

No torch here: the front calls this too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("specd", "specd.daemon", "specd.ipc", "specd.workers", "specd.kernels")
THIRD_PARTY = ("torch", "triton", "pyzmq", "msgspec", "uvloop", "tokenizers", "safetensors",
               "click")


def package_dirs() -> dict[str, Path]:
    """Import name -> source directory of each specd package (without importing them)."""
    dirs: dict[str, Path] = {}
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"cannot locate package {name}; is specd installed?")
        dirs[name] = Path(next(iter(spec.submodule_search_locations)))
    return dirs


def _source_files(root: Path, nested: set[Path]) -> list[Path]:
    """.py files under `root`, minus those inside another specd package's directory."""
    files = []
    for path in root.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        if any(d != root and d in path.parents for d in nested):
            continue
        files.append(path)
    return sorted(files)


@functools.cache
def code_version() -> str:
    """sha256 (first 16 hex digits) over every specd source file's package path and bytes."""
    digest = hashlib.sha256()
    dirs = package_dirs()
    nested = set(dirs.values())
    for name, root in sorted(dirs.items()):
        for path in _source_files(root, nested):
            relative = f"{name}:{path.relative_to(root).as_posix()}"
            digest.update(relative.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def imported_modules() -> dict[str, str]:
    """specd module name -> the file it was imported from, for this process."""
    found = {}
    for name, module in sorted(sys.modules.items()):
        if name == "specd" or name.startswith("specd."):
            found[name] = str(getattr(module, "__file__", None) or "<namespace>")
    return found


def package_versions(names: tuple[str, ...] = THIRD_PARTY) -> dict[str, str]:
    """Distribution -> installed version ("not installed" when absent)."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def install_info() -> dict[str, Any]:
    """How specd is installed: version, editable or not (PEP 610), the source it points at."""
    try:
        dist = importlib.metadata.distribution("specd")
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False}
    direct_url_text = dist.read_text("direct_url.json")
    direct_url = json.loads(direct_url_text) if direct_url_text else {}
    return {
        "installed": True,
        "version": dist.version,
        "editable": bool(direct_url.get("dir_info", {}).get("editable", False)),
        "url": direct_url.get("url"),
    }


def report() -> dict[str, Any]:
    """Everything above, for Ready, `specctl status` and `specctl doctor`."""
    return {
        "code_version": code_version(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "install": install_info(),
        "package_dirs": {k: str(v) for k, v in package_dirs().items()},
        "modules": imported_modules(),
        "packages": package_versions(),
    }
