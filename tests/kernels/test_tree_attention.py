"""Tree attention (Triton, under TRITON_INTERPRET=1) against its pure-torch reference.

Tolerance: the kernel computes q.k in fp32 from the same inputs, but, as every flash-attention
kernel on the GPU, rounds the softmax weights p to the cache dtype before the p.V product and
rescales online; that perturbs each output by at most eps * max|v| (sum of |dp_j| |v_j| with
sum p_j = 1), doubled for the final rounding of the output: atol = 2 * eps * max|v|.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specd.kernels.tree_attention import tree_attention, tree_attention_ref
from specd.workers.runner.attention import build_attention_metadata, paged_attention_cpu


def _random_tree_masks(num_tokens: int, gen: torch.Generator) -> list[int]:
    """Bit masks of a random tree in topological order: row i sees itself and its ancestors."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_tokens)]
    masks = []
    for i in range(num_tokens):
        bits, node = 0, i
        while node >= 0:
            bits |= 1 << node
            node = parents[node]
        masks.append(bits)
    return masks


def _chain_masks(num_tokens: int) -> list[int]:
    return [(1 << (i + 1)) - 1 for i in range(num_tokens)]


class Case:
    """A batch of sequences over a paged cache with shuffled block ids."""

    def __init__(self, query_lens: list[int], seq_lens: list[int], num_heads: int,
                 num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_seq) + 2
        ids = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: list[list[int]] = []
        for n in blocks_per_seq:
            self.tables.append(ids[:n])
            ids = ids[n:]
        width = max(blocks_per_seq)
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables],
                                         dtype=torch.int32)
        # The engine's layout: one [2, blocks, block_size, kv_heads, head_dim] tensor per layer.
        self.kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                              generator=gen).to(dtype)
        n = sum(query_lens)
        # q as the engine slices it out of a fused qkv projection: row stride > heads * dim.
        qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
        self.q = qkv[:, :num_heads * head_dim].view(n, num_heads, head_dim)
        self.query_lens, self.seq_lens, self.block_size = query_lens, seq_lens, block_size
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        starts = torch.tensor([0, *query_lens]).cumsum(0)
        self.query_start_loc = starts.to(torch.int32)
        self.scale = head_dim ** -0.5
        self.gen = gen

    def run(self, fn: Callable[..., torch.Tensor], tree_mask: torch.Tensor | None,
            **kwargs: int) -> torch.Tensor:
        return fn(self.q, self.kv[0], self.kv[1], self.block_tables, self.seq_lens_t,
                  self.query_start_loc, tree_mask, self.scale, max(self.query_lens), **kwargs)

    def assert_kernel_matches_ref(self, tree_mask: torch.Tensor | None, **kwargs: int) -> None:
        out = self.run(tree_attention, tree_mask, **kwargs)
        ref = self.run(tree_attention_ref, tree_mask)
        # float32: nothing is rounded to the cache dtype; the online rescaling and the
        # summation order leave about 1e-6 of max|v|.
        eps = 5e-7 if self.q.dtype == torch.float32 else torch.finfo(self.q.dtype).eps
        atol = 2 * eps * float(self.kv[1].abs().max())
        torch.testing.assert_close(out.float(), ref.float(), rtol=eps, atol=atol)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size", "seq_lens"), [
    (4, 4, 64, 16, [5, 40]),         # MHA, prefixes shorter and longer than a block
    (8, 2, 64, 16, [1, 17, 100]),    # GQA 4, a sequence that is only its new token
    (8, 1, 128, 7, [9, 64]),         # GQA 8 (all heads in one tile), odd block size
    (6, 2, 128, 32, [33]),           # GQA 3, 16-row tile partly padded
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int,
                                  block_size: int, seq_lens: list[int], dtype: torch.dtype) -> None:
    case = Case([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                dtype, seed=len(seq_lens) * 7 + head_dim)
    case.assert_kernel_matches_ref(None)


@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_draft_trees_over_variable_prefixes(shape: str) -> None:
    query_lens, seq_lens = [4, 9, 1], [30, 9 + 70, 3]
    case = Case(query_lens, seq_lens, 8, 2, 64, 16, torch.bfloat16, seed=5)
    masks: list[int] = []
    for t in query_lens:
        masks += _random_tree_masks(t, case.gen) if shape == "tree" else _chain_masks(t)
    case.assert_kernel_matches_ref(torch.tensor(masks, dtype=torch.int64))


def test_chain_mask_equals_causal() -> None:
    """A chain written as bits is the causal case (same kernel output, both paths)."""
    case = Case([6, 3], [20, 40], 4, 2, 64, 16, torch.float16, seed=9)
    chain = torch.tensor(_chain_masks(6) + _chain_masks(3), dtype=torch.int64)
    torch.testing.assert_close(case.run(tree_attention, chain), case.run(tree_attention, None))


def test_full_64_token_tree_uses_bit_63() -> None:
    case = Case([64], [64 + 20], 2, 1, 64, 16, torch.bfloat16, seed=2)
    masks = _random_tree_masks(64, case.gen)
    masks[63] |= 1 << 62  # also check a non-ancestor bit is honoured
    mask = torch.tensor([m - (1 << 64) if m >= 1 << 63 else m for m in masks], dtype=torch.int64)
    case.assert_kernel_matches_ref(mask)


def test_prefill_chunks_causal() -> None:
    """A first chunk (no prefix), a later chunk over a prefix, and a decode row in one batch."""
    case = Case([17, 20, 1], [17, 50, 9], 4, 2, 64, 16, torch.bfloat16, seed=4)
    case.assert_kernel_matches_ref(None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [2, 3])
def test_kv_splits_merge_to_the_same_output(splits: int, dtype: torch.dtype) -> None:
    """Flash-decoding splits, including empty ones (a 3-key prefix over 3 splits)."""
    case = Case([1, 3, 1], [130, 3 + 3, 1], 8, 2, 128, 16, dtype, seed=splits)
    masks = torch.tensor([1, *_random_tree_masks(3, case.gen), 1], dtype=torch.int64)
    case.assert_kernel_matches_ref(masks, num_kv_splits=splits)
    case.assert_kernel_matches_ref(None, num_kv_splits=splits)


def test_row_seeing_nothing_is_zero() -> None:
    case = Case([2], [2], 2, 2, 64, 16, torch.float16, seed=1)
    mask = torch.tensor([0, 3], dtype=torch.int64)  # row 0 sees no key, row 1 both
    out = case.run(tree_attention, mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    case.assert_kernel_matches_ref(mask)


def test_reference_agrees_with_engine_cpu_attention() -> None:
    """The reference against the engine's independent CPU path (grouped masked SDPA), fp32."""
    query_lens, seq_lens = [3, 1, 5], [10, 21, 5]
    case = Case(query_lens, seq_lens, 4, 2, 64, 4, torch.float32, seed=12)
    masks = torch.tensor(_random_tree_masks(3, case.gen) + [1] + _random_tree_masks(5, case.gen),
                         dtype=torch.int64)
    for tree_mask in (None, masks):
        meta = build_attention_metadata(query_lens, seq_lens, case.tables, 4,
                                        torch.device("cpu"), tree_mask)
        expected = paged_attention_cpu(case.q.contiguous(), case.kv, meta, case.scale)
        torch.testing.assert_close(case.run(tree_attention_ref, tree_mask), expected,
                                   rtol=1e-5, atol=1e-5)


def test_bad_operands_raise() -> None:
    case = Case([2], [10], 4, 2, 64, 16, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="tree_mask must be int64"):
        case.run(tree_attention, torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_heads 4 is not a multiple"):
        tree_attention(case.q, case.kv[0, :, :, :1].expand(-1, -1, 3, -1),
                       case.kv[1, :, :, :1].expand(-1, -1, 3, -1), case.block_tables,
                       case.seq_lens_t, case.query_start_loc, None, 1.0, 2)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        tree_attention(case.q, case.kv[0], case.kv[1], case.block_tables,
                       case.seq_lens_t.long(), case.query_start_loc, None, 1.0, 2)
    with pytest.raises(ValueError, match="k_cache must be"):
        tree_attention(case.q, case.kv[0].half(), case.kv[1], case.block_tables,
                       case.seq_lens_t, case.query_start_loc, None, 1.0, 2)
    with pytest.raises(ValueError, match="at most 64"):
        tree_attention(case.q, case.kv[0], case.kv[1], case.block_tables, case.seq_lens_t,
                       case.query_start_loc, torch.zeros(2, dtype=torch.int64), 1.0, 65)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_what_holds_across_split_counts(dtype: torch.dtype) -> None:
    """The split count changes where the softmax weights are rounded (each split rounds p
    against its own running max) and the order of the sums, not the result's accuracy: each
    count is within 2 eps max|v| of the reference, so 1 and 16 splits differ by at most
    4 eps max|v|. In bf16 they do differ (by a unit of bf16 here and there), so greedy tokens
    over bf16 may differ between split counts at a near-tie; in float32 they agree to 1e-6.
    Graph-vs-eager token tests therefore compare runs with the same split count."""
    case = Case([1, 1, 4], [600, 300, 900], 8, 2, 128, 16, dtype, seed=21)
    one = case.run(tree_attention, None, num_kv_splits=1).float()
    many = case.run(tree_attention, None, num_kv_splits=16).float()
    bound = float(case.kv[1].abs().max())
    if dtype == torch.float32:
        torch.testing.assert_close(many, one, rtol=1e-6, atol=1e-6 * bound)
    else:
        eps = torch.finfo(dtype).eps
        assert float((many - one).abs().max()) <= 4 * eps * bound
        assert not torch.equal(many, one)
