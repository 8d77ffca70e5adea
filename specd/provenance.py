"""Provenance: which code a process runs, from where, at which version.

`code_version()` hashes the source files of every specd package (path relative to the
package + contents), the same set whether specd is installed editable (the packages are the
checkout's top-level folders) or as a regular copy (nested under `specd/`), so the two
agree on one tree and any edit, stale install or half-upgraded site-packages disagrees.
Both processes compute it before the model loads; the front refuses a scheduler whose
version differs from its own (exit 78), naming the files that differ (`file_digests`).

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

# Every package with its own directory in the checkout (package-dir in pyproject.toml); their
# subpackages (specd.daemon.ctl, specd.workers.spec, ...) are hashed with them.
PACKAGES = ("specd", "specd.daemon", "specd.ipc", "specd.workers", "specd.kernels",
            "specd.systemd")
THIRD_PARTY = ("torch", "triton", "pyzmq", "msgspec", "uvloop", "tokenizers", "safetensors",
               "click", "llguidance")


def package_dirs() -> dict[str, Path]:
    """Import name -> source directory of each specd package (without importing them)."""
    dirs: dict[str, Path] = {}
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"cannot locate package {name}; is specd installed?")
        dirs[name] = Path(next(iter(spec.submodule_search_locations)))
    return dirs


def _source_files(root: Path, package_roots: set[Path]) -> list[Path]:
    """.py files under `root`, minus those of another specd package nested inside it (a
    regular install puts `specd.daemon` in `specd/daemon/`: it is hashed as its own)."""
    inner = [d for d in package_roots if d != root and root in d.parents]
    return sorted(path for path in root.rglob("*.py")
                  if "__pycache__" not in path.parts
                  and not any(d in path.parents for d in inner))


@functools.cache
def file_digests() -> dict[str, str]:
    """"package:relative/path.py" -> sha256 (first 16 hex digits) of every source file."""
    dirs = package_dirs()
    roots = set(dirs.values())
    digests = {}
    for name, root in sorted(dirs.items()):
        for path in _source_files(root, roots):
            relative = f"{name}:{path.relative_to(root).as_posix()}"
            digests[relative] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return digests


def code_version() -> str:
    """sha256 (first 16 hex digits) over every source file's package path and digest."""
    return version_of(file_digests())


def version_of(digests: dict[str, str]) -> str:
    """The code version of the files `digests` (as `file_digests` gives them) describe."""
    digest = hashlib.sha256()
    for relative, file_digest in sorted(digests.items()):
        digest.update(f"{relative}\0{file_digest}\0".encode())
    return digest.hexdigest()[:16]


def differing_files(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The files (as in `file_digests`) present on one side only or with other contents."""
    return sorted(name for name in ours.keys() | theirs.keys()
                  if ours.get(name) != theirs.get(name))


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


def install_info(root: Path | None = None) -> dict[str, Any]:
    """How specd is installed: version, editable or not (PEP 610), the source it points at.
    `installed` is False when no distribution is installed or when the one installed is not
    the copy running here (`root`, the `specd` package directory: a checkout on
    PYTHONPATH, say); `other_install` then says where that one is."""
    try:
        dist = importlib.metadata.distribution("specd")
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False}
    direct_url_text = dist.read_text("direct_url.json")
    direct_url = json.loads(direct_url_text) if direct_url_text else {}
    editable = bool(direct_url.get("dir_info", {}).get("editable", False))
    url = direct_url.get("url")
    info = {"installed": True, "version": dist.version, "editable": editable, "url": url}
    if root is None:
        root = package_dirs()["specd"]
    if editable:
        installed_root = Path(str(url).removeprefix("file://")) / "specd"
    else:
        installed_root = Path(str(dist.locate_file("specd")))
    # An installer writes INSTALLER; a checkout's build metadata (specd.egg-info, found
    # when the checkout is on PYTHONPATH) has none and installed nothing.
    if installed_root.resolve() != root.resolve() or dist.read_text("INSTALLER") is None:
        return {"installed": False, "other_install": {**info, "root": str(installed_root)}}
    return info


def git_commit(checkout: Path) -> dict[str, str] | None:
    """{"sha", "branch"} of `checkout` when it is specd's git checkout (a `.git` and a
    `pyproject.toml` beside the packages), read from the files (no git process); None
    otherwise, or when HEAD cannot be resolved."""
    dot_git = checkout / ".git"
    if not (checkout / "pyproject.toml").is_file():
        return None
    if dot_git.is_file():  # a worktree: "gitdir: <its directory in the main .git>"
        gitdir = (checkout / dot_git.read_text().removeprefix("gitdir:").strip()).resolve()
    elif dot_git.is_dir():
        gitdir = dot_git
    else:
        return None
    # A worktree's refs live in the main repository ("commondir" names it).
    common = gitdir / "commondir"
    refs_dir = (gitdir / common.read_text().strip()).resolve() if common.is_file() else gitdir
    head = (gitdir / "HEAD").read_text().strip()
    if not head.startswith("ref: "):
        return {"sha": head, "branch": ""}  # a detached HEAD
    ref = head.removeprefix("ref: ")
    sha = _read_ref(refs_dir, ref)
    return None if sha is None else {"sha": sha, "branch": ref.removeprefix("refs/heads/")}


def _read_ref(refs_dir: Path, ref: str) -> str | None:
    """The commit of `ref`: its loose file, else its line in packed-refs."""
    loose = refs_dir / ref
    if loose.is_file():
        return loose.read_text().strip()
    packed = refs_dir / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            sha, _, name = line.partition(" ")
            if name == ref:
                return sha
    return None


def report() -> dict[str, Any]:
    """Everything above, for Ready, `specctl status` and `specctl doctor`. `root`: where
    the `specd` package lies; `git`: its checkout's commit, when it is one."""
    dirs = package_dirs()
    root = dirs["specd"]
    return {
        "code_version": code_version(),
        "num_source_files": len(file_digests()),
        "root": str(root),
        "git": git_commit(root.parent),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "install": install_info(root),
        "package_dirs": {k: str(v) for k, v in dirs.items()},
        "modules": imported_modules(),
        "packages": package_versions(),
    }
