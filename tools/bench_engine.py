"""Engine benchmark: specd's in-process engine against transformers' `generate()`.

Greedy decoding of held-out prompts on the fixture model (or `--model`): tokens/s at batch 1,
throughput at 1, 8, 32, 64 concurrent requests, and transformers' `generate()` on the same
prompts at batch 1. Prints a table and writes JSON.

    python tools/bench_engine.py --out bench_out/bench_engine.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import load_prompts  # noqa: E402

import specd  # noqa: E402
from specd.workers.config import FIXTURE_DIR  # noqa: E402


def bench_specd(engine: specd.Engine, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """All prompts submitted at once; output tokens per second of wall time."""
    params = specd.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"concurrency": len(prompts), "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall}


def bench_transformers(model_dir: Path, prompts: list[str], max_tokens: int, dtype: str
                       ) -> dict[str, Any]:
    """transformers' generate() at batch 1, one prompt after another, greedy, in `dtype`
    ("auto" = the checkpoint's, transformers' own default)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=hf_dtype).eval()
    tokens = 0
    t0 = time.perf_counter()
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=tok.eos_token_id)
        tokens += out.shape[1] - ids.shape[1]
    wall = time.perf_counter() - t0
    return {"concurrency": 1, "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the fixture)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--batch1-prompts", type=int, default=4)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 avoids stalls when other work shares the cores)")
    p.add_argument("--dtype", default="auto",
                   help="both systems' dtype: auto (each system's default) or a torch dtype")
    p.add_argument("--cpu-compile", action="store_true",
                   help="specd compiles plain decode (torch.compile; the warm-up compiles)")
    p.add_argument("--out", default="bench_out/bench_engine.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    engine = specd.Engine(args.model, spec_mode="off", dtype=args.dtype,
                          cpu_compile=args.cpu_compile)
    engine.core.warmup()
    batch1_prompts = load_prompts(args.batch1_prompts)
    rows: list[dict[str, Any]] = []
    single = [bench_specd(engine, [pr], args.max_tokens) for pr in batch1_prompts]
    b1_tokens = sum(r["output_tokens"] for r in single)
    b1_wall = sum(r["wall_s"] for r in single)
    rows.append({"system": "specd", "mode": "batch 1 (sequential)", "concurrency": 1,
                 "output_tokens": b1_tokens, "wall_s": b1_wall,
                 "tokens_per_s": b1_tokens / b1_wall})
    for n in (int(x) for x in args.concurrency.split(",")):
        r = bench_specd(engine, load_prompts(n), args.max_tokens)
        rows.append({"system": "specd", "mode": f"{n} concurrent", **r})
    hf = bench_transformers(Path(args.model) if args.model else FIXTURE_DIR, batch1_prompts,
                            args.max_tokens, args.dtype)
    rows.append({"system": "transformers generate()", "mode": "batch 1 (sequential)", **hf})

    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    b1 = rows[0]["tokens_per_s"]
    top = next(r for r in rows if r["mode"] == f"{args.concurrency.split(',')[-1]} concurrent")
    summary = {
        "specd_batch1_vs_transformers": b1 / hf["tokens_per_s"],
        "throughput_at_max_concurrency_vs_batch1": top["tokens_per_s"] / b1,
        "peak_rss_mib": peak_rss_mib,
    }
    print(f"{'system':<26}{'mode':<24}{'tokens':>8}{'wall s':>9}{'tok/s':>10}")
    for r in rows:
        print(f"{r['system']:<26}{r['mode']:<24}{r['output_tokens']:>8}"
              f"{r['wall_s']:>9.2f}{r['tokens_per_s']:>10.1f}")
    for k, v in summary.items():
        print(f"{k}: {v:.2f}")
    print(f"specd dtype: {engine.core.resolved.dtype}; graphs/compile: "
          f"{engine.core.resolved.graphs}")
    result = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "torch_threads": torch.get_num_threads()},
              "specd_dtype": engine.core.resolved.dtype,
              "specd_graphs": engine.core.resolved.graphs,
              "args": vars(args), "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
