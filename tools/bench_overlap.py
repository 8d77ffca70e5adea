"""Overlap and CUDA-graph benchmark: decode step time and tokens/s at batch 1, 8
and 32, plain decode and speculation (5-step chain), with overlap scheduling and CUDA
graphs each off and on, and the share of the step the host is busy (not blocked waiting
for the device's results).

    python -m tools.bench_overlap --device cuda --out bench_out/bench_overlap.json

On the CPU the "device" is the host: overlap cannot hide anything, the host is busy for
the whole step, and graphs run as a synchronous stand-in (slower: it re-plans attention
from the static buffers); the run still checks that every pipeline produces the first
one's tokens. With overlap on, speculative steps overlap too (accepted counts and drafts
stay on the device: docs/overlap.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from specd.ipc.sampling import SamplingParams
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR, EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.runner.graph_backend import GraphBackend
from specd.workers.runner.host_copy import HostCopy
from tools.workload import load_prompts

MODES: dict[str, dict[str, Any]] = {"plain": {"speculative_algorithm": None},
                                   "spec chain5": {"spec_mode": "on", "spec_topk": 1,
                                                   "spec_num_steps": 5}}


# (overlap scheduling, CUDA graphs); the first is the reference for "same tokens".
PIPELINES = ((False, False), (True, False), (False, True), (True, True))


def measure(options: dict[str, Any], overlap: bool, graphs: bool, batch: int,
            prompts: list[list[int]], max_tokens: int, device: str,
            dtype: str) -> dict[str, Any]:
    """Decode phase only: timing starts once every request has its first token."""
    core = EngineCore(EngineConfig(device=device, dtype=dtype, overlap_schedule=overlap,
                                   cuda_graphs=graphs, max_num_seqs=max(batch, 1),
                                   **options))
    core.warmup()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i in range(batch):
        core.add_request(f"r{i}", prompts[i % len(prompts)], params)
        tokens[f"r{i}"] = []

    def step() -> int:
        emitted = 0
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
            emitted += len(delta.new_token_ids)
        return emitted

    while core.has_unfinished() and not all(tokens.values()):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    waited, started, steps, emitted = HostCopy.total_wait_s, time.perf_counter(), 0, 0
    while core.has_unfinished():
        emitted += step()
        steps += 1
    wall = time.perf_counter() - started
    wait = HostCopy.total_wait_s - waited
    backend = core.runner.backend
    replays = backend.graphs.num_replays if isinstance(backend, GraphBackend) else 0
    return {"batch": batch, "overlap": overlap, "graphs": graphs,
            "graphs_status": core.resolved.graphs, "graph_replays": replays,
            "steps": steps, "tokens": emitted,
            "wall_s": wall, "step_ms": 1e3 * wall / max(steps, 1),
            "tokens_per_s": emitted / wall if wall > 0 else 0.0,
            "host_busy_share": 1.0 - wait / wall if wall > 0 else 1.0,
            "output": [tokens[k] for k in sorted(tokens)]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--pipelines", default="off/off,on/off,off/on,on/on",
                   help="overlap/graphs pairs to run; the first is the token reference")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench_out/bench_overlap.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_dir(FIXTURE_DIR)
    prompts = [tok.encode(t) for t in load_prompts(32)]
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": {"platform": platform.platform(), "device": args.device,
                          "torch_threads": torch.get_num_threads()},
              "args": vars(args), "rows": rows}
    pipelines = [tuple(part == "on" for part in pair.split("/"))
                 for pair in args.pipelines.split(",")]
    print(f"{'mode':<12}{'batch':>6}{'overlap':>8}{'graphs':>7}{'step ms':>9}{'tok/s':>9}"
          f"{'host busy':>10}{'same tokens':>12}")
    for name, options in MODES.items():
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            reference: list[list[int]] | None = None
            for overlap, graphs in pipelines:
                r = measure(options, overlap, graphs, batch, prompts, args.max_tokens,
                            args.device, args.dtype)
                reference = r["output"] if reference is None else reference
                r.update(mode=name, same_tokens=r["output"] == reference)
                print(f"{name:<12}{batch:>6}{'on' if overlap else 'off':>8}"
                      f"{'on' if graphs else 'off':>7}{r['step_ms']:>9.2f}"
                      f"{r['tokens_per_s']:>9.1f}{r['host_busy_share']:>10.2f}"
                      f"{str(r['same_tokens']):>12}")
                rows.append({k: v for k, v in r.items() if k != "output"})
                out.write_text(json.dumps(result, indent=2) + "\n")  # a cut run keeps rows
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
