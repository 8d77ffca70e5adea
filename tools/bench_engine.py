"""Engine benchmark: specd's in-process engine against transformers' `generate()`.

Greedy decoding of held-out prompts on the fixture model (or `--model`): tokens/s at batch 1,
throughput at 1, 8, 32, 64 concurrent requests, and transformers' `generate()` on the same
prompts at batch 1. The batch-1 figures of both systems are medians over `--rounds`
alternating rounds (this class of machine drifts by tens of percent within minutes). Prints
a table and writes JSON.

    python -m tools.bench_engine --out bench_out/bench_engine.json [--device cuda]

`--device` runs both systems there (default: cuda when available, else cpu). The JSON is
written after the batch-1 rounds and after each concurrency, so a run cut short keeps what
it measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import specd
from specd.workers.config import FIXTURE_DIR
from tools.workload import load_prompts


def bench_specd(engine: specd.Engine, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """All prompts submitted at once; output tokens per second of wall time."""
    params = specd.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"concurrency": len(prompts), "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall}


class TransformersBaseline:
    """transformers' generate() at batch 1, one prompt after another, greedy, in `dtype`
    ("auto" = the checkpoint's, transformers' own default). Loaded once, run per round."""

    def __init__(self, model_dir: Path, dtype: str, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        hf_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=hf_dtype).eval()
        torch.nn.Module.to(self.model, self.device)

    def run(self, prompts: list[str], max_tokens: int) -> dict[str, Any]:
        tokens = 0
        t0 = time.perf_counter()
        for prompt in prompts:
            ids = self.tok(prompt, return_tensors="pt").input_ids.to(self.device)
            with torch.no_grad():
                out = self.model.generate(ids, max_new_tokens=max_tokens,
                                          min_new_tokens=max_tokens, do_sample=False,
                                          pad_token_id=self.tok.eos_token_id)
            tokens += out.shape[1] - ids.shape[1]
        wall = time.perf_counter() - t0
        return {"concurrency": 1, "output_tokens": tokens, "wall_s": wall,
                "tokens_per_s": tokens / wall}


def bench_batch1(engine: specd.Engine, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """specd at batch 1: the prompts one after another."""
    single = [bench_specd(engine, [pr], max_tokens) for pr in prompts]
    tokens = sum(r["output_tokens"] for r in single)
    wall = sum(r["wall_s"] for r in single)
    return {"concurrency": 1, "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the fixture)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda[:N], for both systems")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--batch1-prompts", type=int, default=4)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 avoids stalls when other work shares the cores)")
    p.add_argument("--dtype", default="auto",
                   help="both systems' dtype: auto (each system's default) or a torch dtype")
    p.add_argument("--cpu-compile", action="store_true",
                   help="specd compiles plain decode (torch.compile; the warm-up compiles)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating batch-1 rounds of specd and transformers; each system's "
                        "figure is its median over the rounds")
    p.add_argument("--out", default="bench_out/bench_engine.json")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    torch.set_num_threads(args.threads)

    engine = specd.Engine(args.model, spec_mode="off", dtype=args.dtype, device=args.device,
                          cpu_compile=args.cpu_compile)
    engine.core.warmup()
    batch1_prompts = load_prompts(args.batch1_prompts)
    hf_model = TransformersBaseline(Path(args.model) if args.model else FIXTURE_DIR, args.dtype,
                                    args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial: dict[str, Any] = {"device": args.device, "args": vars(args), "partial": True}
    # Batch 1 of both systems in alternating rounds, each figure the median over rounds:
    # this VM's speed drifts by tens of percent within minutes, and alternating exposes
    # both systems to the same drift instead of giving one a quiet minute.
    rounds = []
    for i in range(args.rounds):
        ours = bench_batch1(engine, batch1_prompts, args.max_tokens)
        theirs = hf_model.run(batch1_prompts, args.max_tokens)
        rounds.append({"round": i + 1, "specd_tokens_per_s": ours["tokens_per_s"],
                       "transformers_tokens_per_s": theirs["tokens_per_s"],
                       "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"]})
        print(f"round {i + 1}/{args.rounds}: specd {ours['tokens_per_s']:.1f} tok/s, "
              f"transformers {theirs['tokens_per_s']:.1f} tok/s "
              f"({rounds[-1]['ratio']:.2f}x)", flush=True)
        _save(out, {**partial, "batch1_rounds": rounds})
    b1 = statistics.median(r["specd_tokens_per_s"] for r in rounds)
    hf_b1 = statistics.median(r["transformers_tokens_per_s"] for r in rounds)
    rows: list[dict[str, Any]] = [
        {"system": "specd", "mode": "batch 1 (sequential)", "concurrency": 1,
         "output_tokens": ours["output_tokens"], "tokens_per_s": b1}]
    for n in (int(x) for x in args.concurrency.split(",")):
        r = bench_specd(engine, load_prompts(n), args.max_tokens)
        rows.append({"system": "specd", "mode": f"{n} concurrent", **r})
        _save(out, {**partial, "batch1_rounds": rounds, "rows": rows})
    rows.append({"system": "transformers generate()", "mode": "batch 1 (sequential)",
                 "concurrency": 1, "output_tokens": theirs["output_tokens"],
                 "tokens_per_s": hf_b1})

    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    top = next(r for r in rows if r["mode"] == f"{args.concurrency.split(',')[-1]} concurrent")
    summary = {
        "specd_batch1_vs_transformers": b1 / hf_b1,
        "specd_batch1_vs_transformers_by_round": [round(r["ratio"], 3) for r in rounds],
        "throughput_at_max_concurrency_vs_batch1": top["tokens_per_s"] / b1,
        "peak_rss_mib": peak_rss_mib,
    }
    print(f"{'system':<26}{'mode':<24}{'tokens':>8}{'tok/s':>10}")
    for r in rows:
        print(f"{r['system']:<26}{r['mode']:<24}{r['output_tokens']:>8}"
              f"{r['tokens_per_s']:>10.1f}")
    for k, v in summary.items():
        print(f"{k}: {v}" if isinstance(v, list) else f"{k}: {v:.2f}")
    print(f"specd dtype: {engine.core.resolved.dtype}; graphs/compile: "
          f"{engine.core.resolved.graphs}")
    result = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "torch_threads": torch.get_num_threads(),
                          "device": (torch.cuda.get_device_name(torch.device(args.device))
                                     if args.device.startswith("cuda") else "cpu")},
              "specd_dtype": engine.core.resolved.dtype,
              "specd_graphs": engine.core.resolved.graphs,
              "args": vars(args), "rows": rows, "batch1_rounds": rounds, "summary": summary}
    _save(out, result)
    print(f"wrote {args.out}")


def _save(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
