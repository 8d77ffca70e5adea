"""Speculative decoding benchmark (CPU or GPU, greedy, held-out prompts): the fixture model by
default, any model with `--model` (a name or a directory; its own head, or `--draft-model`).

1. Acceptance length (accepted drafts + 1 per verify pass) for chains of 3 and 5 steps and
   a tree, with acceptance per draft position.
2. Batch 1, speculation on vs off: tokens/s, and the bound the measured costs allow,
   acceptance x t_step / (steps x t_draft + t_verify), where t_step is a plain decode step,
   t_draft one draft level (catch-up included) and t_verify one verify step.
3. Throughput (output tokens/s) at 1, 4, 16, 64 concurrent requests for off, on and auto.

Prompts: `--workload code` (default), the fixture's held-out code prompts continued for
exactly `--max-tokens` tokens; `--workload chat`, the held-out chat questions of
tools/chat_prompts.py in the model's chat template, answered up to `--max-tokens` tokens or
the end of the turn. An empty `--concurrency` skips section 3.

Prints a table and writes bench_out/bench_spec.json (rewritten after each section, so a run
cut short keeps what it measured). Run: python -m tools.bench_spec [--device cuda]
(default: cuda when available, else cpu).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from specd.ipc.sampling import SamplingParams
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR, EngineConfig
from specd.workers.engine.core import EngineCore
from tools.chat_answers import chat_prompt_ids, resolve_model_dir
from tools.chat_prompts import questions
from tools.workload import load_prompts

# EngineConfig keyword arguments per draft shape (Any: they are passed as **options)
SHAPES: dict[str, dict[str, Any]] = {
    "chain3": {"spec_topk": 1, "spec_num_steps": 3},
    "chain5": {"spec_topk": 1, "spec_num_steps": 5},
    "tree": {"spec_topk": 4, "spec_num_steps": 5, "spec_num_draft_tokens": 10},
}


def run(core: EngineCore, prompts: list[list[int]], max_tokens: int,
        concurrency: int, ignore_eos: bool = True) -> tuple[int, float]:
    """Serve prompts with at most `concurrency` running; (output tokens, seconds)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    queue = list(enumerate(prompts))
    running = 0
    total = 0
    t0 = time.perf_counter()
    while queue or core.has_unfinished():
        while queue and running < concurrency:
            i, ids = queue.pop(0)
            core.add_request(f"b{i}-{time.monotonic_ns()}", ids, params)
            running += 1
        for d in core.step():
            total += len(d.new_token_ids)
            running -= d.finish_reason is not None
    return total, time.perf_counter() - t0


def plain_step_time(prompt: list[int], max_tokens: int, device: str = "cpu",
                    **options: Any) -> float:
    """Seconds per plain decode step at batch 1 (prefill excluded)."""
    core = EngineCore(EngineConfig(device=device, speculative_algorithm=None, **options))
    core.add_request("p", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    core.step()  # prefill
    t0 = time.perf_counter()
    n = 0
    while core.has_unfinished():
        core.step()
        n += 1
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda[:N]")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--throughput-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 64])
    p.add_argument("--model", default=None, help="a model's name or directory (default: fixture)")
    p.add_argument("--draft-model", default=None, help="its EAGLE-3 head (default: its own)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workload", choices=("code", "chat"), default="code")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="batch-1 runs; the best counts")
    p.add_argument("--out", default="bench_out/bench_spec.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model: dict[str, Any] = {"model": args.model, "draft_model": args.draft_model,
                             "dtype": args.dtype}
    model_dir = resolve_model_dir(args.model or "fixture")  # a GGUF-imported model: imported once
    prompts = workload_prompts(args.workload, model_dir, args.num_prompts)
    ignore_eos = args.workload == "code"
    result: dict[str, Any] = {"device": args.device, "model": args.model or "fixture",
                              "workload": args.workload, "dtype": args.dtype, "acceptance": {},
                              "batch1": {}, "throughput": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dev = args.device

    print("== acceptance (greedy, held-out prompts)")
    for name, shape in SHAPES.items():
        core = EngineCore(EngineConfig(device=dev, spec_mode="on", **shape, **model))
        run(core, prompts, args.max_tokens, len(prompts), ignore_eos)
        s = core.stats()
        per_pos = [a / s.num_verify_passes for a in s.accepted_at_depth]
        result["acceptance"][name] = {"acceptance_length": s.acceptance_length,
                                      "accepted_rate_by_position": per_pos}
        print(f"{name:7s} acceptance length {s.acceptance_length:.2f}  by position "
              + " ".join(f"{r:.2f}" for r in per_pos))
        _save(out, result)

    print("== batch 1: on vs off")
    t_step = min(plain_step_time(prompts[0], args.max_tokens, dev, **model)
                 for _ in range(args.repeats))
    for name in ("chain3", "chain5", "tree"):
        # Best of --repeats alternating runs: the machine is shared, noise only slows.
        tok_off, s_off, tok_on, s_on = 0, float("inf"), 0, float("inf")
        for _ in range(args.repeats):
            off = EngineCore(EngineConfig(device=dev, spec_mode="off", **model))
            n, secs = run(off, prompts[:4], args.max_tokens, 1, ignore_eos)
            if secs < s_off:
                tok_off, s_off = n, secs
            on_run = EngineCore(EngineConfig(device=dev, spec_mode="on", **SHAPES[name],
                                             **model))
            n, secs = run(on_run, prompts[:4], args.max_tokens, 1, ignore_eos)
            if secs < s_on:
                tok_on, s_on, on = n, secs, on_run
        st = on.stats()
        steps = on.spec.num_steps if on.spec is not None else 1
        t_draft = (st.draft_s + st.catch_up_s) / (st.num_verify_passes * steps)
        t_verify = st.verify_s / st.num_verify_passes
        bound = st.acceptance_length * t_step / (steps * t_draft + t_verify)
        speedup = (tok_on / s_on) / (tok_off / s_off)
        result["batch1"][name] = {
            "tok_s_off": tok_off / s_off, "tok_s_on": tok_on / s_on, "speedup": speedup,
            "bound": bound, "t_step_ms": t_step * 1e3, "t_draft_ms": t_draft * 1e3,
            "t_verify_ms": t_verify * 1e3, "acceptance_length": st.acceptance_length}
        print(f"{name:7s} off {tok_off / s_off:6.1f} tok/s  on {tok_on / s_on:6.1f} tok/s  "
              f"speedup {speedup:.2f}x  bound {bound:.2f}x  (t_step {t_step * 1e3:.2f} ms, "
              f"t_draft {t_draft * 1e3:.2f} ms x {steps}, t_verify {t_verify * 1e3:.2f} ms, "
              f"acceptance {st.acceptance_length:.2f})")
        _save(out, result)

    print("== throughput (output tok/s), chain5")
    print(f"{'conc':>5s} {'off':>8s} {'on':>8s} {'auto':>8s}")
    for conc in args.concurrency:
        row = {}
        work = [prompts[i % len(prompts)] for i in range(max(conc, 4))]
        for mode in ("off", "on", "auto"):
            core = EngineCore(EngineConfig(device=dev, spec_mode=mode,
                                           max_num_seqs=max(conc, 1), **SHAPES["chain5"],
                                           **model))
            core.warmup()  # first-call costs (allocations, oneDNN set-up) out of the timing
            n, secs = run(core, work, args.throughput_tokens, conc, ignore_eos)
            row[mode] = n / secs
        result["throughput"][str(conc)] = row
        print(f"{conc:5d} {row['off']:8.1f} {row['on']:8.1f} {row['auto']:8.1f}")
        _save(out, result)

    print(f"wrote {out}")


def workload_prompts(workload: str, model_dir: Path, num: int) -> list[list[int]]:
    """`num` held-out prompts as token ids: the fixture's code prompts, or chat questions
    (tools/chat_prompts.py's held-out split, evenly spaced over it) in the model's template."""
    if workload == "code":
        tok = Tokenizer.from_dir(FIXTURE_DIR)
        return [tok.encode(t) for t in load_prompts(num)]
    rows = questions("heldout")
    picked = [rows[i * len(rows) // num]["question"] for i in range(min(num, len(rows)))]
    return chat_prompt_ids(model_dir, picked)


def _save(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
