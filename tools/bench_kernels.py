"""Kernel benchmark (CUDA only): the INT4 GEMM against bf16 matmul, tree attention against SDPA.

    python tools/bench_kernels.py --out bench_out/bench_kernels.json [--quick]

INT4 W4A16 GEMM (group 32) on Llama-3-8B projection shapes and Kimi-K2 expert shapes, given as
in x out (K x N), at M = 1..128 rows, against `torch.matmul` on the same bf16 weight: time,
speedup, and achieved bandwidth (weights + scales + activations + output bytes over time)
against the H200's 4.8 TB/s. Targets (issue 4): >= 3.0x and >= 80% of peak at M <= 16, faster
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

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e, nominal
GEMM_SHAPES = {  # name: (K = in_features, N = out_features)
    "llama3-8b qkv/o 4096x4096": (4096, 4096),
    "llama3-8b gate/up 4096x14336": (4096, 14336),
    "llama3-8b down 14336x4096": (14336, 4096),
    "kimi-k2 expert gate/up 7168x2048": (7168, 2048),
    "kimi-k2 expert down 2048x7168": (2048, 7168),
}
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


def bench_ms(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _gemm_operands(k: int, n: int, m: int) -> tuple[torch.Tensor, ...]:
    """(x [m, k], bf16 weight [n, k], packed and scale as the checkpoint stores them)."""
    from specd.workers.quantization import quantize_rtn

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    weight = torch.randn(n, k, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02
    packed, scale = quantize_rtn(weight, GROUP_SIZE)
    x = torch.randn(m, k, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    return x, weight, packed, scale


def bench_gemm(k: int, n: int, m: int) -> dict[str, float | str]:
    """int4_us: N-contiguous weights as Int4Linear stores them; int4_kmajor_us: the
    checkpoint's K-contiguous layout passed as is."""
    from specd.kernels.common import device_num_sms
    from specd.kernels.int4_gemm import choose_config, column_major, int4_gemm, int4_gemm_ref

    x, weight, packed_k, scale_k = _gemm_operands(k, n, m)
    packed, scale = column_major(packed_k), column_major(scale_k)
    ref = int4_gemm_ref(x, packed_k, scale_k, GROUP_SIZE)
    for p, s in ((packed, scale), (packed_k, scale_k)):
        torch.testing.assert_close(int4_gemm(x, p, s, GROUP_SIZE).float(), ref.float(),
                                   rtol=2**-7, atol=1e-2)
    t_int4 = bench_ms(lambda: int4_gemm(x, packed, scale, GROUP_SIZE))
    t_kmajor = bench_ms(lambda: int4_gemm(x, packed_k, scale_k, GROUP_SIZE))
    t_bf16 = bench_ms(lambda: torch.matmul(x, weight.t()))
    int4_bytes = n * k // 2 + scale.numel() * 2 + (m * k + m * n) * 2
    cfg = choose_config(m, n, k, GROUP_SIZE, device_num_sms(x.device))
    return {"m": m, "k": k, "n": n, "int4_us": t_int4 * 1e3, "int4_kmajor_us": t_kmajor * 1e3,
            "bf16_us": t_bf16 * 1e3, "speedup": t_bf16 / t_int4,
            "int4_bw_frac": int4_bytes / (t_int4 * 1e-3) / PEAK_BYTES_PER_S,
            "bf16_bw_frac": (n * k + m * k + m * n) * 2 / (t_bf16 * 1e-3) / PEAK_BYTES_PER_S,
            "config": _config_name(cfg)}


def _config_name(cfg: Any) -> str:
    return (f"{cfg.kind} bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k} sk{cfg.split_k} "
            f"w{cfg.num_warps} s{cfg.num_stages}")


def sweep_gemm(k: int, n: int, m: int) -> list[dict[str, Any]]:
    """Time split-K configurations around the default (to tune `choose_config`)."""
    from specd.kernels.int4_gemm import GemmConfig, column_major, int4_gemm

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


def bench_tree(t: int, prefix: int) -> dict[str, float]:
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
            "tree_bw_frac": kv_bytes / (t_tree * 1e-3) / PEAK_BYTES_PER_S}


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


def bench_mla(heads: int, t: int, context: int) -> dict[str, float]:
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
                                           "mla_tflops"]), flush=True)


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(fmt(r[c]).rjust(w) for c, w in zip(cols, widths, strict=True))
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="INT4 GEMM and tree-attention benchmark")
    parser.add_argument("--out", type=Path, default=Path("bench_out/bench_kernels.json"))
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time 32 split-K configurations at M = 1, 16, 64 on two "
                             "shapes (tuning data for choose_config)")
    parser.add_argument("--mla-only", action="store_true",
                        help="run only the MLA attention part")
    args = parser.parse_args(argv)
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
    shapes = dict(list(GEMM_SHAPES.items())[:2]) if args.quick else GEMM_SHAPES
    for name, (k, n) in shapes.items():  # the JSON is rewritten after each part, so a run
        for m in (1, 16, 64) if args.quick else GEMM_M:  # cut short keeps what it measured
            result["gemm"].append({"shape": name, **bench_gemm(k, n, m)})
        _save(args.out, result)
    print(_table(result["gemm"], ["shape", "m", "int4_us", "int4_kmajor_us", "bf16_us",
                                  "speedup", "int4_bw_frac", "config"]), flush=True)
    for t in TREE_T:
        for prefix in (512, 8192) if args.quick else TREE_PREFIX:
            result["tree_attention"].append(bench_tree(t, prefix))
        _save(args.out, result)
    print(_table(result["tree_attention"], ["t", "prefix", "batch", "tree_us", "sdpa_us",
                                            "speedup", "tree_bw_frac"]), flush=True)
    run_mla(result, args.out, args.quick)
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
