"""Host time per step of the real engine at real shapes, and the batch-1 speculative speed-up
from the engine's own draft loop.

At start an INT4 Llama-3.1-8B-shaped target (random weights; compressed-tensors
`pack-quantized`, group `--group-size`, lm_head and embeddings bf16) and an EAGLE-3 head of the
shapes published for it are generated on `--device` and written as checkpoints into `--work`
(tools/bench_shapes.py's SHAPES). One `EngineCore` loads them as a deployment would (the
speculative worker; overlap scheduling and CUDA graphs as the engine enables them on the
device), warms up, and serves each batch size of `--batch-sizes` with speculation off (plain
decode) and on (a `--draft-steps` chain), `--steps` steps each once every request has its
first token:

* `host_us_per_step`: (wall time - time the host waited for the device's results) / steps,
  the host's own work per step (`HostCopy.total_wait_s` counts the waits); `step_us`: wall /
  steps; `host_share`: their ratio; `tokens_per_step`.
* `speedup_bs1`: batch 1, tau * step_us(plain) / step_us(speculative) at acceptance length
  tau = 2..draft steps + 1, and the break-even tau (speculation pays above it). Random
  weights accept almost nothing, so acceptance is a parameter (as in bench_shapes.py); the
  step times are the engine's own: catch-up, the captured draft loop, verification, update.

`--shapes reduced` runs the same on the CPU in seconds (a test checks the JSON); CPU timings
mean nothing for the GPU. `--plan` prints what the run will compile and build (the counts
tools/gpu_check.sh's dry run budgets) and the figures it writes, without running.

    python -m tools.bench_host --device cuda --out bench_out/bench_host.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.runner.host_copy import HostCopy
from tools.bench_shapes import ACCEPTANCE_LENGTHS, SHAPES

FIGURES = ("host_us_per_step", "step_us", "host_share", "speedup_bs1")
PROMPT_LEN = 64
LAYERS_PER_FILE = 8


# ----------------------------------------------------------------------------- checkpoints


def _int4(out_f: int, in_f: int, group: int, device: torch.device, gen: torch.Generator
          ) -> dict[str, torch.Tensor]:
    """One pack-quantized linear: random words (every nibble uniform), scales that keep the
    output's scale near the input's (q has std ~4.6: scale 1 / (4.6 sqrt(in)))."""
    packed = torch.randint(-2**31, 2**31 - 1, (out_f, in_f // 8), dtype=torch.int32,
                           device=device, generator=gen)
    scale = torch.full((out_f, in_f // group), 1.0 / (4.6 * math.sqrt(in_f)),
                       dtype=torch.bfloat16, device=device)
    return {"weight_packed": packed, "weight_scale": scale,
            "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64)}


def _save(tensors: dict[str, torch.Tensor], path: Path) -> int:
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(cpu, str(path), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in cpu.values())


def write_target(raw: dict[str, Any], group_size: int, root: Path, device: torch.device
                 ) -> int:
    """The target's config.json and sharded safetensors (an index names each tensor's file);
    returns the bytes written."""
    cfg = json.loads(json.dumps(raw))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = group_size
    cfg["torch_dtype"] = "bfloat16"
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads, head_dim = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                 cfg["head_dim"])
    gen = torch.Generator(device=device).manual_seed(0)
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
              "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
              "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    weight_map: dict[str, str] = {}
    written = 0
    layers = cfg["num_hidden_layers"]
    for first in range(0, layers, LAYERS_PER_FILE):
        tensors: dict[str, torch.Tensor] = {}
        for i in range(first, min(first + LAYERS_PER_FILE, layers)):
            prefix = f"model.layers.{i}"
            for name, (n, k) in shapes.items():
                for kind, t in _int4(n, k, group_size, device, gen).items():
                    tensors[f"{prefix}.{name}.{kind}"] = t
            for norm in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"{prefix}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
        file = f"model-{first // LAYERS_PER_FILE:05d}.safetensors"
        written += _save(tensors, root / file)
        weight_map |= dict.fromkeys(tensors, file)
    vocab = cfg["vocab_size"]
    rest = {"model.embed_tokens.weight": torch.randn(vocab, h, device=device, generator=gen,
                                                     dtype=torch.bfloat16) * 0.02,
            "lm_head.weight": torch.randn(vocab, h, device=device, generator=gen,
                                          dtype=torch.bfloat16) * h ** -0.5,
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    written += _save(rest, root / "model-rest.safetensors")
    weight_map |= dict.fromkeys(rest, "model-rest.safetensors")
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": written}, "weight_map": weight_map}))
    return written


def write_head(raw: dict[str, Any], root: Path, device: torch.device) -> int:
    """The EAGLE-3 head's config.json and model.safetensors (sharing the target's embedding;
    d2t maps draft id i to target token i); returns the bytes written."""
    from specd.workers.spec.draft_config import DraftConfig
    from specd.workers.spec.draft_model import empty_draft_head

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(raw, indent=2))
    cfg = DraftConfig.from_dict(raw)
    head = empty_draft_head(cfg, torch.bfloat16, "meta")  # its tensors' names and shapes
    gen = torch.Generator(device=device).manual_seed(1)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in head.state_dict().items():
        if name in ("embed_tokens.weight", "d2t", "t2d"):
            continue
        if p.dim() == 1:  # the norms
            tensors[name] = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(p.shape, device=device, generator=gen,
                                         dtype=torch.bfloat16) * p.shape[1] ** -0.5)
    tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[:cfg.draft_vocab_size] = True
    tensors["t2d"] = t2d
    return _save(tensors, root / "model.safetensors")


# ----------------------------------------------------------------------------- measurement


def measure(core: EngineCore, batch: int, speculative: bool, steps: int, vocab: int
            ) -> dict[str, Any]:
    """`steps` engine steps of `batch` requests once each has its first token."""
    core.set_spec_mode("on" if speculative else "off")
    gen = torch.Generator().manual_seed(batch)
    ids = [f"b{batch}-{'spec' if speculative else 'plain'}-{i}" for i in range(batch)]
    tokens = {r: 0 for r in ids}
    params = SamplingParams(max_tokens=8 * steps + 16, ignore_eos=True)
    for r in ids:
        prompt = torch.randint(1, vocab, (PROMPT_LEN,), generator=gen).tolist()
        core.add_request(r, prompt, params)

    def step() -> int:
        emitted = 0
        for delta in core.step():
            tokens[delta.request_id] += len(delta.new_token_ids)
            emitted += len(delta.new_token_ids)
        return emitted

    while not all(tokens.values()):
        step()
    if core.config.device.startswith("cuda"):
        torch.cuda.synchronize()
    waited, started, emitted = HostCopy.total_wait_s, time.perf_counter(), 0
    for _ in range(steps):
        emitted += step()
    wall = time.perf_counter() - started
    wait = HostCopy.total_wait_s - waited
    for r in ids:
        core.abort_request(r)
    while core.has_unfinished():
        core.step()
    host = max(0.0, wall - wait)
    return {"batch": batch, "mode": "spec" if speculative else "plain", "steps": steps,
            "step_us": 1e6 * wall / steps, "host_us_per_step": 1e6 * host / steps,
            "device_wait_us_per_step": 1e6 * wait / steps,
            "host_share": host / wall if wall > 0 else 1.0,
            "tokens_per_step": emitted / steps,
            "graphs": core.resolved.graphs, "overlap": core.resolved.overlap_schedule}


def speedup(plain_us: float, spec_us: float, draft_steps: int) -> dict[str, Any]:
    """Batch-1 speed-up of speculation at each acceptance length, and the break-even one."""
    return {"plain_step_us": plain_us, "spec_step_us": spec_us,
            "speedup": {f"{tau:g}": tau * plain_us / spec_us for tau in ACCEPTANCE_LENGTHS
                        if tau <= draft_steps + 1},
            "break_even_acceptance": spec_us / plain_us}


# ----------------------------------------------------------------------------- plan


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """What the run compiles and builds (an estimate gpu_check.sh budgets): the INT4 GEMM
    configurations of the target's four linears at every row count a step runs (decode and
    verify at each captured batch size, a prefill chunk), the attention launches of those
    steps, one engine, the checkpoint bytes."""
    from specd.kernels.int4_gemm import choose_config
    from specd.kernels.tree_attention import choose_num_kv_splits
    from specd.workers.runner.graphs import capture_sizes

    raw = SHAPES[args.shapes]["target"]
    h, inter = raw["hidden_size"], raw["intermediate_size"]
    heads, kvh, hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    linears = [(h, (heads + 2 * kvh) * hd), (heads * hd, h), (h, 2 * inter), (inter, h)]
    sizes = capture_sizes(max(args.batch_sizes))
    t = args.draft_steps + 1
    rows = {b for b in sizes} | {b * t for b in sizes} | {PROMPT_LEN * b for b in sizes}
    configs = {(k, n, choose_config(m, n, k, args.group_size, 132)) for k, n in linears
               for m in rows}
    kernels = {(c.kind, c.block_m, c.block_n, c.block_k, c.split_k) for _, _, c in configs}
    longest = args.max_model_len + 64
    attention = {(q, choose_num_kv_splits(b * kvh, longest, 132)) for b in sizes
                 for q in (1, t)} | {(PROMPT_LEN, 1)}
    weights = sum(n * k // 2 + n * k // args.group_size * 2 for k, n in linears)
    weights = weights * raw["num_hidden_layers"] + 2 * raw["vocab_size"] * h * 2
    return {"compiles": len(kernels) * 2 + 2 * len(attention), "benches": 0,
            "engine_builds": 1, "engine_steps": 2 * len(args.batch_sizes) * args.steps,
            "checkpoint_bytes": weights, "figures": list(FIGURES)}


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", choices=sorted(SHAPES), default=None,
                   help="model shapes (default: llama-3.1-8b on CUDA, reduced on the CPU)")
    p.add_argument("--group-size", type=int, default=32, choices=[32, 64, 128])
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--steps", type=int, default=32, help="measured steps per configuration")
    p.add_argument("--draft-steps", type=int, default=5, help="speculative chain length")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="the KV budget (default 8 GiB on CUDA, 1/16 GiB on the CPU)")
    p.add_argument("--work", type=Path, default=None,
                   help="where the checkpoints are written (default: a temporary folder)")
    p.add_argument("--plan", action="store_true", help="print the plan as JSON and exit")
    p.add_argument("--out", type=Path, default=Path("bench_out/bench_host.json"))
    args = p.parse_args(argv)
    args.shapes = args.shapes or ("reduced" if args.device == "cpu" else "llama-3.1-8b")
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    if args.kv_cache_gib is None:
        args.kv_cache_gib = 1 / 16 if args.device == "cpu" else 8.0
    if min(args.batch_sizes) < 1 or args.steps < 1 or not 1 <= args.draft_steps <= 15:
        p.error("batch sizes and --steps must be >= 1, --draft-steps in 1..15")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        print(json.dumps(plan(args)))
        return 0
    device = torch.device(args.device)
    work = args.work or Path(tempfile.mkdtemp(prefix="specd_bench_host_"))
    shapes = SHAPES[args.shapes]
    result: dict[str, Any] = {
        "shapes": args.shapes, "device": args.device, "group_size": args.group_size,
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
        "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        target_bytes = write_target(shapes["target"], args.group_size, work / "target", device)
        head_bytes = write_head(shapes["draft"], work / "head", device)
        result["checkpoint"] = {"target_bytes": target_bytes, "head_bytes": head_bytes,
                                "write_s": time.perf_counter() - started}
        _save_json(args.out, result)
        print(f"checkpoints: {target_bytes / 2**30:.2f} + {head_bytes / 2**30:.2f} GiB in "
              f"{result['checkpoint']['write_s']:.1f} s", flush=True)
        started = time.perf_counter()
        core = EngineCore(EngineConfig(
            model=str(work / "target"), draft_model=str(work / "head"), device=args.device,
            dtype="bfloat16" if device.type == "cuda" else "float32",
            max_num_seqs=max(args.batch_sizes), max_model_len=args.max_model_len,
            kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), spec_mode="on",
            spec_topk=1, spec_num_steps=args.draft_steps,
            spec_num_draft_tokens=args.draft_steps + 1, spec_auto_measure=False))
        built = time.perf_counter()
        core.warmup()
        result["engine"] = {"build_s": built - started,
                            "warmup_s": time.perf_counter() - built,
                            "graphs": core.resolved.graphs,
                            "overlap": core.resolved.overlap_schedule}
        _save_json(args.out, result)
        print(f"engine: built in {result['engine']['build_s']:.1f} s, warmed up in "
              f"{result['engine']['warmup_s']:.1f} s; graphs: {core.resolved.graphs}",
              flush=True)
        vocab = core.model_config.vocab_size
        print(f"{'batch':>5} {'mode':>6} {'step us':>9} {'host us':>9} {'host share':>10} "
              f"{'tok/step':>9}", flush=True)
        for batch in args.batch_sizes:
            for speculative in (False, True):
                row = measure(core, batch, speculative, args.steps, vocab)
                result["rows"].append(row)
                _save_json(args.out, result)
                print(f"{batch:>5} {row['mode']:>6} {row['step_us']:>9.1f} "
                      f"{row['host_us_per_step']:>9.1f} {row['host_share']:>10.2f} "
                      f"{row['tokens_per_step']:>9.2f}", flush=True)
        by = {(r["batch"], r["mode"]): r["step_us"] for r in result["rows"]}
        if (1, "plain") in by and (1, "spec") in by:
            result["speedup_bs1"] = speedup(by[(1, "plain")], by[(1, "spec")],
                                            args.draft_steps)
            _save_json(args.out, result)
            print("batch-1 speed-up at acceptance length tau: " + ", ".join(
                f"{tau}: {s:.2f}" for tau, s in result["speedup_bs1"]["speedup"].items())
                + f" (break-even tau {result['speedup_bs1']['break_even_acceptance']:.2f})",
                flush=True)
        core.close()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _save_json(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
