"""Which kernel runs a model's float32 linears on the CPU: measured on its own weights at load.

Three kernels compute a float32 linear here, the same products summed in other orders (their
results differ by rounding, about 1e-6 relative):

* "mkl": `nn.Linear` as built, `F.linear`: MKL's sgemm on the [out, in] weight;
* "onednn": `layers.PackedLinear`, oneDNN's GEMM on a weight it laid out once at load;
* "transposed": `layers.TransposedLinear`, `torch.mm` on the weight held [in, out].

Which is fastest depends on the machine, by more than the few percent worth chasing: on one
2-vCPU AMD EPYC VM oneDNN's took 0.5-0.85x MKL's time for the fixture's layer linears, on
another (whose memory bandwidth, 8.6 GB/s read on one thread, bounds a decode step's 35 MB
of weight reads) 1.2x, with "transposed" 0.83x. So `--cpu-linear auto` (the default) times
the candidates over the model's float32 linears, in model order as a step reads them (up to
`SAMPLE_BYTES` of weights: more than a last-level cache holds), at one row and at eight, in
alternating rounds, and takes the one with the least summed median time (about 0.3 s on the
fixture; once per process for the same linear shapes). The choice, and
every candidate's time, is one INFO record (event `cpu_linear_kernel`) and in `specctl
status`. Naming a kernel skips the measurement.

Under tensor parallelism `auto` measures nothing and takes "onednn" ("mkl" with
`--cpu-compile`) on every rank: ranks measuring apart, on shared cores, could choose apart.

With `--cpu-compile` "onednn" is no candidate: compiled steps cannot lower oneDNN's packed
op, and the eager steps beside them (a fallback, the background compilation's first steps)
must compute the same GEMMs; "transposed" lowers to the same `mm` it calls eagerly.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specd.workers.config import CPU_LINEAR_KERNELS
from specd.workers.models.layers import PackedLinear, TransposedLinear, can_pack

log = logging.getLogger("specd.cpu_linears")

SAMPLE_BYTES = 64 << 20
MEASURED_ROWS = (1, 8)
_ROUNDS = 3
# Each (candidates, sampled shapes) measured once per process: the machine does not change
# under it, and tests build hundreds of engines over the same weights' shapes.
_MEASURED: dict[tuple[tuple[str, ...], tuple[tuple[int, int, bool], ...]], dict[str, float]] = {}


@dataclass(frozen=True)
class LinearKernelChoice:
    """The float32 kernel (None: the model has no float32 linear), how it was chosen
    ("auto", "requested" or "tensor parallel"), and each candidate's measured ms per pass
    over the sample (summed over MEASURED_ROWS; empty unless measured)."""

    kernel: str | None
    how: str
    ms: dict[str, float]

    def describe(self) -> str:
        if self.kernel is None:
            return "no float32 linears"
        if self.how == "tensor parallel":
            return f"float32 on {self.kernel} (tensor parallel: every rank alike, not measured)"
        if not self.ms:
            return f"float32 on {self.kernel} (requested)"
        times = ", ".join(f"{k} {ms:.2f}" for k, ms in self.ms.items())
        return f"float32 on {self.kernel} (fastest measured, ms: {times})"


def candidates(compiles: bool) -> tuple[str, ...]:
    """The float32 kernels this process can use (module docstring)."""
    onednn = torch.backends.mkldnn.is_available() and not compiles
    return tuple(k for k in CPU_LINEAR_KERNELS if k != "onednn" or onednn)


def choose_float32_kernel(model: nn.Module, requested: str, compiles: bool,
                          tensor_parallel: bool = False) -> LinearKernelChoice:
    """`requested` ("auto" or a kernel) resolved for `model`'s float32 linears (module
    docstring; tensor_parallel: `auto` is not measured). A requested kernel this process
    cannot use raises ValueError."""
    linears = [m for m in model.modules()
               if isinstance(m, nn.Linear) and can_pack(m) and m.weight.dtype == torch.float32]
    allowed = candidates(compiles)
    if requested != "auto" and requested not in allowed:
        raise ValueError(f"--cpu-linear {requested} is not available here "
                         f"(available: auto, {', '.join(allowed)})")
    if not linears:
        choice = LinearKernelChoice(None, requested, {})
    elif requested != "auto":
        choice = LinearKernelChoice(requested, "requested", {})
    elif tensor_parallel:
        choice = LinearKernelChoice("onednn" if "onednn" in allowed else "mkl",
                                    "tensor parallel", {})
    else:
        sample = _sample(linears)
        key = (allowed, tuple((m.in_features, m.out_features, m.bias is not None)
                              for m in sample))
        ms = _MEASURED.get(key) or _MEASURED.setdefault(key, measure(sample, allowed))
        choice = LinearKernelChoice(min(ms, key=ms.__getitem__), "auto", ms)
    log.info("float32 linears: %s", choice.describe(),
             extra={"event": "cpu_linear_kernel", "kernel": choice.kernel, "how": choice.how,
                    "ms": {k: round(v, 3) for k, v in choice.ms.items()}})
    return choice


def _sample(linears: list[nn.Linear]) -> list[nn.Linear]:
    """The first linears in model order up to SAMPLE_BYTES of weights (at least one)."""
    sample: list[nn.Linear] = []
    total = 0
    for linear in linears:
        if sample and total >= SAMPLE_BYTES:
            break
        sample.append(linear)
        total += linear.weight.numel() * linear.weight.element_size()
    return sample


_BUILD: dict[str, Callable[[nn.Linear], nn.Module]] = {
    "mkl": lambda linear: linear,
    "onednn": PackedLinear,
    "transposed": TransposedLinear,
}


@torch.inference_mode()
def measure(linears: list[nn.Linear], kernels: tuple[str, ...]) -> dict[str, float]:
    """Each kernel's ms for one pass over `linears` in order, summed over MEASURED_ROWS:
    the median of _ROUNDS timed passes, the kernels alternating within each round so that
    a drift of the machine's speed falls on all of them."""
    built = {k: [_BUILD[k](linear) for linear in linears] for k in kernels}
    inputs = {(rows, linear.in_features): torch.randn(rows, linear.in_features)
              for rows in MEASURED_ROWS for linear in linears}
    times: dict[tuple[str, int], list[float]] = {(k, r): [] for k in kernels
                                                 for r in MEASURED_ROWS}
    for round_index in range(_ROUNDS + 1):  # round 0 warms every kernel up, untimed
        for rows in MEASURED_ROWS:
            for kernel in kernels:
                modules = built[kernel]
                t0 = time.perf_counter()
                for module, linear in zip(modules, linears, strict=True):
                    module(inputs[rows, linear.in_features])
                if round_index:
                    times[kernel, rows].append(time.perf_counter() - t0)
    return {k: sum(statistics.median(times[k, r]) for r in MEASURED_ROWS) * 1e3
            for k in kernels}
