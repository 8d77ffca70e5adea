"""specd: a single-node inference daemon for EAGLE-3 speculative decoding over INT4 weights.

The in-process API (`specd.Engine`, `specd.SamplingParams`) is imported lazily so that the
front process, which must never import torch, can import `specd.*` modules freely.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The subpackages live in the checkout's top-level folders (daemon/, workers/, ...), which an
# install maps into `specd.*` (package-dir in pyproject.toml). A checkout put on PYTHONPATH
# has no such mapping: the same one is made here, so `python -m specd.daemon.main` runs from
# it too (status then says "not installed").
if importlib.util.find_spec("specd.daemon") is None:
    __path__.append(str(Path(__path__[0]).parent))

if TYPE_CHECKING:
    from specd.ipc.sampling import SamplingParams
    from specd.workers.engine.api import Engine

__all__ = ["Engine", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from specd.workers.engine.api import Engine

        return Engine
    if name == "SamplingParams":
        from specd.ipc.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'specd' has no attribute {name!r}")
