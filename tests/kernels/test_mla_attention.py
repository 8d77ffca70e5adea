"""MLA attention: the reference against brute force, the Triton kernel (under TRITON_INTERPRET=1)
against the reference, and the launcher's checks.

Kernel tolerance: the kernel computes the scores in fp32 from the same inputs as the reference
but, as every flash-attention kernel on the GPU, rounds the softmax weights p to the cache dtype
before the p.c product and rescales online. That moves each output by at most eps * max|c|
(sum of |dp_j| |c_j| with sum p_j = 1), doubled for the final rounding of both outputs:
2 * eps * max|c|. In fp32 that term is smaller than the scores' own rounding: the two sides
sum the R + P products in different orders, which moves a score by about
sqrt(R + P) * eps * max|q| * max|k| * scale (random-walk growth; 4x margin below), and a
softmax whose scores move by d moves its output by at most 2 * d * max|c|.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from specd.kernels.mla_attention import mla_attention, mla_attention_ref

KIMI_SCALE = 0.13086  # Kimi-K2: 192^-0.5 * yarn_get_mscale(32, 1)^2, not 576^-0.5


def _random_tree_masks(num_tokens: int, gen: torch.Generator) -> list[int]:
    """Bit masks of a random tree in topological order: row i sees itself and its ancestors."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_tokens)]
    masks = []
    for i in range(num_tokens):
        bits, node = 0, i
        while node >= 0:
            bits |= 1 << node
            node = parents[node]
        masks.append(bits - (1 << 64) if bits >= 1 << 63 else bits)  # as int64
    return masks


def _chain_masks(num_tokens: int) -> list[int]:
    return [(1 << (i + 1)) - 1 for i in range(num_tokens)]


class Case:
    """Sequences over a paged latent cache with shuffled block ids, the queries as the model
    produces them: q_latent a head-major bmm output transposed, q_pe a slice of q_b_proj's
    [N, H, qk_nope + rope] output, the cache one layer of a two-layer pool."""

    def __init__(self, query_lens: list[int], seq_lens: list[int], num_heads: int, rank: int,
                 rope: int, block_size: int, dtype: torch.dtype, seed: int,
                 masks: str = "causal") -> None:
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
        self.kv_cache = torch.randn(2, num_blocks, block_size, rank + rope,
                                    generator=gen).to(dtype)[1]
        n = sum(query_lens)
        self.q_latent = torch.randn(num_heads, n, rank, generator=gen).to(dtype).transpose(0, 1)
        self.q_pe = torch.randn(n, num_heads, 8 + rope, generator=gen).to(dtype)[..., 8:]
        self.query_lens, self.seq_lens, self.block_size = query_lens, seq_lens, block_size
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        self.query_start_loc = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
        self.masks: list[int] | None = None
        if masks != "causal":
            self.masks = []
            for t in query_lens:
                self.masks += _chain_masks(t) if masks == "chain" else _random_tree_masks(t, gen)
        self.gen = gen

    @property
    def tree_mask(self) -> torch.Tensor | None:
        return None if self.masks is None else torch.tensor(self.masks, dtype=torch.int64)

    def run(self, fn: Callable[..., torch.Tensor], **kwargs: int) -> torch.Tensor:
        return fn(self.q_latent, self.q_pe, self.kv_cache, self.block_tables, self.seq_lens_t,
                  self.query_start_loc, self.tree_mask, KIMI_SCALE, max(self.query_lens),
                  **kwargs)

    def brute_force(self) -> torch.Tensor:
        """float64, one query row at a time: the visible cache rows picked by Python loops,
        scores over the concatenated [q_latent | q_pe] . row, V = the row's first R values."""
        rank = self.q_latent.shape[-1]
        q = torch.cat([self.q_latent, self.q_pe], dim=-1).double()  # [N, H, R + P]
        out = torch.zeros(self.q_latent.shape, dtype=torch.float64)
        row = 0
        for b, (t, s) in enumerate(zip(self.query_lens, self.seq_lens, strict=True)):
            for i in range(t):
                keys = []
                for p in range(s):
                    j = p - (s - t)
                    seen = j < 0 or (j <= i if self.masks is None
                                     else (self.masks[row] >> j) & 1 == 1)
                    if seen:
                        block = self.tables[b][p // self.block_size]
                        keys.append(self.kv_cache[block, p % self.block_size].double())
                if keys:
                    k = torch.stack(keys)  # [visible, R + P]
                    probs = torch.softmax(q[row] @ k.T * KIMI_SCALE, dim=-1)  # [H, visible]
                    out[row] = probs @ k[:, :rank]
                row += 1
        return out

    def assert_kernel_matches_ref(self, **kwargs: int) -> None:
        out, ref = self.run(mla_attention, **kwargs), self.run(mla_attention_ref)
        eps = torch.finfo(self.q_latent.dtype).eps
        max_c = float(self.kv_cache[..., :self.q_latent.shape[-1]].abs().max())
        max_q = max(float(self.q_latent.abs().max()), float(self.q_pe.abs().max()))
        score_err = (4 * math.sqrt(self.kv_cache.shape[-1]) * torch.finfo(torch.float32).eps
                     * max_q * float(self.kv_cache.abs().max()) * KIMI_SCALE)
        atol = 2 * eps * max_c + 2 * score_err * max_c
        torch.testing.assert_close(out.float(), ref.float(), rtol=eps, atol=atol)


# ----------------------------------------------------------------------------- reference

REF_CASES = {  # name: (query_lens, seq_lens, masks, block_size)
    # a token alone, one ending a block, one opening a block, a longer prefix
    "decode batch": ([1, 1, 1, 1], [1, 16, 17, 40], "causal", 16),
    # drafts crossing a block boundary; a prefix of exactly two blocks
    "chain as bits": ([4, 5], [16, 37], "chain", 16),
    "chain causal": ([4, 5], [16, 37], "causal", 16),
    "tree": ([6, 3, 1], [16, 48, 8], "tree", 16),
    "tree odd blocks": ([7, 2], [7 + 13, 2 + 1], "tree", 7),
    "prefill chunk": ([9, 1], [9, 23], "causal", 4),
}


@pytest.mark.parametrize("name", list(REF_CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_matches_brute_force(name: str, dtype: torch.dtype) -> None:
    query_lens, seq_lens, masks, block_size = REF_CASES[name]
    case = Case(query_lens, seq_lens, 3, 32, 16, block_size, dtype, seed=len(name),
                masks=masks)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(case.run(mla_attention_ref).double(), case.brute_force(),
                               rtol=tol, atol=tol)


def test_reference_at_kimi_widths() -> None:
    case = Case([3, 1], [3 + 20, 30], 2, 512, 64, 16, torch.float64, seed=3, masks="tree")
    torch.testing.assert_close(case.run(mla_attention_ref), case.brute_force(), rtol=1e-12,
                               atol=1e-12)


def test_absorbed_attention_equals_expanded_mha() -> None:
    """The contract the model relies on: with q_latent = q_nope W_UK per head, the output times
    W_UV is multi-head attention with k_nope = W_UK c, v = W_UV c and the shared roped k_pe."""
    heads, nope, rope, v_dim, rank, t, s = 4, 16, 16, 8, 32, 5, 29
    case = Case([t], [s], heads, rank, rope, 8, torch.float64, seed=11, masks="tree")
    w_uk = torch.randn(heads, nope, rank, generator=case.gen, dtype=torch.float64)
    w_uv = torch.randn(heads, v_dim, rank, generator=case.gen, dtype=torch.float64)
    q_nope = torch.randn(t, heads, nope, generator=case.gen, dtype=torch.float64)
    case.q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    out = torch.einsum("thr,hvr->thv", case.run(mla_attention_ref), w_uv)  # [T, H, v]

    pos = torch.arange(s)
    rows = case.kv_cache[case.block_tables[0, pos // 8].long(), pos % 8]  # [S, R + P]
    k_nope = torch.einsum("hnr,sr->shn", w_uk, rows[:, :rank])
    v = torch.einsum("hvr,sr->shv", w_uv, rows[:, :rank])
    scores = (torch.einsum("thn,shn->hts", q_nope, k_nope)
              + torch.einsum("thp,sp->hts", case.q_pe, rows[:, rank:])) * KIMI_SCALE
    bits = torch.tensor(case.masks)[:, None]
    rel = pos[None, :] - (s - t)
    visible = (rel < 0) | (((bits >> rel.clamp(min=0)) & 1) == 1)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    torch.testing.assert_close(out, torch.einsum("hts,shv->thv", probs, v), rtol=1e-10,
                               atol=1e-10)


# ----------------------------------------------------------------------------- kernel


@pytest.mark.parametrize(("num_heads", "block_size", "seq_lens"), [
    (1, 16, [1, 16, 17, 40]),   # one head; a lone token, block boundaries
    (8, 7, [9, 64]),            # TP8 Kimi heads, odd block size
    (16, 32, [33]),             # DeepSeek-V3 TP8 heads: 16 rows, one full tile
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_matches_reference(num_heads: int, block_size: int, seq_lens: list[int],
                                  dtype: torch.dtype) -> None:
    case = Case([1] * len(seq_lens), seq_lens, num_heads, 32, 16, block_size, dtype,
                seed=num_heads + block_size)
    case.assert_kernel_matches_ref()


@pytest.mark.parametrize("masks", ["tree", "chain", "causal"])
def test_drafts_over_variable_prefixes(masks: str) -> None:
    """Draft blocks of 4, 9 and 1 tokens (the 9 span two M tiles at 8 heads) whose new keys
    cross a block boundary, over prefixes of 12, 70 and 2."""
    case = Case([4, 9, 1], [16, 79, 3], 8, 32, 16, 16, torch.bfloat16, seed=5, masks=masks)
    case.assert_kernel_matches_ref()


def test_chain_bits_equal_causal() -> None:
    case = Case([6, 3], [20, 40], 4, 32, 16, 16, torch.float16, seed=9, masks="chain")
    chain = case.run(mla_attention)
    case.masks = None
    torch.testing.assert_close(chain, case.run(mla_attention), rtol=0, atol=0)


@pytest.mark.parametrize("num_heads", [64, 128])
def test_many_heads_span_m_tiles(num_heads: int) -> None:
    """Kimi-K2 and DeepSeek-V3 without TP: one token's heads fill several 64-row tiles."""
    case = Case([1, 2], [10, 21], num_heads, 32, 16, 16, torch.bfloat16, seed=num_heads,
                masks="chain")
    case.assert_kernel_matches_ref()


def test_kimi_widths() -> None:
    """R = 512, P = 64 (576-wide rows), 8 heads: a decode row and a 3-token tree."""
    case = Case([1, 3], [40, 3 + 30], 8, 512, 64, 16, torch.bfloat16, seed=7, masks="tree")
    case.assert_kernel_matches_ref()


def test_full_64_token_tree_uses_bit_63() -> None:
    case = Case([64], [64 + 20], 1, 32, 16, 16, torch.bfloat16, seed=2, masks="tree")
    masks = case.masks or []
    masks[63] |= 1 << 62  # also a non-ancestor bit (stays negative: bit 63 is set)
    case.assert_kernel_matches_ref()


@pytest.mark.parametrize("splits", [2, 3])
def test_kv_splits_merge_to_the_same_output(splits: int) -> None:
    """Flash-decoding splits, including empty ones (a 3-key prefix over 3 splits)."""
    case = Case([1, 3, 1], [130, 3 + 3, 1], 8, 32, 16, 16, torch.bfloat16, seed=splits,
                masks="tree")
    case.assert_kernel_matches_ref(num_kv_splits=splits)
    case.masks = None
    case.assert_kernel_matches_ref(num_kv_splits=splits)


def test_row_seeing_nothing_is_zero() -> None:
    case = Case([2], [2], 2, 32, 16, 16, torch.float16, seed=1)
    case.masks = [0, 3]  # row 0 sees no key, row 1 both
    out = case.run(mla_attention)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    case.assert_kernel_matches_ref()


def test_padded_cache_rows() -> None:
    """A cache whose rows are padded past R + P (row stride 56 for 48 values)."""
    case = Case([2, 1], [19, 5], 4, 32, 16, 8, torch.bfloat16, seed=4)
    padded = torch.zeros(*case.kv_cache.shape[:2], 56, dtype=torch.bfloat16)
    padded[..., :48] = case.kv_cache
    case.kv_cache = padded[..., :48]
    case.assert_kernel_matches_ref()


# ----------------------------------------------------------------------------- launcher


def test_bad_operands_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case([2], [10], 4, 32, 16, 16, torch.bfloat16, seed=3)
    args = (case.q_latent, case.q_pe, case.kv_cache, case.block_tables, case.seq_lens_t,
            case.query_start_loc, None, KIMI_SCALE, 2)

    def call(**changes: Any) -> None:
        names = ("q_latent", "q_pe", "kv_cache", "block_tables", "seq_lens", "query_start_loc",
                 "tree_mask", "softmax_scale", "max_query_len")
        kwargs = dict(zip(names, args, strict=True)) | changes
        mla_attention(**kwargs)

    bad: dict[str, dict[str, Any]] = {
        "q_latent must be": {"q_latent": case.q_latent.to(torch.int32)},
        "q_pe must be torch.bfloat16": {"q_pe": case.q_pe.half()},
        "q_pe must be .* qk_rope_head_dim": {"q_pe": case.q_pe[:, :2]},
        "kv_lora_rank must be a power of two": {"q_latent": case.q_latent[..., :24]},
        "qk_rope_head_dim must be a power of two": {"q_pe": case.q_pe[..., :8]},
        "kv_cache must be .* 48": {"kv_cache": case.kv_cache[..., :40]},
        "kv_cache must be torch.bfloat16": {"kv_cache": case.kv_cache.float()},
        "seq_lens must be int32": {"seq_lens": case.seq_lens_t.long()},
        "query_start_loc must be int32": {"query_start_loc": case.query_start_loc[:1]},
        "block_tables must be contiguous": {
            "block_tables": torch.zeros(1, 4, dtype=torch.int32)[:, ::2]},
        "tree_mask must be int64": {"tree_mask": torch.tensor([1, 3], dtype=torch.int32)},
        "at most 64": {"tree_mask": torch.zeros(2, dtype=torch.int64), "max_query_len": 65},
        "max_query_len must be": {"max_query_len": 0},
        "softmax_scale must be positive": {"softmax_scale": float("nan")},
    }
    for message, changes in bad.items():
        with pytest.raises(ValueError, match=message):
            call(**changes)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        call()


# ----------------------------------------------------------------------------- benchmark


def test_bench_entry_runs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """tools/bench_kernels.py's MLA entry at Kimi widths but a 40-key context, on the CPU with
    a stand-in timer: its cases, its correctness gate and its SDPA baseline run."""
    from tools import bench_kernels
    monkeypatch.setattr(bench_kernels, "DEVICE", "cpu")
    monkeypatch.setattr(bench_kernels, "bench_ms", lambda fn: (fn(), 1.0)[1])
    for t in (1, 4):  # plain decode (no mask) and a tree
        row = bench_kernels.bench_mla(8, t, 40)
        assert (row["t"], row["context"], row["mla_us"]) == (t, 40, 1000.0)
