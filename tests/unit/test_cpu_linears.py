"""How `--cpu-linear` resolves (workers/runner/cpu_linears.py): `auto` measures every
candidate and takes the fastest; under tensor parallelism it measures nothing, so that
every rank runs the same kernel; a model without float32 linears has no kernel; a kernel
that cannot run here is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specd.workers.runner.cpu_linears import choose_float32_kernel


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False)).to(dtype)


def test_auto_takes_the_fastest_measured_candidate() -> None:
    choice = choose_float32_kernel(_model(), "auto", compiles=False)
    assert choice.how == "auto" and set(choice.ms) == {"mkl", "onednn", "transposed"}
    assert choice.kernel == min(choice.ms, key=choice.ms.__getitem__)


def test_under_tensor_parallelism_auto_measures_nothing_and_every_rank_runs_alike() -> None:
    eager = choose_float32_kernel(_model(), "auto", compiles=False, tensor_parallel=True)
    assert (eager.kernel, eager.ms) == ("onednn", {})
    assert eager.describe() == ("float32 on onednn (tensor parallel: every rank alike, "
                                "not measured)")
    compiled = choose_float32_kernel(_model(), "auto", compiles=True, tensor_parallel=True)
    assert (compiled.kernel, compiled.ms) == ("mkl", {})


def test_a_named_kernel_is_taken_unmeasured_and_one_that_cannot_run_is_refused() -> None:
    named = choose_float32_kernel(_model(), "transposed", compiles=True)
    assert (named.kernel, named.how, named.ms) == ("transposed", "requested", {})
    with pytest.raises(ValueError, match="--cpu-linear onednn is not available here"):
        choose_float32_kernel(_model(), "onednn", compiles=True)


def test_a_model_without_float32_linears_has_no_kernel() -> None:
    choice = choose_float32_kernel(_model(torch.bfloat16), "auto", compiles=False)
    assert choice.kernel is None and choice.describe() == "no float32 linears"
