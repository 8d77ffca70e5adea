"""What a fresh install pulls in: nothing torch warns about at import."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_numpy_is_a_declared_dependency() -> None:
    # torch's CPU wheel leaves numpy out; without it every `import torch` (each start of
    # the scheduler, `specctl doctor`) prints "Failed to initialize NumPy".
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]]
    assert "numpy" in names


def test_importing_torch_prints_no_numpy_warning() -> None:
    result = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0
    assert "NumPy" not in result.stderr
