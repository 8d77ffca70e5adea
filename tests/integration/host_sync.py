"""A detector of device-to-host synchronisation, for forwards that must be capturable.

`no_host_sync()` runs a block under a `TorchDispatchMode` that raises `HostSyncError` naming
the op on anything that makes the host wait for the device on a GPU: an op whose output shape
or value the host must read (`nonzero`, `item`/`_local_scalar_dense`, `bincount`, `unique`,
`masked_select`, `repeat_interleave` without `output_size`, boolean-mask indexing and
index_put, `equal`, `is_nonzero`), and the tensor methods that copy to the host without
passing the dispatcher (`tolist`, `numpy`, `cpu`, `__array__`), patched for the block.

`gpu_code_path(monkeypatch, *models)` makes the block take the code a GPU takes: the models'
attention layers run the backends a CUDA model chose (runner/attention_backend.py: the Triton
kernels), every `tensor.is_cuda` reads True (so each `is_cuda` dispatch picks its CUDA branch:
the fused MoE, the INT4 GEMM), the kernels run under TRITON_INTERPRET=1 on the CPU tensors,
and the interpreter's own simulation of a kernel runs with the detector suspended (it copies
the arguments to numpy: that is the simulation, not the launcher). The launchers' own torch
code, between kernels, stays under the detector.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# Ops whose result the host must wait for on a GPU (outputs sized by values, or a value).
SYNC_OPS = frozenset({"nonzero", "_local_scalar_dense", "bincount", "_unique", "_unique2",
                      "unique_dim", "unique_consecutive", "unique_dim_consecutive",
                      "masked_select", "equal", "is_nonzero", "argwhere"})
# Ops that sync only when indexed by a boolean (or uint8) mask.
MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
# Tensor methods that copy to the host outside the dispatcher (on CPU tensors they are
# free, so the dispatcher never sees them): forbidden outright inside the block.
HOST_METHODS = ("tolist", "numpy", "cpu", "__array__")


class HostSyncError(AssertionError):
    """A device-to-host synchronisation inside a block that must have none."""


def _is_mask(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def sync_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why `func(*args, **kwargs)` forces a host sync on a GPU, or None."""
    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return f"aten.{name}"
    if name == "repeat_interleave" and isinstance(args[0] if args else None, torch.Tensor):
        overload = func._overloadname
        if overload in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None:
            return "aten.repeat_interleave with tensor repeats and no output_size"
    if name in MASK_INDEX_OPS and len(args) > 1:
        indices = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        if any(_is_mask(i) for i in indices):
            return f"aten.{name} with a boolean mask"
    return None


class _SyncDetector(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            raise HostSyncError(f"host sync: {reason} ({func})")
        return func(*args, **kwargs)


def _refuse(name: str) -> Callable[..., Any]:
    def refuse(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise HostSyncError(f"host sync: Tensor.{name}() copies to the host")

    return refuse


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise HostSyncError on any host sync inside the block (module docstring)."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in HOST_METHODS}
    try:
        for name in HOST_METHODS:
            setattr(torch.Tensor, name, _refuse(name))
        with _SyncDetector():
            yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


@contextmanager
def _host_allowed() -> Iterator[None]:
    """Suspend `no_host_sync` (the detector and the patched methods) for a block."""
    patched = {name: torch.Tensor.__dict__.get(name) for name in HOST_METHODS}
    try:
        for name in HOST_METHODS:
            if name in torch.Tensor.__dict__:
                delattr(torch.Tensor, name)
        with _disable_current_modes():
            yield
    finally:
        for name, method in patched.items():
            if method is not None:
                setattr(torch.Tensor, name, method)


@contextmanager
def gpu_code_path(monkeypatch: pytest.MonkeyPatch, *models: torch.nn.Module
                  ) -> Iterator[list[str]]:
    """Take the GPU's attention backends in `models` and every `is_cuda` branch as a GPU
    would, the Triton kernels interpreted (module docstring); yields the names of the
    kernels launched, in order. Needs TRITON_INTERPRET=1 (tests/conftest.py sets it)."""
    from triton.runtime.interpreter import InterpretedFunction

    from specd.workers.runner.attention_backend import LATENT, PER_HEAD

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("gpu_code_path needs TRITON_INTERPRET=1")
    real_run = InterpretedFunction.run
    on_gpu = property(lambda self: True)

    launched: list[str] = []

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        launched.append(self.__name__)
        # The simulation sees the tensors as they are (CPU), without the detector.
        del torch.Tensor.is_cuda
        try:
            with _host_allowed():
                return real_run(self, *args, **kwargs)
        finally:
            torch.Tensor.is_cuda = on_gpu  # type: ignore[assignment]  # a property shadowing C

    on_cuda = {id(layout.on_cpu): layout.on_cuda for layout in (PER_HEAD, LATENT)}
    with monkeypatch.context() as patch:
        for model in models:
            for module in model.modules():
                backend = getattr(module, "attention", None)
                if id(backend) in on_cuda:
                    patch.setattr(module, "attention", on_cuda[id(backend)])
        patch.setattr(InterpretedFunction, "run", run)
        patch.setattr(torch.Tensor, "is_cuda", on_gpu, raising=False)
        yield launched
