"""Shared test set-up: GPU-only tests are skipped where no CUDA device is present."""

from __future__ import annotations

import os

import pytest

# Triton kernels run on the CPU through the interpreter; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")


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
        if "gpu" in item.keywords:
            item.add_marker(skip)
