"""Where a step's device results become host values: the one synchronisation point of a step.

`HostCopy(tensor)` starts the copy when the step is launched; `values()` waits for it. On
CUDA the copy goes to pinned memory on the current stream and an event marks its end, so
the host blocks only when it reads the values (after it has scheduled and launched the
next step: overlap scheduling). On the CPU there is nothing to wait for: the stand-in
reads the tensor at once, and the pipeline around it runs unchanged.
"""

from __future__ import annotations

import time

import torch


class HostCopy:
    """A device tensor on its way to the host.

    `HostCopy.total_wait_s` adds up the seconds the host has spent blocked in `values()`
    (process-wide; tools/bench_overlap.py reads it to split a step into host work and
    waiting for the device)."""

    total_wait_s = 0.0

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor

    def values(self) -> list[int]:
        """The tensor's values (waits for the copy on CUDA)."""
        if self._event is not None:
            started = time.perf_counter()
            self._event.synchronize()
            HostCopy.total_wait_s += time.perf_counter() - started
        return [int(v) for v in self._host.tolist()]


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: on CUDA it is staged in
    pinned memory and copied asynchronously (a copy from pageable memory would block the
    host until the stream reaches it, i.e. until the step in flight ends)."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
