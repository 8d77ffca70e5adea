"""The kernels compiled for a real GPU (skipped without CUDA): correctness at production sizes
and a speed floor. Run with TRITON_INTERPRET=0 (tools/gpu_check.sh does), since the test
conftest turns the interpreter on by default.

Speed floors are regression guards set below the kernel targets (tools/bench_kernels.py
states them and measures against them): INT4 at M = 1 at least 2x bf16 matmul, tree
attention no slower than SDPA with a dense mask.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from specd.kernels.int4_gemm import int4_gemm, int4_gemm_ref
from specd.kernels.int4_layout import column_major
from specd.kernels.tree_attention import tree_attention, tree_attention_ref
from specd.workers.models.quantization import quantize_rtn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: set TRITON_INTERPRET=0 to compile for the GPU"),
]


def _bench_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


@pytest.mark.parametrize("m", [1, 3, 16, 17, 64, 65, 300])
@pytest.mark.parametrize(("k", "n", "group_size"), [(4096, 14336, 32), (7168, 2048, 32),
                                                    (2048, 7168, 128), (4096, 4104, 64)])
@pytest.mark.parametrize("layout", ["checkpoint", "column_major"])
def test_int4_gemm_matches_reference_on_gpu(m: int, k: int, n: int, group_size: int,
                                            layout: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m + n)
    weight = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    packed, scale = quantize_rtn(weight, group_size)
    if layout == "column_major":  # as Int4Linear stores them
        packed, scale = column_major(packed), column_major(scale)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    # Same values, different fp32 summation order: one output ulp, plus fp32 drift over K.
    torch.testing.assert_close(int4_gemm(x, packed, scale, group_size).float(),
                               int4_gemm_ref(x, packed, scale, group_size).float(),
                               rtol=2**-7, atol=1e-2)


def test_int4_gemv_is_at_least_twice_bf16() -> None:
    k, n = 4096, 14336
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, scale = quantize_rtn(weight, 32)
    packed, scale = column_major(packed), column_major(scale)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    t_int4 = _bench_ms(lambda: int4_gemm(x, packed, scale, 32))
    t_bf16 = _bench_ms(lambda: torch.matmul(x, weight.t()))
    assert t_bf16 / t_int4 >= 2.0, f"int4 {t_int4 * 1e3:.1f} us vs bf16 {t_bf16 * 1e3:.1f} us"


def _paged_case(query_lens: list[int], seq_lens: list[int], block_size: int = 16,
                heads: int = 32, kv_heads: int = 8, head_dim: int = 128
                ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(sum(seq_lens))
    per_seq = [-(-s // block_size) for s in seq_lens]
    kv = torch.randn(2, sum(per_seq), block_size, kv_heads, head_dim, device="cuda",
                     generator=gen, dtype=torch.bfloat16)
    ids = torch.randperm(sum(per_seq), device="cuda", generator=gen)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device="cuda")
    offset = 0
    for b, count in enumerate(per_seq):
        tables[b, :count] = ids[offset:offset + count].to(torch.int32)
        offset += count
    q = torch.randn(sum(query_lens), heads, head_dim, device="cuda", generator=gen,
                    dtype=torch.bfloat16)
    qsl = torch.tensor([0, *query_lens], device="cuda").cumsum(0).to(torch.int32)
    return q, kv, tables, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), qsl


@pytest.mark.parametrize("splits", [None, 1, 4])
def test_tree_attention_matches_reference_on_gpu(splits: int | None) -> None:
    query_lens, seq_lens = [1, 8, 64, 5], [3000, 520, 64 + 1000, 5]
    q, kv, tables, s_lens, qsl = _paged_case(query_lens, seq_lens)
    chain = [(1 << (i + 1)) - 1 for i in range(64)]
    masks = [m - (1 << 64) if m >= 1 << 63 else m for m in chain]
    tree = torch.tensor(masks[:1] + masks[:8] + masks + masks[:5], dtype=torch.int64,
                        device="cuda")
    for tree_mask in (None, tree):
        args = (q, kv[0], kv[1], tables, s_lens, qsl, tree_mask, 128**-0.5, 64)
        torch.testing.assert_close(tree_attention(*args, num_kv_splits=splits).float(),
                                   tree_attention_ref(*args).float(), rtol=2**-7, atol=2e-2)


def test_tree_attention_decode_not_slower_than_sdpa() -> None:
    batch, prefix = 4, 8192
    q, kv, tables, s_lens, qsl = _paged_case([1] * batch, [prefix] * batch)
    args = (q, kv[0], kv[1], tables, s_lens, qsl, None, 128**-0.5, 1)
    t_tree = _bench_ms(lambda: tree_attention(*args, max_seq_len=prefix))
    pos = torch.arange(prefix, device="cuda")
    slots = tables[:, pos // 16].long() * 16 + pos % 16  # [B, S]
    k = kv[0].view(-1, 8, 128)[slots].transpose(1, 2).contiguous()
    v = kv[1].view(-1, 8, 128)[slots].transpose(1, 2).contiguous()
    mask = torch.ones(batch, 1, 1, prefix, dtype=torch.bool, device="cuda")
    q_sdpa = q.view(batch, 1, 32, 128).transpose(1, 2)
    t_sdpa = _bench_ms(lambda: F.scaled_dot_product_attention(q_sdpa, k, v, attn_mask=mask,
                                                              enable_gqa=True))
    assert t_tree <= t_sdpa, f"tree {t_tree * 1e3:.1f} us vs sdpa {t_sdpa * 1e3:.1f} us"
