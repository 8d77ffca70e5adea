"""No device of the kind `--device` asks for is a configuration error naming the option
(exit 78), found before anything touches the device, whose own error (torch's
AssertionError) would read as a bug in specd (exit 70)."""

from __future__ import annotations

import pytest
import torch

from specd.exit_codes import EXIT_CONFIG, startup_exit_code
from specd.workers.config import EngineConfig
from specd.workers.engine.setup import check_device


def test_the_cpu_needs_nothing() -> None:
    check_device(EngineConfig(device="cpu"))


def test_a_torch_without_cuda_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match=r"^--device cuda: this torch .* is built without "
                                         r"CUDA; install a CUDA build or use --device cpu$"
                       ) as raised:
        check_device(EngineConfig(device="cuda"))
    assert startup_exit_code(raised.value) == EXIT_CONFIG


def test_no_visible_device_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match=r"^--device cuda:1: no CUDA device is visible "
                                         r".*CUDA_VISIBLE_DEVICES=''\); use --device cpu$"):
        check_device(EngineConfig(device="cuda:1"))


def test_too_few_devices_for_the_ranks_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device(EngineConfig(device="cuda", tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"needs devices cuda:1\.\.cuda:2; this host has 2$"):
        check_device(EngineConfig(device="cuda:1", tensor_parallel_size=2))
