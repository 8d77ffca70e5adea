"""specd: a single-node inference daemon for EAGLE-3 speculative decoding over INT4 weights.

The in-process API (`specd.Engine`, `specd.SamplingParams`) is imported lazily so that the
front process, which must never import torch, can import `specd.*` modules freely.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from specd.ipc.sampling import SamplingParams
    from specd.workers.engine_api import Engine

__all__ = ["Engine", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from specd.workers.engine_api import Engine

        return Engine
    if name == "SamplingParams":
        from specd.ipc.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'specd' has no attribute {name!r}")
