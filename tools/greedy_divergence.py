"""How far greedy output with speculation on follows greedy output with it off, per dtype.

In float32 the two are token for token the same (tests/integration/test_spec_lossless.py).
In bfloat16 they can part: a verify step computes the root and its drafts in one forward
of several rows, a plain step one row per sequence, and a different GEMM shape rounds
differently in bfloat16 (8 significant bits); where the top two logits are that close, the
argmax flips, and from there the continuations differ. This tool measures how often and how
early: the same held-out prompts (the fixture's, never its training text), greedy,
`ignore_eos`, all prompts submitted at once, spec mode `on` against `off` (`--against
alone`: against plain decoding of one prompt at a time).

Prints one line per dtype (prompts identical to the end, mean and median share of the
output before the first differing token, the earliest divergence) and writes
bench_out/greedy_divergence.json. Run:
    python -m tools.greedy_divergence --dtypes float32 bfloat16 --prompts 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from specd.ipc.sampling import SamplingParams
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR, EngineConfig
from specd.workers.engine.core import EngineCore
from tools.workload import load_prompts


def generate(config: EngineConfig, prompts: list[list[int]], max_tokens: int,
             together: bool = True) -> list[list[int]]:
    """Greedy outputs of all prompts, submitted at once, or one at a time when not
    `together` (warm-up is left out: it does not change greedy tokens)."""
    core = EngineCore(config)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for group in [list(enumerate(prompts))] if together else [[p] for p in enumerate(prompts)]:
        for i, ids in group:
            core.add_request(str(i), ids, params)
        while core.has_unfinished():
            for delta in core.step():
                outputs[delta.request_id] += delta.new_token_ids
    return [outputs[str(i)] for i in range(len(prompts))]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first differing token, None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return i
    return None


def compare(dtype: str, prompts: list[list[int]], max_tokens: int, options: dict[str, Any],
            against: str) -> dict[str, Any]:
    """Speculation on against `against`: "off" (plain decoding, the same batch) or
    "alone" (plain decoding, one prompt at a time: how much batching alone moves it)."""
    on = generate(EngineConfig(dtype=dtype, spec_mode="on", **options), prompts, max_tokens)
    off = generate(EngineConfig(dtype=dtype, spec_mode="off", **options), prompts, max_tokens,
                   together=against == "off")
    firsts = [first_difference(a, b) for a, b in zip(on, off, strict=True)]
    # The share of the output before the first differing token (1.0: identical).
    shares = [1.0 if f is None else f / max_tokens for f in firsts]
    diverged = [f for f in firsts if f is not None]
    return {
        "dtype": dtype, "against": against, "num_prompts": len(prompts), "max_tokens": max_tokens,
        "num_identical": len(prompts) - len(diverged),
        "mean_share_before_divergence": statistics.fmean(shares),
        "median_share_before_divergence": statistics.median(shares),
        "earliest_divergence": min(diverged) if diverged else None,
        "first_divergence_per_prompt": firsts,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=48, help="each prompt cut to this")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--spec-topk", type=int, default=1, help="1: chains; > 1: trees")
    p.add_argument("--against", choices=["off", "alone"], default="off",
                   help="plain decoding of the same batch, or of one prompt at a time")
    p.add_argument("--out", type=Path, default=Path("bench_out/greedy_divergence.json"))
    args = p.parse_args()
    tok = Tokenizer.from_dir(FIXTURE_DIR)
    prompts = [tok.encode(text)[: args.prompt_tokens] for text in load_prompts(args.prompts)]
    options: dict[str, Any] = {"spec_topk": args.spec_topk}
    if args.spec_topk > 1:
        options["spec_num_draft_tokens"] = 10
    results = []
    for dtype in args.dtypes:
        r = compare(dtype, prompts, args.max_tokens, options, args.against)
        results.append(r)
        print(f"{dtype:9s} on vs {args.against}: {r['num_identical']}/{r['num_prompts']} "
              "prompts identical; "
              f"share before the first difference: mean {r['mean_share_before_divergence']:.3f}"
              f", median {r['median_share_before_divergence']:.3f}; earliest at token "
              f"{r['earliest_divergence']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "results": results}, indent=1))


if __name__ == "__main__":
    main()
