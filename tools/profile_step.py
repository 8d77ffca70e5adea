"""Where one engine step goes: a plain decode step, a speculative step (verify, catch-up and
each draft level) at batch 1 and 8, by phase, with the torch ops each phase dispatches.

The engine runs as the daemon runs it (`EngineCore`, the model's own head, greedy, float32 by
default). After warm-up and the prompts' prefill, `--steps` decode steps are run under the
torch profiler; each phase below is a `record_function` range this tool wraps around the
engine's own functions (nothing in specd is changed for it):

    step               EngineCore.step, the whole step (what is left: the engine's bookkeeping)
    schedule / update  the scheduler before and after the model (bookkeeping)
    inputs             prepare_inputs: a plain step's input tensors
    attention metadata build_attention_metadata: slots, block tables, masks
    target forward     ModelRunner.forward and the verifier's forward (embedding, layers, norm)
    layer              one decoder layer (per layer: ops and time)
    logits             compute_logits
    sampling           ModelRunner.sample
    acceptance         Verifier.verify: the tree walk, accepted tokens
    verify inputs      Verifier.shifts: where each tree's rows start
    catch-up           Drafter.catch_up: the head over the accepted rows
    draft tree         Drafter.draft: the draft loop less its levels (top-k, the tree built)
    draft level        one level of the draft loop (the head's draft_level)
    resolve            the host reads the step's results (a device sync on the GPU)
    deltas             EngineCore's per-request outputs

For each phase: milliseconds per step (inclusive, and self: less the phases inside it) and the
torch ops it dispatches per step (ops inside a nested phase count there). Wall time per step
is also measured without the profiler (its per-op overhead inflates the profiled times; the
shares are what to read). Prints a table and writes JSON.

    python -m tools.profile_step --out bench_out/profile_step.json [--model fixture]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEvent

from specd.ipc.messages import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from tools.workload import load_prompts

PHASE_PREFIX = "specd:"
ORDER = ("step", "schedule", "inputs", "attention metadata", "target forward", "layer",
         "logits", "sampling", "verify inputs", "acceptance", "catch-up", "draft tree",
         "draft level", "resolve", "deltas",
         "update")


def _wrapped(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(PHASE_PREFIX + label):
            return fn(*args, **kwargs)
    return inner


def _targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, phase) of every function the profile wraps."""
    from specd.workers.engine import scheduler
    from specd.workers.models import causal_lm
    from specd.workers.runner import (
        backend,
        cpu_backend,
        model_runner,
        step_inputs,
    )
    from specd.workers.spec import draft_head, drafting, step, verify

    targets: list[tuple[Any, str, str]] = [
        (EngineCore, "step", "step"), (EngineCore, "_delta", "deltas"),
        (scheduler.Scheduler, "schedule", "schedule"),
        (scheduler.Scheduler, "update", "update"),
        (model_runner.ModelRunner, "forward", "target forward"),
        (model_runner.ModelRunner, "sample", "sampling"),
        (model_runner.PendingOutput, "resolve", "resolve"),
        (step.PendingSpec, "resolve", "resolve"),
        (verify.Verifier, "forward", "target forward"),
        (verify.Verifier, "verify", "acceptance"),
        (drafting.Drafter, "catch_up", "catch-up"),
        (drafting.Drafter, "draft", "draft tree"),
        (verify.Verifier, "shifts", "verify inputs"),
        (causal_lm.DecoderLayer, "forward", "layer"),
        (causal_lm.CausalLM, "compute_logits", "logits"),
    ]
    for module in (backend, cpu_backend, model_runner):
        targets.append((module, "prepare_inputs", "inputs"))
    for module in (step_inputs, drafting, verify):
        targets.append((module, "build_attention_metadata", "attention metadata"))
    for cls in _subclasses(draft_head.Eagle3Head):
        if "draft_level" in vars(cls):
            targets.append((cls, "draft_level", "draft level"))
    return targets


def _subclasses(cls: type) -> list[type]:
    found = [cls]
    sub: type
    for sub in cls.__subclasses__():
        found.extend(_subclasses(sub))
    return found


@contextmanager
def phases_marked() -> Iterator[None]:
    """Every target wrapped in its phase's record_function while inside; restored after."""
    saved = []
    for owner, name, label in _targets():
        original = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, _wrapped(original, label))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _phase_of(event: FunctionEvent) -> str | None:
    """The innermost phase around `event` (None: outside every phase)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(PHASE_PREFIX):
            return parent.name[len(PHASE_PREFIX):]
        parent = parent.cpu_parent
    return None


def _label(event: FunctionEvent) -> str | None:
    return event.name[len(PHASE_PREFIX):] if event.name.startswith(PHASE_PREFIX) else None


def summarize(events: list[FunctionEvent], num_steps: int) -> dict[str, dict[str, float]]:
    """Per phase and per step: calls, inclusive and self milliseconds, torch ops (top-level
    aten ops: those not dispatched from inside another aten op)."""
    table: dict[str, dict[str, float]] = defaultdict(
        lambda: {"calls": 0.0, "ms": 0.0, "self_ms": 0.0, "ops": 0.0})
    for event in events:
        label = _label(event)
        if label is not None:
            if _phase_of(event) == label:
                continue  # inside its own phase (the verifier's forward calls the runner's)
            inner = sum(c.cpu_time_total for c in _phase_children(event, label))
            row = table[label]
            row["calls"] += 1
            row["ms"] += event.cpu_time_total / 1e3
            row["self_ms"] += (event.cpu_time_total - inner) / 1e3
        elif event.name.startswith("aten::") and not (
                event.cpu_parent is not None and event.cpu_parent.name.startswith("aten::")):
            table[_phase_of(event) or "outside"]["ops"] += 1
    return {label: {key: value / num_steps for key, value in row.items()}
            for label, row in table.items()}


def _phase_children(event: FunctionEvent, label: str) -> list[FunctionEvent]:
    """The nearest phases nested in `event` other than `label` (looked through)."""
    found = []
    for child in event.cpu_children:
        if _label(child) not in (None, label):
            found.append(child)
        else:
            found.extend(_phase_children(child, label))
    return found


def _decode_until_running(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(f"p{i}", ids, params)
    # Prefill and a few decode steps first: the profiled steps are steady decode steps.
    for _ in range(4):
        core.step()


def profile_case(core: EngineCore, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """`steps` decode steps of `prompts` batched, timed bare (the median), then `steps` more
    profiled."""
    _decode_until_running(core, prompts, max_tokens=4 + 6 * steps + 8)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    wall_ms = statistics.median(times) * 1e3
    with phases_marked(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            core.step()
    summary = summarize(list(prof.events()), steps)
    while core.has_unfinished():
        core.step()
    layers = summary.get("layer", {}).get("calls", 0.0)
    layer_ops = summary.get("layer", {}).get("ops", 0.0)
    total_ops = sum(row["ops"] for row in summary.values())
    return {"wall_ms_per_step": wall_ms, "phases": summary,
            "ops_per_step": total_ops,
            "ops_per_layer": layer_ops / layers if layers else 0.0,
            "layers_per_step": layers}


def _print(results: dict[str, Any]) -> None:
    for case, result in results["cases"].items():
        print(f"\n{case}: {result['wall_ms_per_step']:.2f} ms/step unprofiled, "
              f"{result['ops_per_step']:.0f} torch ops/step, "
              f"{result['ops_per_layer']:.1f} ops/layer call "
              f"({result['layers_per_step']:.0f} layer calls/step)")
        print(f"  {'phase':<20} {'calls':>6} {'ms':>8} {'self ms':>8} {'share':>6} {'ops':>6}")
        phases = result["phases"]
        step_ms = phases.get("step", {}).get("ms", 0.0) or 1.0
        for label in (*ORDER, "outside"):
            if label not in phases:
                continue
            row = phases[label]
            print(f"  {label:<20} {row['calls']:>6.1f} {row['ms']:>8.2f} {row['self_ms']:>8.2f} "
                  f"{row['self_ms'] / step_ms:>6.1%} {row['ops']:>6.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="fixture")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench_out/profile_step.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    texts = load_prompts(max(int(b) for b in args.batch_sizes.split(",")))
    results: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "threads": args.threads,
        "steps": args.steps, "machine": platform.platform(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "load_average_before": list(os.getloadavg()), "cases": {}}
    for mode in ("off", "on"):
        config = EngineConfig(model=args.model, dtype=args.dtype, spec_mode=mode,
                              spec_auto_measure=False, overlap_schedule=False)
        core = EngineCore(config)
        try:
            core.warmup()
            tokenizer_ids = _prompt_ids(config, texts, args.prompt_tokens)
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                case = f"{'plain' if mode == 'off' else 'speculative'} bs{batch}"
                print(f"profiling {case}", flush=True)
                results["cases"][case] = profile_case(core, tokenizer_ids[:batch], args.steps)
        finally:
            core.close()
    results["load_average_after"] = list(os.getloadavg())
    _print(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


def _prompt_ids(config: EngineConfig, texts: list[str], num_tokens: int) -> list[list[int]]:
    """Each text's first `num_tokens` token ids (the model's tokenizer)."""
    from specd.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(config.model_path)
    return [tokenizer.encode(text)[:num_tokens] for text in texts]


if __name__ == "__main__":
    main()
