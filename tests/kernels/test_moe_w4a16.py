"""The fused INT4 MoE: the alignment's invariants, the torch reference against a brute-force
loop over tokens with compressed-tensors' own decompression as the oracle, and the Triton
kernels against the reference under TRITON_INTERPRET=1 on the CPU; the launcher's errors and
workers/models/moe.py's dispatch.

Tolerances. Reference vs brute force (float32 activations, float64 loop): the same products
summed in another order and precision, ~1e-7 relative to the terms, which cancel in places:
rtol 1e-5 and atol 1e-5 * max|expected|. Kernel vs reference: the
same roundings at the same points (module docstring of kernels/moe_w4a16.py); only the float32
summation order inside the products differs, which can flip a rounding of gate, up, h or y by
one unit of the activation dtype, moving the output by about one unit at its own scale:
rtol = 2 eps, atol = 2 eps * max|reference|.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from specd.kernels import moe_w4a16
from specd.kernels.int4_layout import unpack_zero_point
from specd.kernels.moe_align import (
    max_padded_pairs,
    moe_align_block_size,
    moe_align_block_size_ref,
)
from specd.kernels.moe_w4a16 import (
    FusedMoeConfig,
    Int4ExpertWeights,
    choose_moe_config,
    fused_moe,
    fused_moe_ref,
)
from specd.workers.models.moe import ExpertWeights, experts_forward

ct_pack = pytest.importorskip("compressed_tensors.compressors.pack_quantized.base")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402

Checkpoint = dict[str, torch.Tensor]  # one projection's compressed-tensors tensors


# ----------------------------------------------------------------------------- weights


def _ct_projection(n: int, k: int, group_size: int | None, symmetric: bool,
                   g: torch.Generator) -> Checkpoint:
    """One quantized linear [n, k] as a compressed-tensors checkpoint stores it."""
    groups = 1 if group_size is None else k // group_size
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    tensors = {"weight_packed": pack_to_int32(q, 4),
               "weight_scale": (torch.rand(n, groups, generator=g) * 0.1 + 0.02).bfloat16(),
               "weight_shape": torch.tensor([n, k])}
    if not symmetric:
        zero = torch.randint(-8, 8, (n, groups), generator=g, dtype=torch.int8)
        tensors["weight_zero_point"] = pack_to_int32(zero, 4, packed_dim=0)
    return tensors


def ct_decompress(tensors: Checkpoint, group_size: int | None,
                  scale_dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' own decompression (the oracle), computed in `scale_dtype`."""
    args = QuantizationArgs(num_bits=4, type="int",
                            symmetric="weight_zero_point" not in tensors,
                            strategy="channel" if group_size is None else "group",
                            group_size=group_size)
    state = dict(tensors, weight_scale=tensors["weight_scale"].to(scale_dtype))
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return ct_pack.PackedQuantizationCompressor.decompress(state, scheme)["weight"]


def make_experts(num_experts: int, hidden: int, inter: int, group_size: int | None,
                 symmetric: bool, seed: int = 0
                 ) -> tuple[Int4ExpertWeights, list[tuple[Checkpoint, Checkpoint, Checkpoint]]]:
    """Random experts as per-expert (gate, up, down) checkpoint tensors, and stacked as a
    loader stacks them: w13 = gate rows then up rows (zero-point words concatenated, exact
    since inter % 8 == 0)."""
    g = torch.Generator().manual_seed(seed)
    experts = [(_ct_projection(inter, hidden, group_size, symmetric, g),
                _ct_projection(inter, hidden, group_size, symmetric, g),
                _ct_projection(hidden, inter, group_size, symmetric, g))
               for _ in range(num_experts)]

    def stack(name: str, which: tuple[int, ...]) -> torch.Tensor:
        return torch.stack([torch.cat([e[i][name] for i in which]) for e in experts])

    weights = Int4ExpertWeights(
        stack("weight_packed", (0, 1)), stack("weight_scale", (0, 1)),
        stack("weight_packed", (2,)), stack("weight_scale", (2,)), group_size,
        None if symmetric else stack("weight_zero_point", (0, 1)),
        None if symmetric else stack("weight_zero_point", (2,)))
    return weights, experts


def brute_force(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: list[tuple[Checkpoint, Checkpoint, Checkpoint]],
                group_size: int | None) -> torch.Tensor:
    """Token by token, slot by slot, in float64 over compressed-tensors' float32 weights."""
    dense = [[ct_decompress(t, group_size, torch.float32).double() for t in e] for e in experts]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            gate, up, down = dense[int(topk_ids[t, j])]
            xt = x[t].double()
            out[t] += float(topk_weights[t, j]) * (down @ (F.silu(gate @ xt) * (up @ xt)))
    return out


def routing(num_tokens: int, top_k: int, num_experts: int, seed: int,
            experts: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int64 [M, k], topk_weights float32 [M, k]): k distinct experts per token,
    drawn from `experts` (default: all), weights in [0.1, 2.9) as after rsf scaling."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else range(num_experts))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]]
                       for _ in range(num_tokens)])
    return ids, torch.rand(num_tokens, top_k, generator=g) * 2.8 + 0.1


# ----------------------------------------------------------------------------- alignment


def test_align_matches_vllms_worked_example() -> None:
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    sorted_ids, expert_ids, num_post = moe_align_block_size_ref(ids, 4, 5)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert (sorted_ids[16:] == 12).all()
    assert expert_ids[:4].tolist() == [1, 2, 3, 4] and (expert_ids[4:] == -1).all()
    assert num_post.tolist() == [16]


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m", "pool"), [
    (1, 8, 384, 16, None),   # decode at Kimi's shape: 8 experts, one pair each
    (7, 2, 8, 16, None),
    (33, 3, 5, 16, None),    # several blocks per expert
    (16, 8, 384, 32, None),
    (9, 1, 4, 16, (2,)),     # every token picks expert 2
    (5, 3, 40, 64, (0, 7, 39)),  # most experts receive nothing
    (130, 8, 384, 16, None),  # past ALIGN_MAX_PAIRS: the torch version in both
])
def test_align_invariants(num_tokens: int, top_k: int, num_experts: int, block_m: int,
                          pool: tuple[int, ...] | None) -> None:
    """The torch version's invariants, and the one-program Triton version equal to it."""
    ids, _ = routing(num_tokens, top_k, num_experts, seed=num_tokens, experts=pool)
    ids = ids.to(torch.int32)  # either integer dtype is accepted
    sorted_ids, expert_ids, num_post = moe_align_block_size_ref(ids, block_m, num_experts)
    for got, expected in zip(moe_align_block_size(ids.long(), block_m, num_experts),
                             (sorted_ids, expert_ids, num_post), strict=True):
        assert torch.equal(got, expected)
    num_pairs = num_tokens * top_k
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    assert sorted_ids.numel() == max_padded_pairs(num_pairs, num_experts, block_m)
    assert sorted_ids.numel() == expert_ids.numel() * block_m
    assert int(num_post) == int(padded.sum()) <= sorted_ids.numel()
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (sorted_ids[int(num_post):] == num_pairs).all()
    blocks = sorted_ids.view(-1, block_m)
    used = int(num_post) // block_m
    assert (expert_ids[used:] == -1).all()
    assert expert_ids[:used].tolist() == sorted(expert_ids[:used].tolist())
    for b in range(used):
        rows = blocks[b][blocks[b] < num_pairs].long()
        assert rows.numel() > 0  # no block is all padding
        assert (flat[rows] == expert_ids[b]).all()  # one expert per block
        assert rows.tolist() == sorted(rows.tolist())  # stable: ascending pairs
        if rows.numel() < block_m:  # padding only at the end of an expert's run
            assert (blocks[b][rows.numel():] == num_pairs).all()
    assert {int(e) for e in expert_ids[:used]} == set(flat.tolist())


def test_align_puts_pairs_of_no_held_expert_in_one_run_of_expert_minus_one() -> None:
    """Ids -1 (expert parallelism: the expert is another rank's) sort after the experts' runs
    into blocks of expert -1; the torch and Triton versions agree."""
    ids = torch.tensor([[2, -1, 0], [-1, -1, 2], [0, 2, -1]])
    sorted_ids, expert_ids, num_post = moe_align_block_size_ref(ids, 4, 3)
    # pair p = token * 3 + slot; expert 0: pairs 2, 6; expert 2: 0, 5, 7; id -1: 1, 3, 4, 8
    assert sorted_ids[:12].tolist() == [2, 6, 9, 9, 0, 5, 7, 9, 1, 3, 4, 8]
    assert expert_ids[:3].tolist() == [0, 2, -1] and (expert_ids[3:] == -1).all()
    assert num_post.tolist() == [12]
    for got, expected in zip(moe_align_block_size(ids, 4, 3),
                             (sorted_ids, expert_ids, num_post), strict=True):
        assert torch.equal(got, expected)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-1, 384, (40, 8), generator=g)  # about 1 in 385 dropped
    ids[::3, ::2] = -1
    for got, expected in zip(moe_align_block_size(ids, 16, 384),
                             moe_align_block_size_ref(ids, 16, 384), strict=True):
        assert torch.equal(got, expected)


# ----------------------------------------------------------------------------- reference


SCHEMES = [(32, True), (64, False), (128, True), (None, True), (None, False)]


@pytest.mark.parametrize(("group_size", "symmetric"), SCHEMES)
def test_reference_matches_brute_force(group_size: int | None, symmetric: bool) -> None:
    """Float32 activations: the dequantized weights are exact, so the reference is the
    brute-force loop up to float32 summation."""
    hidden, inter = (128, 128) if group_size == 128 else (64, 64)
    weights, experts = make_experts(6, hidden, inter, group_size, symmetric)
    ids, topk_weights = routing(5, 3, 6, seed=1)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(2))
    got = fused_moe_ref(x, ids, topk_weights, weights)
    expected = brute_force(x, ids, topk_weights, experts, group_size)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5,
                               atol=1e-5 * float(expected.abs().max()))


def test_reference_bf16_weights_equal_compressed_tensors() -> None:
    """In bf16 the reference's dequantized weight is compressed-tensors' decompressed one."""
    weights, experts = make_experts(3, 64, 32, 32, False)
    w13, w2 = weights.dequantized(1, torch.bfloat16)
    gate, up, down = (ct_decompress(t, 32, torch.bfloat16) for t in experts[1])
    assert torch.equal(w13, torch.cat([gate, up])) and torch.equal(w2, down)


def test_stacked_zero_points_are_the_stacked_rows_packed() -> None:
    """Concatenating gate's and up's zero-point words (inter % 8 == 0) is packing the
    stacked rows, the layout the kernel reads."""
    _, experts = make_experts(1, 64, 32, 32, False)
    gate, up, _ = experts[0]
    words = torch.cat([gate["weight_zero_point"], up["weight_zero_point"]])
    zero = torch.cat([unpack_zero_point(gate["weight_zero_point"], 32),
                      unpack_zero_point(up["weight_zero_point"], 32)])
    assert torch.equal(pack_to_int32(zero, 4, packed_dim=0), words)


def test_dispatch_runs_the_reference_on_the_cpu() -> None:
    """experts_forward with INT4 weights equals the dense path over the dequantized weights
    (float32: the same products, summed in float32)."""
    weights, _ = make_experts(5, 64, 32, 32, False)
    ids, topk_weights = routing(6, 2, 5, seed=3)
    x = torch.randn(6, 64)
    dense = [weights.dequantized(e, torch.float32) for e in range(5)]
    expected = experts_forward(x, ids, topk_weights,
                               ExpertWeights(torch.stack([d[0] for d in dense]),
                                             torch.stack([d[1] for d in dense])))
    got = experts_forward(x, ids, topk_weights, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, fused_moe_ref(x, ids, topk_weights, weights))


# ----------------------------------------------------------------------------- kernel


def _assert_kernel_matches(x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor,
                           weights: Int4ExpertWeights | ExpertWeights,
                           config: FusedMoeConfig | None = None) -> None:
    got = fused_moe(x, ids, topk_weights, weights, config)
    ref = fused_moe_ref(x, ids, topk_weights, weights)
    # float32: no rounding to flip, only the summation order inside the products (as the
    # reference against brute force: 1e-5).
    eps = 5e-6 if x.dtype == torch.float32 else torch.finfo(x.dtype).eps
    assert got.dtype == x.dtype and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 * eps,
                               atol=2 * eps * float(ref.float().abs().max()))


ROUTINGS = [  # (num_tokens, top_k, num_experts, experts drawn from)
    (7, 2, 8, None),         # odd token count
    (3, 2, 16, None),        # most experts receive no token
    (5, 1, 6, None),         # top-1
    (2, 8, 12, None),        # top-8
    (9, 1, 6, (3,)),         # every token picks the same expert
    (6, 3, 8, (1, 4, 6)),    # every token picks the same three
    (40, 2, 4, None),        # ~20 rows per expert: two 16-row blocks each
]


@pytest.mark.parametrize(("dtype", "num_tokens", "top_k", "num_experts", "pool"), [
    *[(torch.bfloat16, *r) for r in ROUTINGS],
    *[(torch.float16, *r) for r in ROUTINGS[::3]],
])
def test_kernel_matches_reference_on_routings(dtype: torch.dtype, num_tokens: int, top_k: int,
                                              num_experts: int,
                                              pool: tuple[int, ...] | None) -> None:
    weights, _ = make_experts(num_experts, 64, 32, 32, True, seed=num_tokens)
    ids, topk_weights = routing(num_tokens, top_k, num_experts, seed=top_k, experts=pool)
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    _assert_kernel_matches(x, ids, topk_weights, weights)


@pytest.mark.parametrize(("group_size", "symmetric"), [(32, False), (64, True), (64, False),
                                                       (128, True), (128, False), (None, True),
                                                       (None, False)])
def test_kernel_matches_reference_on_schemes(group_size: int | None, symmetric: bool) -> None:
    hidden, inter = {128: (128, 128), 64: (64, 64)}.get(group_size or 0, (64, 32))
    weights, _ = make_experts(6, hidden, inter, group_size, symmetric, seed=5)
    ids, topk_weights = routing(5, 3, 6, seed=6)
    x = torch.randn(5, hidden).bfloat16()
    _assert_kernel_matches(x, ids, topk_weights, weights)


@pytest.mark.parametrize("config", [
    FusedMoeConfig(block_m=32, block_n=16, block_k=16, block_n_down=32, block_k_down=32,
                   group_m=8),  # K tiles narrower than the group, grouped block order
    FusedMoeConfig(block_m=16, block_n=32, block_k=64, block_n_down=16, block_k_down=32),
])
def test_kernel_matches_reference_on_configs(config: FusedMoeConfig) -> None:
    """Zero points read per K row (64-wide K tiles over groups of 32) or per tile."""
    weights, _ = make_experts(4, 64, 32, 32, False, seed=7)
    ids, topk_weights = routing(11, 2, 4, seed=8)
    x = torch.randn(11, 64).bfloat16()
    _assert_kernel_matches(x, ids, topk_weights, weights, config)


def dense_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                  seed: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights((torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
                          ).to(dtype),
                         (torch.randn(num_experts, hidden, inter, generator=g) * 0.2).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "pool"), ROUTINGS[:4])
def test_kernel_over_dense_experts_matches_reference(dtype: torch.dtype, num_tokens: int,
                                                     top_k: int, num_experts: int,
                                                     pool: tuple[int, ...] | None) -> None:
    """Dense experts (a bf16 DeepSeek checkpoint's) through the same kernel: the tiles are the
    weights themselves."""
    weights = dense_experts(num_experts, 64, 32, dtype, seed=num_tokens)
    ids, topk_weights = routing(num_tokens, top_k, num_experts, seed=top_k, experts=pool)
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    _assert_kernel_matches(x, ids, topk_weights, weights)


def test_dense_reference_is_the_dense_cpu_path_in_float32() -> None:
    """fused_moe_ref over dense experts is workers/models/moe.py's CPU path (float32: the
    extra rounding of the weighted rows is exact there; the sums run in another order)."""
    weights = dense_experts(6, 64, 32, torch.float32, seed=3)
    ids, topk_weights = routing(7, 2, 6, seed=5)
    ids[1, 0] = ids[4, 1] = -1
    x = torch.randn(7, 64)
    torch.testing.assert_close(fused_moe_ref(x, ids, topk_weights, weights),
                               experts_forward(x, ids, topk_weights, weights),
                               rtol=1e-6, atol=1e-6)


def test_float32_kernel_is_exact_arithmetic() -> None:
    """float32 activations: IEEE products (not TF32) and float32 accumulation, so the kernel
    equals the reference up to float32 summation order (1e-5), far below TF32's 1e-3."""
    weights, experts = make_experts(6, 64, 64, 32, False, seed=13)
    ids, topk_weights = routing(5, 3, 6, seed=14)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(15))
    got = fused_moe(x, ids, topk_weights, weights)
    assert got.dtype == torch.float32
    expected = brute_force(x, ids, topk_weights, experts, 32)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5,
                               atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("dense", [False, True], ids=["int4", "dense"])
def test_slots_of_no_held_expert_add_nothing(dense: bool) -> None:
    """topk_ids -1 (expert parallelism's map applied): those slots contribute zero, in the
    kernel, the reference and the brute-force sum over the remaining slots."""
    int4, experts = make_experts(6, 64, 32, 32, True, seed=16)
    weights = dense_experts(6, 64, 32, torch.bfloat16, seed=16) if dense else int4
    ids, topk_weights = routing(9, 3, 6, seed=17)
    held = ids.clone()
    held[::2, 1] = -1
    held[3] = -1  # a token with no held expert: zeros
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(18)).bfloat16()
    _assert_kernel_matches(x, held, topk_weights, weights)
    got = fused_moe(x, held, topk_weights, weights)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    if not dense:  # the held slots alone, by the float64 loop
        kept = torch.where(held >= 0, topk_weights, 0.0)
        expected = brute_force(x.float(), ids, kept, experts, 32)
        torch.testing.assert_close(got.double(), expected, rtol=2**-6,
                                   atol=2**-6 * float(expected.abs().max()))


def test_kernel_operand_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Strided activations, int32 ids, bf16 router weights, and chunks of tokens."""
    weights, _ = make_experts(5, 64, 32, 32, True, seed=9)
    ids, topk_weights = routing(9, 2, 5, seed=10)
    x = torch.randn(9, 128).bfloat16()[:, ::2]
    assert not x.is_contiguous()
    monkeypatch.setattr(moe_w4a16, "CHUNK_TOKENS", 4)  # chunks of 4, 4 and 1 tokens
    _assert_kernel_matches(x, ids.to(torch.int32), topk_weights.bfloat16(), weights)


def n_major(weights: Int4ExpertWeights) -> Int4ExpertWeights:
    """The same experts with every tensor stored output-contiguous within an expert
    (strides (N * X, 1, N)), the layout that coalesces the weight reads."""
    def t(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    w13_zero, w2_zero = weights.w13_zero_point, weights.w2_zero_point
    return Int4ExpertWeights(t(weights.w13_packed), t(weights.w13_scale), t(weights.w2_packed),
                             t(weights.w2_scale), weights.group_size,
                             None if w13_zero is None else t(w13_zero),
                             None if w2_zero is None else t(w2_zero))


def test_kernel_reads_output_major_weights() -> None:
    weights, _ = make_experts(5, 64, 32, 32, False, seed=11)
    strided = n_major(weights)
    assert strided.w13_packed.stride()[1] == 1 and torch.equal(strided.w2_scale,
                                                               weights.w2_scale)
    ids, topk_weights = routing(6, 2, 5, seed=12)
    x = torch.randn(6, 64).bfloat16()
    _assert_kernel_matches(x, ids, topk_weights, weights)  # also the reference of `strided`
    assert torch.equal(fused_moe(x, ids, topk_weights, strided),
                       fused_moe(x, ids, topk_weights, weights))


def test_no_tokens() -> None:
    weights, _ = make_experts(2, 64, 32, 32, True)
    args = (torch.empty(0, 64).bfloat16(), torch.empty(0, 2, dtype=torch.int64),
            torch.empty(0, 2), weights)
    assert fused_moe(*args).shape == fused_moe_ref(*args).shape == (0, 64)


def test_config_choice() -> None:
    decode = choose_moe_config(8, 384, 2048, 7168)
    assert (decode.block_m, decode.block_n, decode.block_k, decode.group_m) == (16, 64, 64, 1)
    assert choose_moe_config(64 * 8, 384, 2048, 7168).block_m == 16
    prefill = choose_moe_config(8192 * 8, 384, 2048, 7168)
    assert (prefill.block_m, prefill.group_m) == (64, 8)
    assert choose_moe_config(8, 8, 32, 64).block_n == 32  # small layers: narrower tiles


# ----------------------------------------------------------------------------- errors


def _operands() -> dict[str, object]:
    ids, topk_weights = routing(2, 2, 3, seed=0)
    return {"x": torch.randn(2, 64).bfloat16(), "topk_ids": ids, "topk_weights": topk_weights,
            "weights": make_experts(3, 64, 32, 32, False)[0]}


@pytest.mark.parametrize(("change", "message"), [
    ({"x": torch.randn(2, 64, dtype=torch.float64)}, "float16/bfloat16/float32"),
    ({"weights": ExpertWeights(torch.zeros(3, 64, 64), torch.zeros(3, 64, 32))},
     "dense experts must be in x's dtype"),
    ({"x": torch.randn(2, 96).bfloat16()}, "hidden size 96"),
    ({"topk_ids": torch.zeros(3, 2, dtype=torch.int64)}, "topk_ids must be"),
    ({"topk_ids": torch.zeros(2, 2)}, "topk_ids must be"),
    ({"topk_weights": torch.ones(2, 3)}, "topk_weights must be"),
    ({"topk_weights": torch.ones(2, 2, dtype=torch.int32)}, "topk_weights must be"),
    ({"config": FusedMoeConfig(block_m=8)}, "block_m must be a power of two"),
    ({"config": FusedMoeConfig(block_m=16, block_k_down=48)}, "block_k_down must be"),
])
def test_launcher_errors(change: dict[str, object], message: str) -> None:
    args = _operands()  # valid as they are: test_kernel_matches_reference_on_* run them
    args.update(change)
    with pytest.raises(ValueError, match=message):
        fused_moe(**args)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("w13_packed", torch.zeros(3, 63, 8, dtype=torch.int32), "disagree"),
    ("w2_packed", torch.zeros(2, 64, 4, dtype=torch.int32), "disagree"),
    ("w2_packed", torch.zeros(64, 4, dtype=torch.int32), "3-D"),
    ("w13_packed", torch.zeros(3, 64, 8, dtype=torch.int64), "w13_packed must be int32"),
    ("w13_scale", torch.ones(3, 64, 3).bfloat16(), r"w13_scale must be .*\[3, 64, 2\]"),
    ("w2_scale", torch.ones(3, 64, 1, dtype=torch.int32), "w2_scale must be"),
    ("w13_zero_point", torch.zeros(3, 16, 2, dtype=torch.int32), "w13_zero_point must be"),
    ("w2_zero_point", torch.zeros(3, 8, 2, dtype=torch.int32), r"w2_zero_point .*\[3, 8, 1\]"),
    ("group_size", 48, "group_size must be one of"),
    ("group_size", None, "w13_scale must be"),  # channel-wise wants [E, 2I, 1]
])
def test_weight_layout_errors(field: str, value: object, message: str) -> None:
    weights = make_experts(3, 64, 32, 32, False)[0]
    fields = {f: getattr(weights, f) for f in Int4ExpertWeights.__dataclass_fields__}
    fields[field] = value
    with pytest.raises(ValueError, match=message):
        Int4ExpertWeights(**fields)


# ----------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="TRITON_INTERPRET=1: set TRITON_INTERPRET=0 to compile for the GPU")
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize(("group_size", "symmetric"), [(32, True), (128, False), (None, True)])
def test_kernel_matches_reference_on_gpu(num_tokens: int, group_size: int | None,
                                         symmetric: bool) -> None:
    """Kimi-K2's expert widths (hidden 7168, intermediate 2048, top 8) over 16 experts, so
    that experts receive up to ~150 rows: the configurations decode and prefill choose."""
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    groups = {h_or_i: 1 if group_size is None else h_or_i // group_size for h_or_i in (7168, 2048)}

    def words(*shape: int) -> torch.Tensor:  # every nibble uniform in [0, 16)
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device="cuda",
                             generator=g)

    def scales(n: int, k: int) -> torch.Tensor:
        return (torch.rand(16, n, groups[k], device="cuda", generator=g) * 0.002
                + 0.001).bfloat16()

    weights = Int4ExpertWeights(
        words(16, 4096, 896), scales(4096, 7168), words(16, 7168, 256), scales(7168, 2048),
        group_size, None if symmetric else words(16, 512, groups[7168]),
        None if symmetric else words(16, 896, groups[2048]))
    ids, topk_weights = routing(num_tokens, 8, 16, seed=num_tokens)
    x = torch.randn(num_tokens, 7168).bfloat16().cuda()
    _assert_kernel_matches(x, ids.cuda(), topk_weights.cuda(), weights)


# ----------------------------------------------------------------------------- benchmark


def test_benchmark_entry_runs_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """tools/bench_kernels.py's MoE entry at small shapes on the CPU with stand-in timers:
    its operands, its correctness gate, its baseline and its byte counts run."""
    from tools import bench_kernels
    for name, value in (("DEVICE", "cpu"), ("MOE_HIDDEN", 64), ("MOE_INTER", 32),
                        ("MOE_EXPERTS", 6), ("MOE_TOP_K", 2)):
        monkeypatch.setattr(bench_kernels, name, value)
    monkeypatch.setattr(bench_kernels, "bench_ms", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(bench_kernels, "_graph_ms", lambda fn: (fn(), (None, "no CUDA"))[1])
    int4, dense = bench_kernels.moe_weights()
    row = bench_kernels.bench_moe(3, int4, bench_kernels.n_major_experts(int4), dense)
    assert (row["m"], row["moe_us"], row["moe_nmajor_us"], row["moe_graph_us"]) == (
        3, 1000.0, 1000.0, None)
    assert 2 <= row["experts_touched"] <= 6
    assert 0 < row["moe_floor_us"] < row["bf16_floor_us"]
