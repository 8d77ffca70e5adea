"""The split-KV merge kernel (kernels/split_kv.py, under TRITON_INTERPRET=1) against its torch
reference, and the attention launchers merging their splits with it alone.

Tolerance: kernel and reference compute the same fp32 weights and sums in another order
(relative 1e-6); after the rounding to the output dtype they may then differ by one unit:
rtol = atol / max = eps of the output dtype (1e-6 for fp32 outputs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from specd.kernels.mla_attention import mla_attention
from specd.kernels.split_kv import merge_splits, merge_splits_ref
from specd.kernels.tree_attention import tree_attention


def _operands(splits: int, n: int, heads: int, dim: int, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random partials and log2-sum-exps, some splits empty (-inf, zero partial)."""
    g = torch.Generator().manual_seed(seed)
    partial = torch.randn(splits, n, heads, dim, generator=g)
    lse = torch.randn(splits, n, heads, generator=g) * 8
    empty = torch.rand(splits, n, heads, generator=g) < 0.25
    lse[empty] = float("-inf")
    partial[empty] = 0.0
    return partial, lse


def _assert_merges(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    expected = merge_splits_ref(partial, lse)
    got = merge_splits(partial, lse, out)
    assert got is out
    eps = 1e-6 if out.dtype == torch.float32 else torch.finfo(out.dtype).eps
    torch.testing.assert_close(got.float(), expected, rtol=eps,
                               atol=eps * float(expected.abs().max()))


@pytest.mark.parametrize(("splits", "n", "heads", "dim"), [
    (2, 3, 4, 64), (16, 2, 8, 128), (3, 5, 1, 512), (5, 1, 2, 576), (1, 4, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_reference(splits: int, n: int, heads: int, dim: int,
                                  dtype: torch.dtype) -> None:
    partial, lse = _operands(splits, n, heads, dim, seed=splits * 31 + dim)
    _assert_merges(partial, lse, torch.empty(n, heads, dim, dtype=dtype))


def test_a_row_no_split_saw_is_zero_and_strides_are_read() -> None:
    partial, lse = _operands(4, 3, 2, 64, seed=1)
    lse[:, 1, 0] = float("-inf")
    partial[:, 1, 0] = 0.0
    out = torch.full((3, 6, 64), float("nan"), dtype=torch.bfloat16)[:, ::3]  # strided
    _assert_merges(partial.transpose(1, 2).contiguous().transpose(1, 2), lse, out)
    assert torch.equal(out[1, 0], torch.zeros(64, dtype=torch.bfloat16))


def test_bad_operands_raise() -> None:
    partial, lse = _operands(2, 3, 4, 64, seed=0)
    out = torch.empty(3, 4, 64)
    with pytest.raises(ValueError, match="partial must be float32"):
        merge_splits(partial.bfloat16(), lse, out)
    with pytest.raises(ValueError, match="lse must be float32"):
        merge_splits(partial, lse[:, :2], out)
    with pytest.raises(ValueError, match="out must be"):
        merge_splits(partial, lse, out[:, :2])
    with pytest.raises(ValueError, match="between 1 and 16 splits"):
        merge_splits(partial[:1].expand(17, -1, -1, -1), lse[:1].expand(17, -1, -1), out)


class _TorchOps(TorchDispatchMode):
    """Records every torch op outside the Triton kernels' simulation."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@contextmanager
def _ops_outside_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    from triton.runtime.interpreter import InterpretedFunction

    real_run = InterpretedFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return real_run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    mode = _TorchOps()
    with mode:
        yield mode.ops


ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided", "unsqueeze", "slice",
               "select", "as_strided", "view", "t", "transpose", "alias", "detach",
               "lift_fresh"}


def test_the_attention_kernels_merge_their_splits_in_one_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With 8 KV splits, tree and MLA attention run no torch arithmetic between their
    kernels (the attention kernel, then the merge): only allocations and views."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 12, 16, 2, 64, generator=g).bfloat16()
    cache = torch.randn(12, 16, 80, generator=g).bfloat16()
    tables = torch.arange(12, dtype=torch.int32).view(2, 6)
    seq_lens = torch.tensor([90, 60], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    q = torch.randn(2, 4, 64, generator=g).bfloat16()
    q_lat, q_pe = torch.randn(2, 4, 64, generator=g).bfloat16(), torch.randn(
        2, 4, 16, generator=g).bfloat16()
    with _ops_outside_kernels(monkeypatch) as ops:
        tree_attention(q, kv[0], kv[1], tables, seq_lens, qsl, None, 0.125, 1, num_kv_splits=8)
        mla_attention(q_lat, q_pe, cache, tables, seq_lens, qsl, None, 0.125, 1,
                      num_kv_splits=8)
    assert ops and set(ops) <= ALLOCATIONS, sorted(set(ops) - ALLOCATIONS)
