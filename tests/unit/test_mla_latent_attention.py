"""The CPU absorbed MLA attention (one masked SDPA per query group) against the pure-torch
reference of the Triton kernel, `kernels/mla_attention.py`'s `mla_attention_ref` (one
sequence at a time): same latent cache layout, same metadata, causal rows and tree rows.

Tolerance: float32; SDPA and the reference's einsums sum in different orders, ~1e-7 on
outputs of ~1; atol 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from specd.workers.runner.attention import build_attention_metadata
from specd.workers.runner.latent_attention import absorbed_group, store_latent

mla_kernel = pytest.importorskip("specd.kernels.mla_attention")

HEADS, RANK, ROPE, BLOCK_SIZE, NUM_BLOCKS = 3, 16, 8, 4, 40
CPU = torch.device("cpu")


@pytest.mark.parametrize("tree", [False, True])
def test_group_attention_matches_the_kernel_reference(tree: bool) -> None:
    g = torch.Generator().manual_seed(0)
    query_lens = [5, 1, 5, 1, 3] if tree else [7, 1, 3, 1, 7]
    seq_lens = [q + p for q, p in zip(query_lens, (9, 14, 2, 5, 0), strict=True)]
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    tree_mask = None
    if tree:  # each row sees itself and a random subset of the earlier rows of its tree
        bits = [(int(torch.randint(0, 2**i, (), generator=g)) if i else 0) | 1 << i
                for t in query_lens for i in range(t)]
        tree_mask = torch.tensor(bits, dtype=torch.int64)
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, CPU, tree_mask)
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, RANK + ROPE, generator=g)
    n = sum(query_lens)
    store_latent(torch.randn(n, RANK + ROPE, generator=g), cache, meta.slot_mapping)
    q_latent = torch.randn(n, HEADS, RANK, generator=g)
    q_pe = torch.randn(n, HEADS, ROPE, generator=g)
    scale = 0.37
    got = torch.empty(n, HEADS, RANK)
    for group in meta.groups:
        got[group.rows] = absorbed_group(q_latent[group.rows], q_pe[group.rows], cache, group,
                                         scale)
    expected = mla_kernel.mla_attention_ref(q_latent, q_pe, cache, meta.block_tables,
                                            meta.seq_lens, meta.query_start_loc, tree_mask,
                                            scale, meta.max_query_len)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
