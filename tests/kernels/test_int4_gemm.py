"""The Triton INT4 GEMM against its pure-torch reference, under TRITON_INTERPRET=1 on the CPU.

Tolerance: the kernel and `int4_gemm_ref` dequantize to the same activation-dtype weights and
multiply the same values in float32; only the summation order differs (split-K partials, tile
order), an fp32 error of about K * 2**-24 * sum|x*w| (the `atol` term below), which can flip the
final rounding to the output dtype by one unit in the last place (`rtol` = eps of the dtype).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from specd.kernels.int4_gemm import (
    GemmConfig,
    choose_config,
    int4_gemm,
    int4_gemm_ref,
)
from specd.kernels.int4_layout import (
    column_major,
    dequantize_int4,
    unpack_int4,
    unpack_zero_point,
)
from specd.workers.models.quantization import pack_int4

ct_pack = pytest.importorskip("compressed_tensors.compressors.pack_quantized.base")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402


def _random_int4(n: int, k: int, group_size: int, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [n, k], weight_packed int32 [n, k/8], weight_scale bf16 [n, k/group])."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // group_size, generator=g) * 0.05 + 0.005).to(torch.bfloat16)
    return q, pack_int4(q), scale


def _assert_matches_ref(y: torch.Tensor, x: torch.Tensor, packed: torch.Tensor,
                        scale: torch.Tensor, group_size: int) -> None:
    ref = int4_gemm_ref(x, packed, scale, group_size)
    w = dequantize_int4(packed, scale, group_size, x.shape[1], x.dtype).float()
    magnitude = x.float().abs() @ w.abs().t()  # [M, N] sum |x * w|
    atol = float(magnitude.max()) * x.shape[1] * 2**-24 + 1e-6
    torch.testing.assert_close(y.float(), ref.float(), rtol=torch.finfo(x.dtype).eps, atol=atol)
    assert y.dtype == x.dtype and y.shape == ref.shape


@pytest.mark.parametrize(("m", "n", "k", "group_size"), [
    (1, 50, 96, 32),     # GEMV, split-K over 3 K blocks
    (1, 129, 128, 128),  # GEMV, N just past one tile
    (3, 37, 128, 64),    # split-K with tl.dot, M padded to 16
    (17, 45, 256, 128),  # split-K, M padded to 32
    (64, 24, 64, 32),    # largest split-K M
    (70, 33, 96, 32),    # tiled path
    (130, 20, 128, 64),  # tiled path, 128-row tiles, partial last tile
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_reference_on_odd_shapes(m: int, n: int, k: int, group_size: int,
                                         dtype: torch.dtype) -> None:
    _, packed, scale = _random_int4(n, k, group_size, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    _assert_matches_ref(int4_gemm(x, packed, scale, group_size), x, packed, scale, group_size)


def test_non_contiguous_operands() -> None:
    """Strided and transposed activations; column slices of the packed weight and scale."""
    _, packed_big, scale_big = _random_int4(41, 192, 32, seed=7)
    packed, scale = packed_big[:, 4:16], scale_big[:, 1:4]  # K columns 32..128 of the weight
    k = 96
    every_other = torch.randn(5, 2 * k).to(torch.bfloat16)[:, ::2]  # stride (2k, 2)
    transposed = torch.randn(k, 67).to(torch.bfloat16).t()  # [67, k], stride (1, 67)
    for x in (every_other[:1], every_other, transposed):
        assert not x.is_contiguous() and not packed.is_contiguous()
        _assert_matches_ref(int4_gemm(x, packed, scale, 32), x, packed, scale, 32)


@pytest.mark.parametrize("m", [1, 4, 70])
def test_column_major_weights_as_int4linear_stores_them(m: int) -> None:
    _, packed, scale = _random_int4(45, 128, 64, seed=m)
    packed_cm, scale_cm = column_major(packed), column_major(scale)
    assert packed_cm.stride() == (1, 45) and torch.equal(packed_cm, packed)
    x = torch.randn(m, 128).to(torch.bfloat16)
    y = int4_gemm(x, packed_cm, scale_cm, 64)
    _assert_matches_ref(y, x, packed, scale, 64)
    assert torch.equal(y, int4_gemm(x, packed, scale, 64))  # layout never changes the sums


@pytest.mark.parametrize(("m", "block_k", "split_k"), [
    (6, 32, 1), (6, 32, 2),
    (6, 32, 3),   # 3 splits over 4 K blocks: one split is empty
    (6, 64, 2),   # a K block spans two groups of 32: per-row scales
    (1, 128, 1),  # GEMV with a 128-wide K block over K = 96... masked past K
    (1, 64, 3),
    (70, 128, 1),  # tiled, K block wider than K
])
def test_explicit_configs_agree(m: int, block_k: int, split_k: int) -> None:
    k = 96 if block_k == 128 else 128
    _, packed, scale = _random_int4(19, k, 32, seed=3)
    x = torch.randn(m, k).to(torch.bfloat16)
    kind = "tiled" if m > 64 else "splitk"
    block_m = 1 if m == 1 else (64 if m > 64 else 16)
    cfg = GemmConfig(kind, block_m=block_m, block_n=16, block_k=block_k, split_k=split_k)
    _assert_matches_ref(int4_gemm(x, packed, scale, 32, config=cfg), x, packed, scale, 32)


def test_reference_is_dense_product_of_unpacked_weight() -> None:
    """The reference itself: x @ (q * scale).T with q read nibble by nibble from the words."""
    q, packed, scale = _random_int4(5, 64, 32, seed=11)
    words = packed.tolist()
    for n in range(5):
        for k in range(64):
            nibble = (words[n][k // 8] >> (4 * (k % 8))) & 0xF
            assert nibble - 8 == q[n, k]
    assert torch.equal(unpack_int4(packed, 64), q)
    x = torch.randn(3, 64, dtype=torch.float32)
    w = q.float() * scale.float().repeat_interleave(32, dim=1)
    torch.testing.assert_close(int4_gemm_ref(x, packed, scale, 32), x @ w.t())


def test_config_choice_by_m_and_shape() -> None:
    gemv = choose_config(1, 4096, 4096, 32, 132)
    assert (gemv.block_m, gemv.block_n, gemv.split_k) == (1, 16, 1)  # 256 tiles, no SM idle
    wide = choose_config(1, 14336, 4096, 32, 132)
    assert (wide.block_n, wide.split_k) == (32, 1)  # 448 tiles
    assert choose_config(1, 65536, 4096, 32, 132).block_n == 128
    assert choose_config(1, 2048, 7168, 32, 132).split_k == 2  # 128 tiles < 132 SMs
    assert choose_config(16, 4096, 4096, 128, 132).kind == "splitk"
    assert choose_config(64, 14336, 4096, 32, 132).kind == "splitk"
    assert choose_config(65, 4096, 4096, 32, 132).kind == "tiled"


@pytest.mark.parametrize(("change", "message"), [
    ({"group_size": 48}, "group_size must be one of"),
    ({"x": torch.randn(2, 96, dtype=torch.float64)}, "float16/bfloat16/float32"),
    ({"x": torch.randn(2, 80).bfloat16()}, "does not divide"),
    ({"config": GemmConfig("splitk", 16, 16, 24)}, "block_k must be a power of two"),
    ({"weight_packed": torch.zeros(7, 12, dtype=torch.int64)}, "weight_packed must be int32"),
    ({"weight_packed": torch.zeros(7, 11, dtype=torch.int32)}, "weight_packed must be int32"),
    ({"weight_scale": torch.ones(7, 2).bfloat16()}, "weight_scale must be"),
    ({"weight_scale": torch.ones(7, 3, dtype=torch.int32)}, "weight_scale must be"),
])
def test_bad_operands_raise_naming_the_tensor(change: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"x": torch.randn(2, 96).bfloat16(),
                               "weight_packed": torch.zeros(7, 12, dtype=torch.int32),
                               "weight_scale": torch.ones(7, 3).bfloat16(), "group_size": 32}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        int4_gemm(**args)


# ----------------------------------------------------------------------------- zero points and
# channel-wise scales, against compressed-tensors' own packing and decompression


def _ct_int4(n: int, k: int, group_size: int | None, symmetric: bool, seed: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weight_packed, weight_scale bf16, weight_zero_point or None) as compressed-tensors
    packs them: random q and z in [-8, 7], scales per group (group_size None: per row)."""
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group_size is None else k // group_size
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, groups, generator=g) * 0.05 + 0.005).to(torch.bfloat16)
    zero = torch.randint(-8, 8, (n, groups), generator=g, dtype=torch.int8)
    return (pack_to_int32(q, 4), scale,
            None if symmetric else pack_to_int32(zero, 4, packed_dim=0))


def ct_dequantize(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                  group_size: int | None, k: int) -> torch.Tensor:
    """compressed-tensors' decompression of one pack-quantized weight (the oracle)."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=zero_point is None,
                            strategy="channel" if group_size is None else "group",
                            group_size=group_size)
    state = {"weight_packed": packed, "weight_scale": scale,
             "weight_shape": torch.tensor([packed.shape[0], k])}
    if zero_point is not None:
        state["weight_zero_point"] = zero_point
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return ct_pack.PackedQuantizationCompressor.decompress(state, scheme)["weight"]


@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantize_matches_compressed_tensors(group_size: int | None, symmetric: bool) -> None:
    """13 rows: the zero points' last packed word is partly padding."""
    packed, scale, zero = _ct_int4(13, 256, group_size, symmetric, seed=5)
    oracle = ct_dequantize(packed, scale, zero, group_size, 256)
    assert torch.equal(dequantize_int4(packed, scale, group_size, 256, weight_zero_point=zero),
                       oracle)
    # float32 scales: compressed-tensors computes in the scale's dtype, exact in float32
    assert torch.equal(dequantize_int4(packed, scale.float(), group_size, 256, torch.float32,
                                       zero),
                       ct_dequantize(packed, scale.float(), zero, group_size, 256))
    if zero is not None:
        assert unpack_zero_point(zero, 13).shape == scale.shape


_ASYMMETRIC_AND_CHANNEL = [(32, False), (128, False), (None, True), (None, False)]


@pytest.mark.parametrize(("m", "n", "k", "group_size", "symmetric"), [
    *[(m, n, 128, *scheme) for m, n in ((1, 37), (5, 37), (70, 21))
      for scheme in _ASYMMETRIC_AND_CHANNEL],
    # K = 96, not a multiple of the 64-wide K block: one channel-wise group over K allows it
    *[(m, 19, 96, None, symmetric) for m in (1, 6) for symmetric in (True, False)],
    (6, 19, 96, 32, False),
])
def test_zero_points_and_channel_scales(m: int, n: int, k: int, group_size: int | None,
                                        symmetric: bool) -> None:
    """GEMV (M = 1), split-K with tl.dot and tiled (M = 70) paths, against the reference,
    and the reference against compressed-tensors' decompressed weight."""
    packed, scale, zero = _ct_int4(n, k, group_size, symmetric, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    y = int4_gemm(x, packed, scale, group_size, weight_zero_point=zero)
    ref = int4_gemm_ref(x, packed, scale, group_size, zero)
    dense = ct_dequantize(packed, scale, zero, group_size, k).float()
    torch.testing.assert_close(ref.float(), (x.float() @ dense.t()).to(x.dtype).float(),
                               rtol=2**-8, atol=1e-5)
    w = dequantize_int4(packed, scale, group_size, k, x.dtype, zero).float()
    atol = float((x.float().abs() @ w.abs().t()).max()) * k * 2**-24 + 1e-6
    torch.testing.assert_close(y.float(), ref.float(), rtol=torch.finfo(x.dtype).eps, atol=atol)


@pytest.mark.parametrize(("block_k", "split_k"), [(64, 1), (128, 2)])
def test_zero_points_read_per_k_row(block_k: int, split_k: int) -> None:
    """K blocks wider than the group of 32: each K row reads its group's zero point."""
    packed, scale, zero = _ct_int4(21, 256, 32, False, seed=9)
    x = torch.randn(6, 256).to(torch.float16)
    cfg = GemmConfig("splitk", 16, 16, block_k, split_k=split_k)
    y = int4_gemm(x, packed, scale, 32, config=cfg, weight_zero_point=zero)
    _assert_close_to(y, int4_gemm_ref(x, packed, scale, 32, zero), x, k=256)


def _assert_close_to(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, k: int) -> None:
    atol = float(ref.float().abs().max()) * k * 2**-22 + 1e-6
    torch.testing.assert_close(y.float(), ref.float(), rtol=torch.finfo(x.dtype).eps, atol=atol)


@pytest.mark.parametrize(("change", "message"), [
    ({"weight_zero_point": torch.zeros(3, 3, dtype=torch.int32)}, "weight_zero_point must be"),
    ({"weight_zero_point": torch.zeros(1, 2, dtype=torch.int32)}, "weight_zero_point must be"),
    ({"weight_zero_point": torch.zeros(1, 3, dtype=torch.int8)}, "weight_zero_point must be"),
    ({"group_size": None}, "weight_scale must be"),  # channel-wise wants [N, 1]
    ({"group_size": None, "weight_scale": torch.ones(7, 1).bfloat16(),
      "weight_zero_point": torch.zeros(1, 3, dtype=torch.int32)}, "weight_zero_point must be"),
])
def test_bad_zero_points_and_channel_scales_raise(change: dict[str, object],
                                                  message: str) -> None:
    args: dict[str, object] = {"x": torch.randn(2, 96).bfloat16(),
                               "weight_packed": torch.zeros(7, 12, dtype=torch.int32),
                               "weight_scale": torch.ones(7, 3).bfloat16(), "group_size": 32,
                               "weight_zero_point": torch.zeros(1, 3, dtype=torch.int32)}
    int4_gemm(**args)  # the unchanged operands are valid: N = 7 packs into one zero-point row
    args.update(change)
    with pytest.raises(ValueError, match=message):
        int4_gemm(**args)


# ----------------------------------------------------------------------------- GEMV loads


def _loaded_addresses(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every element address the interpreted kernels load from (masked-off lanes left out)."""
    from triton.runtime.interpreter import InterpreterBuilder

    loaded: list[Any] = []
    real = InterpreterBuilder.create_masked_load

    def record(self: Any, ptrs: Any, mask: Any, *args: Any) -> Any:
        loaded.append(ptrs.data[mask.data].copy())
        return real(self, ptrs, mask, *args)

    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", record)
    return loaded


def _load_counts(loaded: list[Any], t: torch.Tensor) -> Counter[int]:
    """How often each element of `t` was loaded, by element address."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    counts: Counter[int] = Counter()
    for chunk in loaded:
        counts.update(int(a) for a in chunk if lo <= a < hi)
    return counts


@pytest.mark.parametrize(("k", "group_size", "block_k", "split_k"), [
    (256, 32, 128, 1),    # a tile of 4 whole groups
    (256, 128, 64, 2),    # 2 tiles per group, over 2 splits
    (192, 64, 128, 1),    # the last tile half past K
])
def test_the_gemv_loads_each_word_and_each_scale_once_per_tile(
        k: int, group_size: int, block_k: int, split_k: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each packed word is read once (not once per nibble) and each scale once per tile that
    covers its group (not once per K row), as Int4Linear stores them (N-contiguous)."""
    _, packed_k, scale_k = _random_int4(40, k, group_size, seed=k)
    packed, scale = column_major(packed_k), column_major(scale_k)
    x = torch.randn(1, k).bfloat16()
    cfg = GemmConfig("splitk", 1, 16, block_k, split_k=split_k)
    loaded = _loaded_addresses(monkeypatch)
    y = int4_gemm(x, packed, scale, group_size, config=cfg)
    _assert_matches_ref(y, x, packed_k, scale_k, group_size)
    words = _load_counts(loaded, packed)
    assert len(words) == packed.numel() and set(words.values()) == {1}
    scales = _load_counts(loaded, scale)
    assert len(scales) == scale.numel()
    assert set(scales.values()) == {max(1, group_size // block_k)}
