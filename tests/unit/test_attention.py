"""Paged attention on the CPU against a brute-force reference written from the contract.

The reference attends each query row on its own: it reads the sequence's keys slot by slot
through the block table and applies the rule literally (prefix keys always visible; among
the last T keys, j <= i for causal rows, bit j of the row's tree mask otherwise).
Tolerance: both sides are float32 softmax-weighted sums of the same values in a different
order, so they agree to ~1e-6; 1e-5 is the bound.
"""

from __future__ import annotations

import pytest
import torch

from specd.workers.runner.attention import build_attention_metadata, paged_attention_cpu, store_kv

BLOCK_SIZE = 4
NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 2, 6, 8
CPU = torch.device("cpu")


def reference(q: torch.Tensor, cache: torch.Tensor, query_lens: list[int], seq_lens: list[int],
              tables: list[list[int]], scale: float, tree_mask: torch.Tensor | None
              ) -> torch.Tensor:
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.empty_like(q)
    row = 0
    for t, s, table in zip(query_lens, seq_lens, tables, strict=True):
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(s)]
        k = cache[0].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].repeat_interleave(group, 1)
        v = cache[1].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].repeat_interleave(group, 1)
        for i in range(t):
            visible = [j < s - t or (
                j - (s - t) <= i if tree_mask is None
                else bool((int(tree_mask[row + i]) >> (j - (s - t))) & 1)) for j in range(s)]
            scores = torch.einsum("hd,shd->hs", q[row + i], k) * scale  # [heads, S]
            scores[:, ~torch.tensor(visible)] = float("-inf")
            out[row + i] = torch.einsum("hs,shd->hd", scores.softmax(-1), v)
        row += t
    return out


def random_case(query_lens: list[int], seq_lens: list[int], seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in seq_lens) + 3
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()  # scattered, out-of-order blocks
    tables = []
    for s in seq_lens:
        n = -(-s // BLOCK_SIZE)
        tables.append(order[:n])
        order = order[n:]
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=g)
    return q, cache, tables


@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1] * 5, [1, 4, 5, 9, 17]),  # decode: one group
    ([7, 1, 3, 1], [7, 12, 3, 5]),  # prefill, chunk over a prefix, decodes: three groups
    ([5, 5], [5, 13]),
])
def test_causal_paged_attention_matches_reference(query_lens: list[int],
                                                  seq_lens: list[int]) -> None:
    q, cache, tables = random_case(query_lens, seq_lens, seed=0)
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, CPU)
    got = paged_attention_cpu(q, cache, meta, scale=0.3)
    torch.testing.assert_close(got, reference(q, cache, query_lens, seq_lens, tables, 0.3, None),
                               atol=1e-5, rtol=0)


def test_tree_masked_paged_attention_matches_reference() -> None:
    # Two draft trees of 4 rows over prefixes of 6 and 9 keys: root, two children, one
    # grandchild (bits: row i sees itself and its ancestors), and a 64-row tree that uses
    # the sign bit of the int64 mask.
    query_lens, seq_lens = [4, 4, 64], [10, 13, 70]
    tree = [0b0001, 0b0011, 0b0101, 0b1011]
    chain = [(1 << (i + 1)) - 1 if i < 63 else -1 for i in range(64)]
    mask = torch.tensor(tree + tree + chain, dtype=torch.int64)
    q, cache, tables = random_case(query_lens, seq_lens, seed=1)
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, CPU, mask)
    got = paged_attention_cpu(q, cache, meta, scale=0.3)
    torch.testing.assert_close(got, reference(q, cache, query_lens, seq_lens, tables, 0.3, mask),
                               atol=1e-5, rtol=0)


def test_slot_mapping_and_store_kv_write_each_token_into_its_block() -> None:
    # Sequence 0 computes KV positions 5..7 (blocks [3, 0]); sequence 1 position 2 (block [2]).
    meta = build_attention_metadata([3, 1], [8, 3], [[3, 0], [2]], BLOCK_SIZE, CPU)
    assert meta.slot_mapping.tolist() == [1, 2, 3, 10]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    cache = torch.zeros(2, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = torch.arange(4.0)[:, None, None].expand(4, NUM_KV_HEADS, HEAD_DIM)
    store_kv(k, -k, cache, meta.slot_mapping)
    assert cache[0, 0, 1:4, 0, 0].tolist() == [0.0, 1.0, 2.0]
    assert cache[0, 2, 2, 0, 0].item() == 3.0 and cache[1, 2, 2, 0, 0].item() == -3.0


@pytest.mark.parametrize(("query_lens", "seq_lens", "tables", "message"), [
    ([2], [1], [[0]], "query_len"),
    ([1], [9], [[0, 1]], "cannot hold"),
    ([1, 1], [1], [[0]], "one query_len"),
])
def test_inconsistent_lengths_are_rejected(query_lens: list[int], seq_lens: list[int],
                                           tables: list[list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, CPU)


def test_cpu_path_agrees_with_the_kernel_reference() -> None:
    """The CPU path and the Triton kernel's pure-torch reference implement one contract."""
    tree_attention = pytest.importorskip("specd.kernels.tree_attention")
    query_lens, seq_lens = [4, 1, 6], [10, 7, 6]
    mask = torch.tensor([0b0001, 0b0011, 0b0101, 0b1011, 1] + [(1 << (i + 1)) - 1
                                                              for i in range(6)])
    q, cache, tables = random_case(query_lens, seq_lens, seed=2)
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, CPU, mask)
    expected = tree_attention.tree_attention_ref(
        q, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
        meta.tree_mask, 0.3, meta.max_query_len)
    torch.testing.assert_close(paged_attention_cpu(q, cache, meta, 0.3), expected, atol=1e-5,
                               rtol=0)


def test_a_device_side_shift_gives_the_metadata_of_the_shifted_lengths() -> None:
    # Overlap scheduling of speculation: the host builds a step from lower-bound lengths
    # and the device adds what it alone knows (accepted drafts). The result must be the
    # metadata of the true lengths: same slots, lengths and attention output.
    query_lens, seq_lens, shifts = [4, 1, 4, 7], [9, 5, 6, 7], [2, 0, 3, 0]
    true_lens = [s + d for s, d in zip(seq_lens, shifts, strict=True)]
    q, cache, tables = random_case(query_lens, [s + 3 for s in seq_lens], seed=5)
    exact = build_attention_metadata(query_lens, true_lens, tables, BLOCK_SIZE, CPU)
    shifted = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, CPU,
                                       shift=torch.tensor(shifts), max_shift=[3, 0, 3, 0])
    assert torch.equal(shifted.slot_mapping, exact.slot_mapping)
    assert torch.equal(shifted.seq_lens, exact.seq_lens)
    assert shifted.max_seq_len >= exact.max_seq_len
    scale = HEAD_DIM ** -0.5
    torch.testing.assert_close(paged_attention_cpu(q, cache, shifted, scale),
                               reference(q, cache, query_lens, true_lens, tables, scale, None),
                               rtol=1e-5, atol=1e-5)


def test_a_shift_needs_blocks_for_its_bound() -> None:
    _, _, tables = random_case([2], [8], seed=6)  # two blocks: 8 tokens
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([2], [7], tables, BLOCK_SIZE, CPU, shift=torch.tensor([0]),
                                 max_shift=[2])
