"""Kernel benchmark (CUDA only): the INT4 GEMM against bf16 matmul, tree attention against SDPA.

    python -m tools.bench_kernels --out bench_out/bench_kernels.json [--quick]

INT4 W4A16 GEMM (group 32) on Llama-3-8B projection shapes and Kimi-K2 expert shapes, given as
in x out (K x N), at M = 1..128 rows, against `torch.matmul` on the same bf16 weight: time,
speedup, and achieved bandwidth (weights + scales + activations + output bytes over time)
against the H200's 4.8 TB/s. Targets: >= 3.0x and >= 80% of peak at M <= 16, faster
than bf16 at M = 64.

Tree attention (Llama-3-8B heads: 32 query, 8 KV, head_dim 128; batch 4; block size 16) for
T = 1, 4, 8, 16, 64 draft tokens over prefixes of 512 to 32k, against
`scaled_dot_product_attention` with a dense boolean mask over K/V already gathered contiguous
(the gather is not timed, which favours SDPA). Target: faster than SDPA at every size.

MLA attention (Kimi-K2: 576-wide latent rows, kv_lora_rank 512 + rope 64, one KV head; 64
heads as on one GPU and 8 as per GPU under TP8; batch 4; block size 16) for T = 1 (plain
decode) and 4, 16, 64 (binary draft trees) over contexts of 1k to 32k, against SDPA over the
latents already gathered contiguous ([q_latent | q_pe] against the 576-wide rows, V their first
512 values): time, achieved bandwidth (latent bytes over time) and TFLOP/s. No target is set
yet; the GPU figures are owed. `--mla-only` runs this part alone.

Against the limit: the run first measures the device's copy bandwidth (a Triton
copy kernel and torch's `copy_` over 1 GiB, read + written bytes over time; the larger is the
ceiling), and every row also reports its achieved bandwidth as a share of that measured
ceiling (`*_bw_share`) beside the share of the nominal 4.8 TB/s (`*_bw_frac`). The GEMM runs
at group sizes 32 and 128 (`--group-sizes`), on Llama-3.1-8B's fused qkv and gate_up too.
`host` times a batch-1 plain decode step of the engine (fixture model, overlap off, CUDA
graphs off and on; tools/bench_overlap.py's measurement) and reports the share of the step
the host is busy. `--parts` picks and orders the parts (default: bandwidth, gemm, tree, mla,
host); the JSON is rewritten after each.

Fused INT4 MoE (`moe` part, last by default): kernels/moe_w4a16.py's
`fused_moe` at Kimi-K2 shapes (hidden 7168, expert intermediate 2048, 384 experts, top 8,
group 32, uniform random routing) for 1 to 64 tokens: the whole call (torch alignment, two
launches, moe_sum) eagerly and replayed as a CUDA graph, eagerly with every weight tensor
stored output-contiguous within its expert (`moe_nmajor_us`: the layout a loader may choose for
coalesced reads; the checkpoint's is K-contiguous), the alignment alone (the one-program
Triton version the call uses, and the torch version, `align_torch_us`), and the bf16
baseline, workers/models/moe.py's `experts_forward` on bf16 weights of the same shapes (one matmul
pair per touched expert). Bytes are those of the experts the batch touches (INT4 weights and
scales, activations and the two intermediate buffers); `moe_floor_us` is those bytes at the
measured copy bandwidth (nominal when unmeasured) and `bf16_floor_us` the bf16 weights' bytes
likewise, the best a bf16 kernel could do. No target is set yet; the GPU figures are owed.

Every configuration is first checked against its pure-torch reference, so a wrong kernel is
never timed. Timing: `triton.testing.do_bench` (median, L2 flushed between runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e, nominal
GEMM_SHAPES = {  # name: (K = in_features, N = out_features)
    "llama3-8b qkv/o 4096x4096": (4096, 4096),
    "llama3-8b gate/up 4096x14336": (4096, 14336),
    "llama3-8b down 14336x4096": (14336, 4096),
    "kimi-k2 expert gate/up 7168x2048": (7168, 2048),
    "kimi-k2 expert down 2048x7168": (2048, 7168),
    # Llama-3.1-8B's layers as specd runs them, q/k/v and gate/up fused
    "llama3.1-8b qkv fused 4096x6144": (4096, 6144),
    "llama3.1-8b gate_up fused 4096x28672": (4096, 28672),
}
# The shape sets of `--gemm-shapes`: every shape above, or Llama-3.1-8B's four linears as
# specd runs them (q/k/v and gate/up fused).
GEMM_SHAPE_SETS = {"all": tuple(GEMM_SHAPES),
                   "llama3.1-8b": ("llama3.1-8b qkv fused 4096x6144", "llama3-8b qkv/o 4096x4096",
                                   "llama3.1-8b gate_up fused 4096x28672",
                                   "llama3-8b down 14336x4096")}
GEMM_LAYOUTS = ("column_major", "checkpoint")
GEMM_GROUP_SIZES = (32, 128)
COPY_BYTES = 1 << 30  # per buffer: well past the 60 MB L2
# The device's measured copy bandwidth (bytes read + written per second), set by
# measure_bandwidth(); None until then (the *_bw_share fields are then left out).
MEASURED_BYTES_PER_S: float | None = None
PARTS = ("bandwidth", "gemm", "tree", "mla", "host", "moe")
GEMM_M = (1, 2, 4, 8, 16, 32, 64, 128)
TREE_T = (1, 4, 8, 16, 64)
TREE_PREFIX = (512, 2048, 8192, 32768)
GROUP_SIZE = 32
DEVICE = "cuda"  # a module constant so that a CPU smoke run can swap it
MLA_HEADS = (64, 8)  # Kimi-K2 on one GPU, and per GPU under TP8
MLA_T = (1, 4, 16, 64)
MLA_CONTEXT = (1024, 8192, 32768)
MLA_RANK, MLA_ROPE = 512, 64  # kv_lora_rank, qk_rope_head_dim
MLA_SCALE = 0.13086  # Kimi-K2: 192^-0.5 * YaRN mscale(32)^2
MOE_HIDDEN, MOE_INTER, MOE_EXPERTS, MOE_TOP_K = 7168, 2048, 384, 8  # Kimi-K2, one GPU
MOE_M = (1, 2, 4, 8, 16, 32, 64)
MOE_RSF = 2.827  # routed_scaling_factor, folded into the router weights as route() does


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n]: the streaming copy the bandwidth ceiling is measured with."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


COPY_BLOCK = 8192  # elements per program (32 KiB of int32)


def triton_copy(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy contiguous src into dst with `_copy_kernel`."""
    n = src.numel()
    _copy_kernel[(triton.cdiv(n, COPY_BLOCK),)](src, dst, n, BLOCK=COPY_BLOCK, num_warps=8)
    return dst


def bench_ms(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def measure_bandwidth(nbytes: int = COPY_BYTES) -> dict[str, float]:
    """Copy bandwidth of the device: `_copy_kernel` and torch's copy_ over `nbytes`-byte
    buffers, 2 * nbytes (read + written) over the median time; sets MEASURED_BYTES_PER_S to
    the larger."""
    global MEASURED_BYTES_PER_S
    src = torch.ones(nbytes // 4, dtype=torch.int32, device=DEVICE)
    dst = torch.empty_like(src)
    triton_copy(src, dst)
    if not torch.equal(src, dst):
        raise AssertionError("copy kernel: destination differs from source")
    t_triton = bench_ms(lambda: triton_copy(src, dst))
    t_torch = bench_ms(lambda: dst.copy_(src))
    triton_bps, torch_bps = 2 * nbytes / (t_triton * 1e-3), 2 * nbytes / (t_torch * 1e-3)
    MEASURED_BYTES_PER_S = max(triton_bps, torch_bps)
    return {"bytes": nbytes, "triton_copy_bytes_per_s": triton_bps,
            "torch_copy_bytes_per_s": torch_bps, "measured_bytes_per_s": MEASURED_BYTES_PER_S,
            "share_of_nominal": MEASURED_BYTES_PER_S / PEAK_BYTES_PER_S}


def _bw_share(nbytes: float, ms: float) -> float | None:
    """Achieved bytes per second as a share of the measured copy bandwidth (None unmeasured)."""
    if MEASURED_BYTES_PER_S is None:
        return None
    return nbytes / (ms * 1e-3) / MEASURED_BYTES_PER_S


def _gemm_operands(k: int, n: int, m: int,
                   group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """(x [m, k], bf16 weight [n, k], packed and scale as the checkpoint stores them)."""
    from specd.workers.models.quantization import quantize_rtn

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    weight = torch.randn(n, k, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02
    packed, scale = quantize_rtn(weight, group_size)
    x = torch.randn(m, k, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    return x, weight, packed, scale


def bench_gemm(k: int, n: int, m: int, group_size: int = GROUP_SIZE,
               layouts: tuple[str, ...] = GEMM_LAYOUTS) -> dict[str, float | str | None]:
    """int4_us: N-contiguous weights as Int4Linear stores them; int4_kmajor_us: the
    checkpoint's K-contiguous layout passed as is (when "checkpoint" is in `layouts`)."""
    from specd.kernels.common import device_num_sms
    from specd.kernels.int4_gemm import choose_config, int4_gemm, int4_gemm_ref
    from specd.kernels.int4_layout import column_major

    x, weight, packed_k, scale_k = _gemm_operands(k, n, m, group_size)
    packed, scale = column_major(packed_k), column_major(scale_k)
    ref = int4_gemm_ref(x, packed_k, scale_k, group_size)
    operands = [(packed, scale)] + ([(packed_k, scale_k)] if "checkpoint" in layouts else [])
    for p, s in operands:
        torch.testing.assert_close(int4_gemm(x, p, s, group_size).float(), ref.float(),
                                   rtol=2**-7, atol=1e-2)
    t_int4 = bench_ms(lambda: int4_gemm(x, packed, scale, group_size))
    t_kmajor = (bench_ms(lambda: int4_gemm(x, packed_k, scale_k, group_size))
                if "checkpoint" in layouts else None)
    t_bf16 = bench_ms(lambda: torch.matmul(x, weight.t()))
    int4_bytes = n * k // 2 + scale.numel() * 2 + (m * k + m * n) * 2
    bf16_bytes = (n * k + m * k + m * n) * 2
    cfg = choose_config(m, n, k, group_size, device_num_sms(x.device))
    return {"m": m, "k": k, "n": n, "group_size": group_size, "int4_us": t_int4 * 1e3,
            "int4_kmajor_us": None if t_kmajor is None else t_kmajor * 1e3,
            "bf16_us": t_bf16 * 1e3, "speedup": t_bf16 / t_int4,
            "int4_bw_frac": int4_bytes / (t_int4 * 1e-3) / PEAK_BYTES_PER_S,
            "bf16_bw_frac": bf16_bytes / (t_bf16 * 1e-3) / PEAK_BYTES_PER_S,
            "int4_bw_share": _bw_share(int4_bytes, t_int4),
            "bf16_bw_share": _bw_share(bf16_bytes, t_bf16),
            "config": _config_name(cfg)}


def _config_name(cfg: Any) -> str:
    return (f"{cfg.kind} bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k} sk{cfg.split_k} "
            f"w{cfg.num_warps} s{cfg.num_stages}")


def sweep_gemm(k: int, n: int, m: int) -> list[dict[str, Any]]:
    """Time split-K configurations around the default (to tune `choose_config`)."""
    from specd.kernels.int4_gemm import GemmConfig, int4_gemm
    from specd.kernels.int4_layout import column_major

    x, _, packed_k, scale_k = _gemm_operands(k, n, m)
    packed, scale = column_major(packed_k), column_major(scale_k)
    block_m = 1 if m == 1 else max(16, 1 << (m - 1).bit_length())
    rows = []
    for block_n in (16, 32, 64, 128):
        for block_k in (32, 128):
            for split_k in (1, 2, 4, 8):
                cfg = GemmConfig("splitk", block_m, block_n, block_k, split_k=split_k)
                t = bench_ms(lambda c=cfg: int4_gemm(x, packed, scale, GROUP_SIZE, config=c))
                rows.append({"m": m, "k": k, "n": n, "config": _config_name(cfg),
                             "int4_us": t * 1e3})
    return sorted(rows, key=lambda r: r["int4_us"])


def _tree_case(t: int, prefix: int, batch: int = 4, heads: int = 32, kv_heads: int = 8,
               head_dim: int = 128, block_size: int = 16) -> dict[str, Any]:
    gen = torch.Generator(device=DEVICE).manual_seed(t + prefix)
    seq = prefix + t
    blocks_per_seq = -(-seq // block_size)
    kv = torch.randn(2, batch * blocks_per_seq, block_size, kv_heads, head_dim, device=DEVICE,
                     generator=gen, dtype=torch.bfloat16)
    tables = torch.randperm(batch * blocks_per_seq, device=DEVICE, generator=gen)
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch * t, heads, head_dim, device=DEVICE, generator=gen,
                    dtype=torch.bfloat16)
    # A binary-ish tree: node i's parent is (i - 1) // 2; row i sees its ancestors and itself.
    masks = []
    for i in range(t):
        bits, node = 0, i
        while node >= 0:
            bits |= 1 << node
            node = (node - 1) // 2 if node > 0 else -1
        masks.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    return {"q": q, "kv": kv, "tables": tables, "batch": batch, "t": t, "seq": seq,
            "seq_lens": torch.full((batch,), seq, dtype=torch.int32, device=DEVICE),
            "qsl": torch.arange(0, batch * t + 1, t, dtype=torch.int32, device=DEVICE),
            "tree_mask": torch.tensor(masks * batch, dtype=torch.int64, device=DEVICE),
            "block_size": block_size}


def bench_tree(t: int, prefix: int) -> dict[str, float | None]:
    from specd.kernels.tree_attention import tree_attention, tree_attention_ref

    c = _tree_case(t, prefix)
    q, kv, batch, seq = c["q"], c["kv"], c["batch"], c["seq"]
    scale = q.shape[-1] ** -0.5
    args = (q, kv[0], kv[1], c["tables"], c["seq_lens"], c["qsl"], c["tree_mask"], scale, t)
    out = tree_attention(*args, max_seq_len=seq)
    torch.testing.assert_close(out.float(), tree_attention_ref(*args).float(), rtol=2**-7,
                               atol=2e-2)
    t_tree = bench_ms(lambda: tree_attention(*args, max_seq_len=seq))
    # SDPA baseline: contiguous K/V [B, kv_heads, S, D] and a dense mask [B, 1, T, S].
    pos = torch.arange(seq, device=DEVICE)
    slots = c["tables"][:, pos // c["block_size"]].long() * c["block_size"] + pos % c[
        "block_size"]  # [B, S]
    heads_kv, dim = kv.shape[-2:]
    k = kv[0].view(-1, heads_kv, dim)[slots].transpose(1, 2).contiguous()
    v = kv[1].view(-1, heads_kv, dim)[slots].transpose(1, 2).contiguous()
    bits = c["tree_mask"].view(batch, t, 1)
    rel = pos - prefix
    mask = (rel < 0) | (((bits >> rel.clamp(0, 63)) & 1) == 1)  # [B, T, S]
    q_sdpa = q.view(batch, t, -1, dim).transpose(1, 2)
    t_sdpa = bench_ms(lambda: F.scaled_dot_product_attention(
        q_sdpa, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True))
    kv_bytes = 2 * batch * seq * heads_kv * dim * 2
    return {"t": t, "prefix": prefix, "batch": batch, "tree_us": t_tree * 1e3,
            "sdpa_us": t_sdpa * 1e3, "speedup": t_sdpa / t_tree,
            "tree_bw_frac": kv_bytes / (t_tree * 1e-3) / PEAK_BYTES_PER_S,
            "tree_bw_share": _bw_share(kv_bytes, t_tree)}


def _binary_tree_masks(t: int) -> list[int]:
    """Node i's parent is (i - 1) // 2; row i sees its ancestors and itself (as int64)."""
    masks = []
    for i in range(t):
        bits, node = 0, i
        while node >= 0:
            bits |= 1 << node
            node = (node - 1) // 2 if node > 0 else -1
        masks.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    return masks


def mla_case(heads: int, t: int, context: int, batch: int = 4, rank: int = MLA_RANK,
             rope: int = MLA_ROPE, block_size: int = 16) -> dict[str, Any]:
    """Operands of `mla_attention` for `batch` sequences of `context` keys, the last t of
    them draft tokens (a binary tree; causal at t = 1), in shuffled blocks."""
    gen = torch.Generator(device=DEVICE).manual_seed(heads + t + context)
    blocks_per_seq = -(-context // block_size)
    cache = torch.randn(batch * blocks_per_seq, block_size, rank + rope, device=DEVICE,
                        generator=gen, dtype=torch.bfloat16)
    tables = torch.randperm(batch * blocks_per_seq, device=DEVICE, generator=gen)
    q = torch.randn(batch * t, heads, rank + rope, device=DEVICE, generator=gen,
                    dtype=torch.bfloat16)
    tree_mask = (torch.tensor(_binary_tree_masks(t) * batch, dtype=torch.int64, device=DEVICE)
                 if t > 1 else None)
    args = (q[..., :rank], q[..., rank:], cache,
            tables.view(batch, blocks_per_seq).to(torch.int32),
            torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
            torch.arange(0, batch * t + 1, t, dtype=torch.int32, device=DEVICE), tree_mask,
            MLA_SCALE, t)
    return {"args": args, "q": q, "batch": batch, "t": t, "context": context,
            "block_size": block_size}


def check_mla(c: dict[str, Any]) -> None:
    """The kernel against its reference (bf16 rounding of p and of the output)."""
    from specd.kernels.mla_attention import mla_attention, mla_attention_ref

    out = mla_attention(*c["args"], max_seq_len=c["context"])
    torch.testing.assert_close(out.float(), mla_attention_ref(*c["args"]).float(),
                               rtol=2**-7, atol=2e-2)


def bench_mla(heads: int, t: int, context: int) -> dict[str, float | None]:
    from specd.kernels.mla_attention import mla_attention

    c = mla_case(heads, t, context)
    check_mla(c)
    args, batch, block_size = c["args"], c["batch"], c["block_size"]
    t_mla = bench_ms(lambda: mla_attention(*args, max_seq_len=context))
    # SDPA baseline: the latent rows gathered contiguous [B, 1, S, 576], a mask [B, 1, T, S].
    cache, tables, tree_mask = args[2], args[3], args[6]
    pos = torch.arange(context, device=DEVICE)
    rows = cache[tables[:, pos // block_size].long(), pos % block_size][:, None]
    rel = pos - (context - t)
    bits = (tree_mask.view(batch, t, 1) if tree_mask is not None
            else torch.ones(batch, 1, 1, dtype=torch.int64, device=DEVICE))
    mask = (rel < 0) | (((bits >> rel.clamp(0, 63)) & 1) == 1)  # [B, T, S]
    q_sdpa = c["q"].view(batch, t, heads, -1).transpose(1, 2)  # [B, H, T, 576]
    t_sdpa = bench_ms(lambda: F.scaled_dot_product_attention(
        q_sdpa, rows, rows[..., :MLA_RANK], attn_mask=mask[:, None], scale=MLA_SCALE,
        enable_gqa=True))
    latent_bytes = batch * context * (MLA_RANK + MLA_ROPE) * 2
    flops = 2 * batch * heads * t * context * (2 * MLA_RANK + MLA_ROPE)
    return {"heads": heads, "t": t, "context": context, "batch": batch,
            "mla_us": t_mla * 1e3, "sdpa_us": t_sdpa * 1e3, "speedup": t_sdpa / t_mla,
            "mla_bw_frac": latent_bytes / (t_mla * 1e-3) / PEAK_BYTES_PER_S,
            "mla_bw_share": _bw_share(latent_bytes, t_mla),
            "mla_tflops": flops / (t_mla * 1e-3) / 1e12}


def run_mla(result: dict[str, Any], out: Path, quick: bool) -> None:
    """The MLA part of main: every shape, the JSON rewritten after each head count."""
    result["mla_attention"] = []
    for heads in MLA_HEADS:
        for t in (1, 16) if quick else MLA_T:
            for context in (1024, 8192) if quick else MLA_CONTEXT:
                result["mla_attention"].append(bench_mla(heads, t, context))
        _save(out, result)
    print(_table(result["mla_attention"], ["heads", "t", "context", "batch", "mla_us",
                                           "sdpa_us", "speedup", "mla_bw_frac",
                                           "mla_bw_share", "mla_tflops"]), flush=True)


def moe_inter(tp: int) -> int:
    """The expert intermediate width one rank holds under tensor parallelism of size `tp`
    without expert parallelism (every expert, its width split: Kimi-K2 at TP8, 2048 / 8)."""
    return MOE_INTER // tp


def moe_weights(group_size: int = GROUP_SIZE, baseline: bool = True,
                tp: int = 1) -> tuple[Any, Any]:
    """(Int4ExpertWeights, ExpertWeights in bf16 or None) at Kimi-K2's shapes, one rank's
    under tensor parallelism `tp`: random packed words (every nibble uniform), scales in
    [0.001, 0.003); the bf16 baseline's own random weights (timing only: 34 GB beside the
    INT4 9.5 GB at TP1)."""
    from specd.kernels.moe_w4a16 import Int4ExpertWeights
    from specd.workers.models.moe import ExpertWeights

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    e, h, i = MOE_EXPERTS, MOE_HIDDEN, moe_inter(tp)

    def packed(n: int, k: int) -> torch.Tensor:
        return torch.randint(-2**31, 2**31 - 1, (e, n, k // 8), dtype=torch.int32,
                             device=DEVICE, generator=gen)

    def scale(n: int, k: int) -> torch.Tensor:
        return (torch.rand(e, n, k // group_size, device=DEVICE, generator=gen) * 0.002
                + 0.001).to(torch.bfloat16)

    int4 = Int4ExpertWeights(packed(2 * i, h), scale(2 * i, h), packed(h, i), scale(h, i),
                             group_size)
    if not baseline:
        return int4, None
    dense = ExpertWeights(
        torch.randn(e, 2 * i, h, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02,
        torch.randn(e, h, i, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02)
    return int4, dense


def n_major_experts(int4: Any) -> Any:
    """The same Int4ExpertWeights with each tensor stored output-contiguous per expert."""
    from specd.kernels.moe_w4a16 import Int4ExpertWeights

    fields = {name: t.transpose(1, 2).contiguous().transpose(1, 2)
              for name, t in int4.tensors().items()}
    return Int4ExpertWeights(group_size=int4.group_size, **fields)


def _moe_routing(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform top-8 of 384 per token (distinct experts), weights normalized and scaled."""
    gen = torch.Generator(device=DEVICE).manual_seed(m)
    scores = torch.rand(m, MOE_EXPERTS, device=DEVICE, generator=gen)
    weights, ids = scores.topk(MOE_TOP_K, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True) * MOE_RSF


def _graph_ms(fn: Any) -> tuple[float | None, str | None]:
    """Median time of `fn` replayed from a CUDA graph, or (None, why) if it cannot be
    captured."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")), None
    except Exception as exc:  # noqa: BLE001 - reported in the row, the eager time stands
        return None, f"{type(exc).__name__}: {exc}"[:300]


def bench_moe(m: int, int4: Any, int4_nmajor: Any | None, dense: Any | None,
              tp: int = 1) -> dict[str, Any]:
    """The fused INT4 MoE for m tokens (eagerly and replayed as a graph: the us per layer a
    captured step pays), against the bf16 `experts_forward` and the other layout when given
    (see docstring)."""
    from specd.kernels.moe_align import moe_align_block_size, moe_align_block_size_ref
    from specd.kernels.moe_w4a16 import (
        choose_moe_config,
        fused_moe,
        fused_moe_ref,
    )
    from specd.workers.models.moe import experts_forward

    inter = moe_inter(tp)
    gen = torch.Generator(device=DEVICE).manual_seed(m)
    x = torch.randn(m, MOE_HIDDEN, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    ids, weights = _moe_routing(m)
    out = fused_moe(x, ids, weights, int4)
    ref = fused_moe_ref(x, ids, weights, int4)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7,
                               atol=2**-7 * float(ref.float().abs().max()))
    cfg = choose_moe_config(m * MOE_TOP_K, MOE_EXPERTS, inter, MOE_HIDDEN)
    t_moe = bench_ms(lambda: fused_moe(x, ids, weights, int4))
    t_graph, graph_error = _graph_ms(lambda: fused_moe(x, ids, weights, int4))
    row: dict[str, Any] = {"m": m, "tp": tp, "experts": MOE_EXPERTS, "inter": inter}
    if int4_nmajor is not None:
        torch.testing.assert_close(fused_moe(x, ids, weights, int4_nmajor), out)
        row["moe_nmajor_us"] = bench_ms(lambda: fused_moe(x, ids, weights, int4_nmajor)) * 1e3
        row["align_us"] = bench_ms(
            lambda: moe_align_block_size(ids, cfg.block_m, MOE_EXPERTS)) * 1e3
        row["align_torch_us"] = bench_ms(
            lambda: moe_align_block_size_ref(ids, cfg.block_m, MOE_EXPERTS)) * 1e3
    touched = int(ids.unique().numel())
    hi = MOE_HIDDEN * inter
    pairs = m * MOE_TOP_K
    buffers = (2 * m * MOE_HIDDEN + 2 * pairs * (inter + MOE_HIDDEN)) * 2  # x, out, h, y
    int4_bytes = touched * (3 * hi // 2 + 3 * hi // GROUP_SIZE * 2) + buffers
    bf16_bytes = touched * 3 * hi * 2 + buffers
    bps = MEASURED_BYTES_PER_S or PEAK_BYTES_PER_S
    if dense is not None:
        t_bf16 = bench_ms(lambda: experts_forward(x, ids, weights, dense))
        row.update(bf16_us=t_bf16 * 1e3, speedup=t_bf16 / t_moe)
    row.update({
        "experts_touched": touched, "moe_us": t_moe * 1e3,
        "moe_graph_us": None if t_graph is None else t_graph * 1e3,
        "graph_error": graph_error, "moe_floor_us": int4_bytes / bps * 1e6,
        "bf16_floor_us": bf16_bytes / bps * 1e6,
        "moe_bw_frac": int4_bytes / (t_moe * 1e-3) / PEAK_BYTES_PER_S,
        "moe_bw_share": _bw_share(int4_bytes, t_moe),
        "moe_graph_bw_share": None if t_graph is None else _bw_share(int4_bytes, t_graph),
        "config": f"bm{cfg.block_m} bn{cfg.block_n}/{cfg.block_n_down} "
                  f"bk{cfg.block_k}/{cfg.block_k_down} w{cfg.num_warps} s{cfg.num_stages}"})
    return row


def run_moe(result: dict[str, Any], out: Path, quick: bool, extras: bool = True, tp: int = 1,
            m_values: tuple[int, ...] = MOE_M) -> None:
    """The fused-MoE part: every M, the JSON rewritten after each. extras: the bf16
    baseline, the output-major layout and the aligners alone (several more timings each);
    tp: one rank's experts under tensor parallelism of that size."""
    int4, dense = moe_weights(baseline=extras, tp=tp)
    int4_nmajor = n_major_experts(int4) if extras else None
    result["moe"] = []
    for m in (1, 16, 64) if quick else m_values:
        result["moe"].append(bench_moe(m, int4, int4_nmajor, dense, tp))
        _save(out, result)
    del int4, int4_nmajor, dense
    torch.cuda.empty_cache()
    cols = ["m", "tp", "experts_touched", "moe_us", "moe_graph_us", "moe_floor_us",
            "moe_graph_bw_share", "config"]
    if extras:
        cols[6:6] = ["moe_nmajor_us", "align_us", "align_torch_us", "bf16_us", "speedup",
                     "bf16_floor_us"]
    print(_table(result["moe"], cols), flush=True)


def run_gemm(result: dict[str, Any], out: Path, quick: bool, group_sizes: list[int],
             m_values: list[int], shapes: tuple[str, ...] = tuple(GEMM_SHAPES),
             layouts: tuple[str, ...] = GEMM_LAYOUTS) -> None:
    """The INT4 GEMM part: every shape at every M and group size, the JSON rewritten after
    each shape."""
    names = shapes[:2] if quick else shapes
    for group_size in group_sizes:
        for name in names:
            k, n = GEMM_SHAPES[name]
            for m in (1, 16, 64) if quick else m_values:
                result["gemm"].append({"shape": name, **bench_gemm(k, n, m, group_size,
                                                                   layouts)})
            _save(out, result)
    print(_table(result["gemm"], ["shape", "group_size", "m", "int4_us", "int4_kmajor_us",
                                  "bf16_us", "speedup", "int4_bw_share", "int4_bw_frac",
                                  "bf16_bw_share", "config"]), flush=True)


def run_tree(result: dict[str, Any], out: Path, quick: bool) -> None:
    for t in TREE_T:
        for prefix in (512, 8192) if quick else TREE_PREFIX:
            result["tree_attention"].append(bench_tree(t, prefix))
        _save(out, result)
    print(_table(result["tree_attention"], ["t", "prefix", "batch", "tree_us", "sdpa_us",
                                            "speedup", "tree_bw_frac", "tree_bw_share"]),
          flush=True)


def run_host(result: dict[str, Any], out: Path) -> None:
    """The host's share of a batch-1 plain decode step of the engine on this device
    (fixture model, overlap off), eager and with CUDA graphs: tools/bench_overlap.py's
    measurement, whose host_busy_share is 1 - (time the host waited for the device) /
    (step time)."""
    from specd.tokenizer import Tokenizer
    from specd.workers.config import FIXTURE_DIR
    from tools import bench_overlap

    tok = Tokenizer.from_dir(FIXTURE_DIR)
    prompts = [tok.encode(p) for p in bench_overlap.load_prompts(1)]
    result["host_overhead"] = []
    for graphs in (False, True):
        row = bench_overlap.measure(bench_overlap.MODES["plain"], False, graphs, 1, prompts,
                                    64, DEVICE, "auto")
        row.pop("output")
        result["host_overhead"].append(row)
        _save(out, result)
    print(_table(result["host_overhead"], ["batch", "graphs", "graphs_status", "step_ms",
                                           "tokens_per_s", "host_busy_share"]), flush=True)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Against the limit: each kernel's best share of the measured copy bandwidth, at small M
    (the GEMM at M <= 16, per group size) and overall."""
    summary: dict[str, Any] = {}
    gemm = [r for r in result["gemm"] if r.get("int4_bw_share") is not None]
    for group_size in sorted({r["group_size"] for r in gemm}):
        rows = [r for r in gemm if r["group_size"] == group_size and r["m"] <= 16]
        if rows:
            summary[f"int4_g{group_size}_m<=16_best_bw_share"] = max(
                r["int4_bw_share"] for r in rows)
            summary[f"int4_g{group_size}_m<=16_median_speedup_vs_bf16"] = sorted(
                r["speedup"] for r in rows)[len(rows) // 2]
    if result["gemm"]:
        summary["gemm_summary"] = gemm_summary(result["gemm"])
    if result.get("moe"):
        summary["moe_summary"] = moe_summary(result["moe"])
    for part, key in (("tree_attention", "tree_bw_share"), ("mla_attention", "mla_bw_share"),
                      ("moe", "moe_bw_share")):
        shares = [r[key] for r in result.get(part, []) if r.get(key) is not None]
        if shares:
            summary[f"{part}_best_bw_share"] = max(shares)
    if result.get("host_overhead"):
        summary["batch1_host_busy_share"] = {
            ("graphs" if r["graphs"] else "eager"): r["host_busy_share"]
            for r in result["host_overhead"]}
    return summary


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def gemm_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per group size and M, over the shapes: the median and the worst share of the HBM
    bandwidth the INT4 GEMM and the bf16 GEMM reach, of the measured copy bandwidth
    (`*_share`, when measured) and of the nominal 4.8 TB/s (`*_frac`), and the median
    speed-up over bf16."""
    out = []
    for group_size, m in sorted({(r["group_size"], r["m"]) for r in rows}):
        sel = [r for r in rows if r["group_size"] == group_size and r["m"] == m]
        entry: dict[str, Any] = {"group_size": group_size, "m": m, "shapes": len(sel),
                                 "median_speedup": _median([r["speedup"] for r in sel])}
        for key in ("int4_bw_share", "int4_bw_frac", "bf16_bw_share", "bf16_bw_frac"):
            values = [r[key] for r in sel if r.get(key) is not None]
            if values:
                entry[f"{key}_median"] = _median(values)
                entry[f"{key}_worst"] = min(values)
        out.append(entry)
    return out


def moe_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per token count: us per MoE layer (graph replay when captured, else eager), the floor
    (the touched experts' bytes at the measured bandwidth) and their ratio."""
    out = []
    for r in rows:
        us = r["moe_graph_us"] if r.get("moe_graph_us") is not None else r["moe_us"]
        out.append({"m": r["m"], "tp": r.get("tp", 1), "us_per_layer": us,
                    "graph": r.get("moe_graph_us") is not None,
                    "floor_us": r["moe_floor_us"], "floor_share": r["moe_floor_us"] / us})
    return out


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, "-"))) for r in rows)) for c in cols]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(fmt(r.get(c, "-")).rjust(w) for c, w in zip(cols, widths, strict=True))
              for r in rows]
    return "\n".join(lines)


def plan(parts: list[str], group_sizes: list[int], m_values: list[int],
         shapes: tuple[str, ...], layouts: tuple[str, ...], moe_tp: int,
         moe_m: tuple[int, ...], moe_extras: bool, quick: bool) -> dict[str, Any]:
    """What the parts compile and time (an estimate tools/gpu_check.sh budgets): distinct
    launch configurations (each a Triton compile on a cold cache) and `do_bench` calls."""
    from specd.kernels.int4_gemm import choose_config
    from specd.kernels.moe_align import ALIGN_MAX_PAIRS
    from specd.kernels.moe_w4a16 import choose_moe_config

    compiles: set[tuple[Any, ...]] = set()
    benches = engines = 0
    figures: list[str] = []
    for part in parts:
        if part == "bandwidth":
            compiles.add(("copy",))
            benches += 2
            figures.append("bandwidth")
        elif part == "gemm":
            names = shapes[:2] if quick else shapes
            ms = (1, 16, 64) if quick else m_values
            for g in group_sizes:
                for name in names:
                    k, n = GEMM_SHAPES[name]
                    for m in ms:
                        cfg = choose_config(m, n, k, g, 132)
                        compiles.update(("gemm", layout, g, cfg) for layout in layouts)
                        benches += len(layouts) + 1
            figures.append("gemm_summary")
        elif part == "moe":
            for m in (1, 16, 64) if quick else moe_m:
                cfg = choose_moe_config(m * MOE_TOP_K, MOE_EXPERTS, moe_inter(moe_tp),
                                        MOE_HIDDEN)
                compiles.update({("moe up", cfg), ("moe down", cfg)})
                if m * MOE_TOP_K <= ALIGN_MAX_PAIRS:
                    compiles.add(("align", cfg.block_m, max(16, 1 << (m * MOE_TOP_K - 1)
                                                            .bit_length())))
                benches += 2 + (5 if moe_extras else 0)
            figures.append("moe_summary")
        elif part in ("tree", "mla"):
            cases = len(TREE_T) * len(TREE_PREFIX) if part == "tree" else (
                len(MLA_HEADS) * len(MLA_T) * len(MLA_CONTEXT))
            compiles.update((part, i) for i in range(cases // 2))  # splits repeat
            benches += 2 * cases
        elif part == "host":
            engines += 2
    return {"compiles": len(compiles), "benches": benches, "engine_builds": engines,
            "figures": figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="INT4 GEMM and tree-attention benchmark")
    parser.add_argument("--out", type=Path, default=Path("bench_out/bench_kernels.json"))
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time 32 split-K configurations at M = 1, 16, 64 on two "
                             "shapes (tuning data for choose_config)")
    parser.add_argument("--mla-only", action="store_true",
                        help="run only the MLA attention part")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"parts to run, in this order (default {','.join(PARTS)})")
    parser.add_argument("--group-sizes", default=",".join(map(str, GEMM_GROUP_SIZES)),
                        help="INT4 group sizes of the GEMM part (32, 64, 128)")
    parser.add_argument("--gemm-m", default=",".join(map(str, GEMM_M)),
                        help="rows M of the GEMM part")
    parser.add_argument("--gemm-shapes", choices=sorted(GEMM_SHAPE_SETS), default="all",
                        help="the GEMM part's shapes (llama3.1-8b: its four linears)")
    parser.add_argument("--layouts", default=",".join(GEMM_LAYOUTS),
                        help="weight layouts the GEMM part times (column_major: as Int4Linear "
                             "stores them; checkpoint: K-contiguous)")
    parser.add_argument("--moe-tp", type=int, default=1,
                        help="time one rank's experts under tensor parallelism of this size "
                             "(every expert, its width split: 8 for Kimi-K2 on 8 GPUs)")
    parser.add_argument("--moe-m", default=",".join(map(str, MOE_M)),
                        help="token counts of the MoE part")
    parser.add_argument("--moe-extras", action=argparse.BooleanOptionalAction, default=True,
                        help="the MoE part's bf16 baseline, other layout and aligners")
    parser.add_argument("--plan", action="store_true",
                        help="print the compiles and timings the run makes (JSON) and exit")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; known: {', '.join(PARTS)}")
    group_sizes = [int(g) for g in args.group_sizes.split(",")]
    if any(g not in (32, 64, 128) for g in group_sizes):
        parser.error(f"--group-sizes must be among 32, 64, 128, got {args.group_sizes}")
    m_values = [int(m) for m in args.gemm_m.split(",")]
    layouts = tuple(x for x in args.layouts.split(",") if x)
    if not layouts or set(layouts) - set(GEMM_LAYOUTS):
        parser.error(f"--layouts must be among {', '.join(GEMM_LAYOUTS)}, got {args.layouts}")
    moe_m = tuple(int(m) for m in args.moe_m.split(","))
    if MOE_INTER % args.moe_tp or (MOE_INTER // args.moe_tp) % GROUP_SIZE:
        parser.error(f"--moe-tp {args.moe_tp} does not split {MOE_INTER} into groups of "
                     f"{GROUP_SIZE}")
    shapes = GEMM_SHAPE_SETS[args.gemm_shapes]
    if args.plan:
        print(json.dumps(plan(parts, group_sizes, m_values, shapes, layouts, args.moe_tp,
                              moe_m, args.moe_extras, args.quick)))
        return 0
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA device (the kernels' CPU path is the torch "
              "reference, which is not what this measures); none is available", file=sys.stderr)
        return 2
    import triton

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "group_size": GROUP_SIZE,
        "peak_bytes_per_s": PEAK_BYTES_PER_S, "gemm": [], "tree_attention": [], "sweep": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.mla_only:
        run_mla(result, args.out, args.quick)
        print(f"wrote {args.out}", file=sys.stderr)
        return 0
    # The JSON is rewritten after each part (and within the long ones), so a run cut short
    # keeps what it measured.
    for part in parts:
        if part == "bandwidth":
            result["bandwidth"] = measure_bandwidth()
            print(f"copy bandwidth: {result['bandwidth']['measured_bytes_per_s'] / 1e12:.2f} "
                  f"TB/s ({result['bandwidth']['share_of_nominal']:.0%} of the nominal "
                  f"{PEAK_BYTES_PER_S / 1e12:.1f} TB/s)", flush=True)
        elif part == "gemm":
            run_gemm(result, args.out, args.quick, group_sizes, m_values, shapes, layouts)
        elif part == "tree":
            run_tree(result, args.out, args.quick)
        elif part == "mla":
            run_mla(result, args.out, args.quick)
        elif part == "host":
            run_host(result, args.out)
        elif part == "moe":
            run_moe(result, args.out, args.quick, args.moe_extras, args.moe_tp, moe_m)
        result["summary"] = summarize(result)
        _save(args.out, result)
    print("against the limit:", json.dumps(result.get("summary", {}), indent=2), flush=True)
    if args.sweep:  # two shapes: a wide-N and a wide-K one
        for name, (k, n) in list(GEMM_SHAPES.items())[1::3]:
            for m in (1, 16, 64):
                best = sweep_gemm(k, n, m)
                result["sweep"].append({"shape": name, "m": m, "best": best[:5]})
                _save(args.out, result)
                print(f"sweep {name} m={m}: best {best[0]['config']} "
                      f"{best[0]['int4_us']:.1f} us", flush=True)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _save(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")

if __name__ == "__main__":
    sys.exit(main())
