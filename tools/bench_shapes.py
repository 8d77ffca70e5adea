"""Real shapes, controlled acceptance: what speculation yields on this device, by batch size.

specd's own model code (the dense decoder with Int4Linear layers, the EAGLE-3 draft head, the
paged attention kernel) is built at a real model's shapes with random weights: Llama-3.1-8B
as an INT4 W4A16 checkpoint (compressed-tensors pack-quantized, group 128, lm_head in bf16)
and the EAGLE-3 head published for it (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: one layer,
hidden 4096, draft vocabulary 32000). Random weights change no timing, so the step times are
the real model's; acceptance is what the weights cannot give, so it is a parameter:

* t_target(B, T): one target step (forward, logits of every row, greedy pick) for B
  sequences of `--context` tokens with T new tokens each (T = 1 is plain decode, T = k + 1
  verifies a k-step chain), for B in `--batch-sizes` and T in `--tokens`;
* t_draft(B): one draft step of the head for B rows (`fc` over the three target hidden
  states for the first step, then the layer, the draft-vocabulary logits and a greedy pick);
* the speedup at acceptance length tau (tokens per sequence per verify pass, 2..6):
  tau * t_target(B, 1) / (t_draft_first(B) + (k - 1) t_draft(B) + t_target(B, k + 1)), for
  a k = `--draft-steps` chain, and the break-even tau per batch size: speculation pays where
  the acceptance length exceeds it. The largest batch that still pays at a given tau is what
  `--spec-disable-batch-threshold` should be on this device for traffic with that
  acceptance.

On CUDA every step is captured once as a CUDA graph and replayed (as the engine replays
decode and verification), timed with CUDA events; the batch-1 plain step is also timed
eagerly, and 1 - graph/eager is the host-overhead share of an eager batch-1 step. On the
CPU it runs eagerly, and `--shapes reduced` (the default there) shrinks the model so that a
test can check the table and JSON in seconds; CPU timings mean nothing for the GPU.

    python -m tools.bench_shapes --device cuda --out bench_out/bench_shapes.json
    python -m tools.bench_shapes --device cpu --shapes reduced --out /tmp/shapes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import dense_linear
from specd.workers.models.quantization import linear_factory_for
from specd.workers.models.registry import build_meta_model
from specd.workers.runner.attention import AttentionMetadata, build_attention_metadata
from specd.workers.spec.draft_config import DraftConfig, resolve_aux_layer_ids
from specd.workers.spec.draft_model import DraftHead

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_theta": 500000.0}
INT4_W4A16 = {  # compressed-tensors pack-quantized, as the published w4a16 Llama checkpoints
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                  "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                              "strategy": "group", "group_size": 128,
                                              "dynamic": False, "actorder": None}}}}
SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B(-Instruct) config.json, INT4 as above
    "llama-3.1-8b": {
        "target": {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 128256, "max_position_embeddings": 131072,
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE,
                   "tie_word_embeddings": False, "hidden_act": "silu",
                   "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                   "quantization_config": INT4_W4A16},
        # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B config.json
        "draft": {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 1,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                  "vocab_size": 128256, "draft_vocab_size": 32000,
                  "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                  "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE, "hidden_act": "silu"},
    },
    # The same structure, small enough for a CPU test (timings meaningless).
    "reduced": {
        "target": {"architectures": ["LlamaForCausalLM"], "hidden_size": 256,
                   "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
                   "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                   "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE,
                   "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 0,
                   "quantization_config": INT4_W4A16},
        # vLLM's name: its ids are hidden-state indices as given (0 = the embedding output).
        "draft": {"architectures": ["Eagle3LlamaForCausalLM"], "hidden_size": 256,
                  "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
                  "draft_vocab_size": 256, "max_position_embeddings": 4096,
                  "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE,
                  "hidden_act": "silu", "eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    },
}
ACCEPTANCE_LENGTHS = (2.0, 3.0, 4.0, 5.0, 6.0)
BLOCK_SIZE = 16


class Timer:
    """Median milliseconds of a callable: CUDA graph replay timed with events on CUDA (eager
    if `graphs` is off or capture fails), wall clock on the CPU."""

    def __init__(self, device: torch.device, warmup: int, reps: int, graphs: bool) -> None:
        self.device, self.warmup, self.reps, self.graphs = device, warmup, reps, graphs
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def __call__(self, fn: Callable[[], Any], graph: bool | None = None) -> tuple[float, str]:
        use_graph = self.graphs if graph is None else graph
        if self.device.type != "cuda":
            for _ in range(self.warmup):
                fn()
            samples = []
            for _ in range(self.reps):
                began = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - began) * 1e3)
            return statistics.median(samples), "eager"
        run, mode = fn, "eager"
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (Triton compiles) off the default stream
            for _ in range(max(self.warmup, 1)):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        if use_graph:
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    fn()
                run, mode = g.replay, "graph"
            except RuntimeError as exc:  # a shape that cannot be captured: time it eagerly
                print(f"bench_shapes: graph capture failed ({exc}); timing eagerly",
                      file=sys.stderr)
        torch.cuda.synchronize()
        samples = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        return statistics.median(samples), mode


def _to_dtype(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters to `dtype` (strides kept); int32 words and buffers (the rope
    frequencies) stay."""
    for p in module.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)


def _randomize(module: torch.nn.Module) -> None:
    """Random weights of the right dtypes in place: packed INT4 words, small positive scales,
    unit norms, N(0, 0.02) elsewhere."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dtype == torch.int32:
                p.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen,
                                      dtype=torch.int32).to(p.device))
            elif name.endswith("weight_shape"):
                continue
            elif name.endswith("weight_scale"):
                p.fill_(0.004)
            elif "norm" in name:
                p.fill_(1.0)
            elif p.is_floating_point():
                p.normal_(0.0, 0.02)


def build_target(raw: dict[str, Any], device: torch.device, dtype: torch.dtype
                 ) -> tuple[Any, ModelConfig]:
    cfg = ModelConfig.from_dict(raw, Path("bench_shapes"))
    factory = linear_factory_for(cfg.quantization_config, dense_linear)
    model = build_meta_model(cfg, device, factory)
    model.to_empty(device=device)
    _to_dtype(model, dtype)
    _randomize(model)
    return model.eval(), cfg


def build_draft(raw: dict[str, Any], device: torch.device, dtype: torch.dtype) -> DraftHead:
    with torch.device(device):
        head = DraftHead(DraftConfig.from_dict(raw), device)
    _to_dtype(head, dtype)
    _randomize(head)
    head.d2t.zero_()
    return head.eval()


def _metadata(batch: int, tokens: int, context: int, device: torch.device
              ) -> AttentionMetadata:
    """B sequences of `context` cached tokens plus `tokens` new ones, causal, each in its own
    blocks (blocks of sequence b follow those of b - 1)."""
    seq_len = context + tokens
    per_seq = -(-seq_len // BLOCK_SIZE)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    return build_attention_metadata([tokens] * batch, [seq_len] * batch, tables, BLOCK_SIZE,
                                    device)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        shapes = SHAPES[args.shapes]
        target_raw = json.loads(json.dumps(shapes["target"]))
        target_raw["quantization_config"]["config_groups"]["group_0"]["weights"][
            "group_size"] = args.group_size
        self.target, self.cfg = build_target(target_raw, self.device, self.dtype)
        self.draft = build_draft(shapes["draft"], self.device, self.dtype)
        self.aux_ids = resolve_aux_layer_ids(self.draft.config, self.cfg.num_layers)
        max_tokens = max(args.tokens)
        per_seq = -(-(args.context + max_tokens) // BLOCK_SIZE)
        num_blocks = max(args.batch_sizes) * per_seq
        self.kv = [torch.zeros(self.cfg.kv_layer_shape(num_blocks, BLOCK_SIZE),
                               dtype=self.dtype, device=self.device)
                   for _ in range(self.cfg.num_layers)]
        dcfg = self.draft.config
        self.draft_kv = torch.zeros(2, num_blocks, BLOCK_SIZE, dcfg.num_key_value_heads,
                                    dcfg.head_dim, dtype=self.dtype, device=self.device)
        self.timer = Timer(self.device, args.warmup, args.reps, graphs=args.graphs)

    def target_step(self, batch: int, tokens: int) -> Callable[[], Any]:
        meta = _metadata(batch, tokens, self.args.context, self.device)
        n = batch * tokens
        ids = torch.randint(0, self.cfg.vocab_size, (n,), device=self.device)
        positions = (self.args.context + torch.arange(tokens, device=self.device)).repeat(batch)

        def step() -> Any:
            with torch.no_grad():
                hidden, aux = self.target(ids, positions, self.kv, meta, self.aux_ids)
                return self.target.compute_logits(hidden).argmax(-1), aux

        return step

    def draft_step(self, batch: int, first: bool) -> Callable[[], Any]:
        meta = _metadata(batch, 1, self.args.context, self.device)
        h = self.draft.config.hidden_size
        ids = torch.randint(0, self.cfg.vocab_size, (batch,), device=self.device)
        positions = torch.full((batch,), self.args.context, device=self.device)
        aux = torch.randn(batch, 3 * self.draft.config.target_hidden_size, device=self.device,
                          dtype=self.dtype)
        prev = torch.randn(batch, h, device=self.device, dtype=self.dtype)

        def step() -> Any:
            with torch.no_grad():
                hidden = self.draft.fuse(aux) if first else prev
                out = self.draft(ids, positions, hidden, self.draft_kv, meta)
                return self.draft.to_target_ids(self.draft.logits(out).argmax(-1))

        return step


def speedups(t_plain: float, t_verify: float, t_first: float, t_draft: float, steps: int
             ) -> dict[str, Any]:
    """Speedup of a `steps`-chain over plain decode at each acceptance length, and the
    break-even acceptance length (speculation pays above it)."""
    t_spec = t_first + (steps - 1) * t_draft + t_verify
    return {"t_spec_ms": t_spec,
            "speedup": {f"{tau:g}": tau * t_plain / t_spec for tau in ACCEPTANCE_LENGTHS
                        if tau <= steps + 1},
            "break_even_acceptance": t_spec / t_plain}


def thresholds(rows: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per acceptance length: the largest batch size up to which every measured batch size
    pays (speedup >= 1); None if batch 1 already does not."""
    out: dict[str, int | None] = {}
    for tau in ACCEPTANCE_LENGTHS:
        key, best = f"{tau:g}", None
        for row in sorted(rows, key=lambda r: r["batch"]):
            value = row["speedup"].get(key)
            if value is None or value < 1.0:
                break
            best = row["batch"]
        out[key] = best
    return out


def format_table(rows: list[dict[str, Any]], steps: int) -> str:
    taus = [f"{t:g}" for t in ACCEPTANCE_LENGTHS if t <= steps + 1]
    head = (f"{'batch':>5} {'plain ms':>9} {f'verify{steps + 1} ms':>10} {'draft ms':>9} "
            f"{'spec ms':>8} " + " ".join(f"{'tau ' + t:>6}" for t in taus)
            + f" {'break-even tau':>15}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['batch']:>5} {r['t_plain_ms']:>9.3f} {r['t_verify_ms']:>10.3f} "
                     f"{r['t_draft_ms']:>9.3f} {r['t_spec_ms']:>8.3f} "
                     + " ".join(f"{r['speedup'][t]:>6.2f}" for t in taus)
                     + f" {r['break_even_acceptance']:>15.2f}")
    return "\n".join(lines)


def target_ms(bench: Bench, result: dict[str, Any], batch: int, tokens: int) -> float:
    """Time one target step shape and record it in result["target_ms"]."""
    ms, mode = bench.timer(bench.target_step(batch, tokens))
    result["target_ms"].append({"batch": batch, "tokens": tokens, "ms": ms, "mode": mode})
    return ms


def format_steps(points: list[dict[str, Any]], batches: list[int], tokens: list[int]) -> str:
    by = {(p["batch"], p["tokens"]): p["ms"] for p in points}
    lines = [f"{'batch':>5} " + " ".join(f"{t:>8}" for t in tokens)]
    for b in batches:
        lines.append(f"{b:>5} " + " ".join(
            f"{by[(b, t)]:>8.3f}" if (b, t) in by else f"{'-':>8}" for t in tokens))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=default_device, help="cuda[:N] or cpu")
    p.add_argument("--shapes", choices=sorted(SHAPES), default=None,
                   help="model shapes (default: llama-3.1-8b on CUDA, reduced on the CPU)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128],
                   help="INT4 group size of the target's linear layers")
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated (default 1,2,4,8,16,32,64; reduced: 1,2)")
    p.add_argument("--tokens", default=None,
                   help="new tokens per sequence per target step, comma-separated (default "
                        "1,2,4,6,8,16,32,64; reduced: 1,2,4); 1 and draft-steps + 1 are "
                        "always measured")
    p.add_argument("--context", type=int, default=None,
                   help="cached tokens per sequence (default 1024; reduced: 32)")
    p.add_argument("--draft-steps", type=int, default=5,
                   help="chain length k of the speedup model (verifies k + 1 tokens)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=None, help="timed runs (default 10; CPU: 3)")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="time CUDA graph replays (CUDA only)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--out", type=Path, default=Path("bench_out/bench_shapes.json"))
    args = p.parse_args(argv)
    reduced = (args.shapes or ("reduced" if args.device == "cpu" else "llama-3.1-8b")) == \
        "reduced"
    args.shapes = "reduced" if reduced else (args.shapes or "llama-3.1-8b")
    args.batch_sizes = sorted({int(b) for b in (args.batch_sizes or (
        "1,2" if reduced else "1,2,4,8,16,32,64")).split(",")})
    tokens = {int(t) for t in (args.tokens or ("1,2,4" if reduced
                                               else "1,2,4,6,8,16,32,64")).split(",")}
    if args.draft_steps < 1 or args.draft_steps + 1 > 64:
        p.error(f"--draft-steps must be in 1..63, got {args.draft_steps}")
    args.tokens = sorted(tokens | {1, args.draft_steps + 1})
    if args.context is None:
        args.context = 32 if reduced else 1024
    if args.reps is None:
        args.reps = 3 if args.device == "cpu" else 10
    if min(args.batch_sizes) < 1 or min(args.tokens) < 1 or max(args.tokens) > 64:
        p.error("batch sizes must be >= 1 and tokens per sequence in 1..64")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    bench = Bench(args)
    result: dict[str, Any] = {
        "shapes": args.shapes, "device": args.device,
        "device_name": (torch.cuda.get_device_name(torch.device(args.device))
                        if args.device.startswith("cuda")
                        else platform.processor() or platform.machine()),
        "torch": torch.__version__, "args": {k: (str(v) if isinstance(v, Path) else v)
                                             for k, v in vars(args).items()},
        "model": {"hidden_size": bench.cfg.hidden_size, "layers": bench.cfg.num_layers,
                  "vocab_size": bench.cfg.vocab_size, "group_size": args.group_size,
                  "draft_vocab_size": bench.draft.config.draft_vocab_size,
                  "aux_layer_ids": list(bench.aux_ids)},
        "build_s": time.perf_counter() - started, "target_ms": [], "draft_ms": [], "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    k = args.draft_steps
    if bench.device.type == "cuda":  # host overhead of an eager batch-1 plain step
        eager, _ = bench.timer(bench.target_step(1, 1), graph=False)
        graph, mode = bench.timer(bench.target_step(1, 1))
        result["batch1_plain"] = {"eager_ms": eager, "replay_ms": graph, "replay_mode": mode,
                                  "host_overhead_share": max(0.0, 1.0 - graph / eager)}
        print(f"batch-1 plain step: eager {eager:.3f} ms, {mode} {graph:.3f} ms, host "
              f"overhead {result['batch1_plain']['host_overhead_share']:.0%} of the eager "
              "step", flush=True)
    # First what the speedup model needs (plain, verify k + 1, draft) at every batch size,
    # so that a run cut short still has the whole table; then the other token counts.
    for batch in args.batch_sizes:
        times = {t: target_ms(bench, result, batch, t) for t in (1, k + 1)}
        first, mode = bench.timer(bench.draft_step(batch, first=True))
        later, _ = bench.timer(bench.draft_step(batch, first=False))
        result["draft_ms"].append({"batch": batch, "first_ms": first, "later_ms": later,
                                   "mode": mode})
        result["rows"].append({"batch": batch, "t_plain_ms": times[1],
                               "t_verify_ms": times[k + 1], "t_draft_first_ms": first,
                               "t_draft_ms": later,
                               **speedups(times[1], times[k + 1], first, later, k)})
        result["thresholds"] = thresholds(result["rows"])
        result["elapsed_s"] = time.perf_counter() - started
        _save(args.out, result)  # after every batch size: a run cut short keeps its rows
        print(f"batch {batch}: plain {times[1]:.3f} ms, verify{k + 1} {times[k + 1]:.3f} ms, "
              f"draft {first:.3f}/{later:.3f} ms ({mode})", flush=True)
    print(f"\n{args.shapes} on {result['device_name']}, context {args.context}, "
          f"{k}-step chain (speedup over plain decode at acceptance length tau):")
    print(format_table(result["rows"], k))
    for tau, batch in result["thresholds"].items():
        verdict = (f"pays up to batch {batch}" if batch is not None
                   else "does not pay even at batch 1")
        print(f"acceptance length {tau}: speculation {verdict}", flush=True)
    others = [t for t in args.tokens if t not in (1, k + 1)]
    for batch in args.batch_sizes:
        for tokens in others:
            target_ms(bench, result, batch, tokens)
        result["elapsed_s"] = time.perf_counter() - started
        _save(args.out, result)
    if others:
        print("\ntarget step ms by tokens per sequence (columns) and batch size (rows):")
        print(format_steps(result["target_ms"], args.batch_sizes, args.tokens))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _save(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
