"""Tensor parallelism on this machine: start-up time and greedy decode throughput of an
embedded fixture at tensor-parallel sizes 1 and 2 (workers/parallel/).

    python -m tools.bench_tensor_parallel [--model fixture|fixture-moe] [--tokens 32]
        [--batch 4] [--expert-parallel] [--json out.json]

Each size builds an `EngineCore` (float32, speculation off), times the build, then runs
`--batch` held-out prompts to `--tokens` new tokens each and reports output tokens per
second of the generation alone. On a CPU the ranks share its cores, so size 2 measures the
cost of the split (collectives, one process more), not a speed-up; on GPUs each rank has
its own device.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from tests.integration.heldout import heldout_prompt_ids


def measure(model: str, size: int, tokens: int, batch: int, expert_parallel: bool
            ) -> dict[str, Any]:
    t0 = time.perf_counter()
    core = EngineCore(EngineConfig(model=model, dtype="float32", speculative_algorithm=None,
                                   tensor_parallel_size=size,
                                   expert_parallel=expert_parallel and size > 1))
    build_s = time.perf_counter() - t0
    try:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        for i, ids in enumerate(heldout_prompt_ids(batch, 12, 5)):
            core.add_request(f"r{i}", ids, params)
        t1 = time.perf_counter()
        generated = 0
        while core.has_unfinished():
            generated += sum(len(d.new_token_ids) for d in core.step())
        gen_s = time.perf_counter() - t1
    finally:
        core.close()
    return {"model": model, "tensor_parallel_size": size,
            "expert_parallel": expert_parallel and size > 1, "build_s": round(build_s, 2),
            "generated_tokens": generated, "generate_s": round(gen_s, 3),
            "tokens_per_s": round(generated / gen_s, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fixture", choices=("fixture", "fixture-moe"))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(args.model, size, args.tokens, args.batch, args.expert_parallel)
            for size in (1, 2)]
    print(f"{'size':>4} {'build s':>8} {'tokens':>7} {'tok/s':>7}")
    for row in rows:
        print(f"{row['tensor_parallel_size']:>4} {row['build_s']:>8} "
              f"{row['generated_tokens']:>7} {row['tokens_per_s']:>7}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
