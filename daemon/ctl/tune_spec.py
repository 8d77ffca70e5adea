"""`specctl tune-spec`: where speculation stops paying for the loaded model on this machine.

At each batch size b, b clients send greedy requests (held-out prompts, `ignore_eos`) in
a closed loop, once with speculation off and once on, so the batch stays at b. The load is
steady, as a service's is: each request's length is drawn uniformly within +-50% of
`--max-tokens` and each client's first request is cut at a uniform point
(`bench.paired.request_lengths`), so requests end and join a few at a time. With equal
lengths the clients moved in waves (all prefilling, all decoding, all ending together),
and plain decode measured in waves ran up to twice as fast as under a steady load on the
2-core CPU: the crossing measured in waves (21) turned speculation off at 32-64 requests
where, under a steady load, it paid 1.5-1.7x.

From the engine's counters over a window in which every client has had its first request
answered and two more per client are answered:

    step cost       wall / engine steps          (plain decode off; draft + verify on)
    tokens per step generated / (steps * b)      (the acceptance length when on)
    speedup(b)      tokens/s on / tokens/s off

When the engine also counts its draft and verify time (stats engine.draft_s, catch_up_s
and verify_s, cumulative seconds) the spec step is split into the two (draft = catch-up of
the draft's KV + drafting).

Threshold: speculation pays while speedup >= 1; the threshold is where the measured
speedup curve crosses 1 (linear between the two sizes around the crossing), or the largest
size measured when it never does. `auto` turns speculation off above it.

Chain or tree: the per-draft acceptance rate a follows from the chain's acceptance length
tau at batch 1 (tau = (1 - a^(k+1)) / (1 - a) for k drafts); the chain depth recommended is
the k in 1..MAX_STEPS with the most tokens per second under the cost model
`plain step + k * draft step` (draft step = the measured spec step's excess over a plain
step, divided by the current depth). A tree (topk > 1) verifies several times the tokens
per step; it pays where verifying more tokens is nearly free (a GPU at small batch), not on
a CPU, where the verify pass costs in proportion to its tokens: on a CPU the chain is kept.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import click
import msgspec

from specd.daemon.bench.client import BenchClient
from specd.daemon.bench.paired import request_lengths
from specd.daemon.bench.sweep import load_prompts
from specd.daemon.ctl.common import Settings, int_list, run_client_call
from specd.ipc.errors import SpecdError
from specd.ipc.sampling import SamplingParams

MAX_STEPS = 8
NO_MEASURE = "--no-spec-auto-measure"
WINDOW_REQUESTS = 2  # requests per client answered inside the measured window
TREE_TOPK = 4  # the tree offered on a GPU: EAGLE-2's usual shape
TREE_TOKENS_PER_STEP = 2
LENGTH_SPREAD = 0.5  # request lengths uniform within +-50% of --max-tokens


async def _run_batch(client: BenchClient, prompts: list[str], batch_size: int,
                     max_tokens: int) -> dict[str, float]:
    """`batch_size` clients in a closed loop (each sends its next request when its last
    one ends), so the batch stays full; the engine's counters are read over a window that
    opens once every client has had a request answered (the first wave of prefills is
    over) and closes when WINDOW_REQUESTS more per client have been answered. Measuring a
    single batch to its end instead would count, with speculation, the tail in which its
    slowest request runs alone. Lengths vary (module docstring), drawn from a seeded
    generator per client, so both modes see the same requests."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    loop = asyncio.get_running_loop()
    done_per_client = [0] * batch_size
    opened, closed = asyncio.Event(), asyncio.Event()
    target = batch_size * (1 + WINDOW_REQUESTS)

    async def client_loop(i: int) -> None:
        n = 0
        rng = random.Random(i)
        while not closed.is_set():
            length = request_lengths(max_tokens, LENGTH_SPREAD, rng, first=n == 0)
            await client.timed_request(prompts[(i + n * batch_size) % len(prompts)],
                                       msgspec.structs.replace(sampling, max_tokens=length))
            n += 1
            done_per_client[i] = n
            if min(done_per_client) >= 1:
                opened.set()
            if sum(done_per_client) >= target:
                closed.set()

    tasks = [asyncio.create_task(client_loop(i)) for i in range(batch_size)]
    try:
        await _until(opened, tasks)
        before = (await client.stats()).get("engine", {})
        started = loop.time()
        await _until(closed, tasks)
        after = (await client.stats()).get("engine", {})
        wall = loop.time() - started
        await asyncio.gather(*tasks)  # the requests still running end outside the window
    finally:
        for task in tasks:
            task.cancel()

    def delta(key: str) -> float:
        return float(after.get(key, 0)) - float(before.get(key, 0))

    steps = max(1.0, delta("num_steps"))
    run = {"wall_s": wall, "steps": steps, "tokens": delta("num_generated_tokens"),
           "step_ms": 1e3 * wall / steps, "tokens_per_s": delta("num_generated_tokens") / wall,
           "tokens_per_step": delta("num_generated_tokens") / (steps * batch_size),
           "drafted": delta("num_drafted"), "accepted": delta("num_accepted")}
    if "draft_s" in after and "verify_s" in after:  # draft time includes its catch-up
        run["draft_ms"] = 1e3 * (delta("draft_s") + delta("catch_up_s")) / steps
        run["verify_ms"] = 1e3 * delta("verify_s") / steps
    return run


async def _until(event: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
    """Wait for `event`; a task that failed meanwhile raises its error here (the event
    would never come)."""
    waiter = asyncio.create_task(event.wait())
    try:
        await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    for task in tasks:
        error = task.exception() if task.done() and not task.cancelled() else None
        if error is not None:
            raise error


async def measure(socket_path: Path | None, batch_sizes: tuple[int, ...], max_tokens: int,
                  timeout_s: float) -> dict[str, Any]:
    """Measure off and on at each batch size and derive the settings (module docstring).
    Raises SpecdError when the daemon serves without speculation."""
    async with BenchClient(socket_path, timeout=timeout_s) as client:
        status = await client.status()
        if not status.resolved.get("speculative", False):
            raise SpecdError("the daemon serves without speculation (no draft model): "
                             "nothing to tune")
        engine_config = status.config.get("engine", {})
        initial_mode = str(status.engine.get("spec_mode", "auto"))
        prompts = load_prompts(max(batch_sizes))
        rows = []
        try:
            for b in sorted(batch_sizes):
                row: dict[str, Any] = {"batch_size": b}
                for mode in ("off", "on"):
                    await client.set_spec(mode)
                    row[mode] = await _run_batch(client, prompts, b, max_tokens)
                row["speedup"] = row["on"]["tokens_per_s"] / row["off"]["tokens_per_s"]
                rows.append(row)
        finally:
            await client.set_spec(initial_mode)
    return recommend(rows, engine_config)


def crossover(rows: list[dict[str, Any]]) -> int | None:
    """The largest batch size at which speculation still pays (speedup >= 1), interpolated
    between measured sizes; None when it does not pay even at the smallest size."""
    if rows[0]["speedup"] < 1.0:
        return None
    for low, high in zip(rows, rows[1:], strict=False):
        if high["speedup"] < 1.0:
            s0, s1 = low["speedup"], high["speedup"]
            b0, b1 = low["batch_size"], high["batch_size"]
            return max(b0, int(b0 + (s0 - 1.0) / (s0 - s1) * (b1 - b0)))
    return int(rows[-1]["batch_size"])


def chain_acceptance_rate(tau: float, num_steps: int) -> float:
    """a in [0, 1) with (1 - a^(k+1)) / (1 - a) = tau (bisection; tau is clipped to the
    achievable range [1, k+1))."""
    tau = min(max(tau, 1.0), num_steps + 1 - 1e-6)
    low, high = 0.0, 1.0 - 1e-9
    for _ in range(60):
        mid = (low + high) / 2
        if sum(mid**i for i in range(num_steps + 1)) < tau:
            low = mid
        else:
            high = mid
    return low


def best_chain_depth(rate: float, plain_ms: float, draft_ms: float) -> int:
    """The depth k maximizing expected tokens per ms: (1 - a^(k+1)) / (1 - a) tokens for
    plain_ms + k * draft_ms."""
    def tokens_per_ms(k: int) -> float:
        return sum(rate**i for i in range(k + 1)) / (plain_ms + k * draft_ms)

    return max(range(1, MAX_STEPS + 1), key=tokens_per_ms)


def recommend(rows: list[dict[str, Any]], engine_config: dict[str, Any]) -> dict[str, Any]:
    """The settings to use, as daemon flags, with the figures behind them."""
    threshold = crossover(rows)
    current_steps = int(engine_config.get("spec_num_steps", 5))
    first = rows[0]
    rate = chain_acceptance_rate(first["on"]["tokens_per_step"], current_steps)
    plain_ms = first["off"]["step_ms"]
    # one draft step's cost: the step's drafting time (measured, else the spec step's
    # excess over a plain step) spread over its `current_steps` draft steps
    draft_ms = first["on"].get("draft_ms",
                               max(first["on"]["step_ms"] - plain_ms, 0.0)) / current_steps
    depth = best_chain_depth(rate, plain_ms, max(draft_ms, 1e-6))
    on_cpu = str(engine_config.get("device", "cpu")) == "cpu"
    flags: dict[str, str]
    if threshold is None:
        flags = {"--spec-mode": "off"}
    else:
        topk = 1 if on_cpu else TREE_TOPK
        tokens = depth if topk == 1 else min(64, TREE_TOKENS_PER_STEP * topk * depth)
        # The measured threshold replaces auto's online measurement: with it on, the
        # threshold only decides until both modes are measured at a load, and plain decode
        # measured inside auto (requests staggered by speculation) runs slower than the
        # plain decode it would switch to.
        flags = {"--spec-mode": "auto", "--spec-disable-batch-threshold": str(threshold),
                 NO_MEASURE: "", "--spec-num-steps": str(depth), "--spec-topk": str(topk),
                 "--spec-num-draft-tokens": str(tokens)}
    return {"rows": rows, "threshold": threshold, "acceptance_rate": rate,
            "chain_depth": depth, "draft_step_ms": draft_ms, "plain_step_ms": plain_ms,
            "device": engine_config.get("device", "cpu"), "recommended_flags": flags,
            "draft_verify_split": "draft_ms" in first["on"]}


def format_tuning(tuning: dict[str, Any]) -> str:
    head = (f"{'batch':>5} {'off step ms':>11} {'on step ms':>10} {'draft ms':>8} "
            f"{'verify ms':>9} {'tok/step on':>11} {'speedup':>7}")
    lines = [head, "-" * len(head)]
    for row in tuning["rows"]:
        on = row["on"]
        lines.append(f"{row['batch_size']:>5} {row['off']['step_ms']:>11.2f} "
                     f"{on['step_ms']:>10.2f} {on.get('draft_ms', float('nan')):>8.2f} "
                     f"{on.get('verify_ms', float('nan')):>9.2f} {on['tokens_per_step']:>11.2f} "
                     f"{row['speedup']:>7.2f}")
    if not tuning["draft_verify_split"]:
        lines.append("(the engine does not count draft and verify time apart: 'on step' is "
                     "both; draft step cost estimated as its excess over a plain step)")
    threshold = tuning["threshold"]
    lines.append("speculation does not pay at any measured batch size" if threshold is None
                 else f"speculation pays up to batch size {threshold}")
    lines.append(f"per-draft acceptance rate {tuning['acceptance_rate']:.2f}; best chain "
                 f"depth {tuning['chain_depth']} on {tuning['device']}")
    lines.append("use: " + " ".join(f"{k} {v}".strip()
                                    for k, v in tuning["recommended_flags"].items()))
    return "\n".join(lines)


def update_env_args(text: str, flags: dict[str, str]) -> str:
    """`text` (an EnvironmentFile) with each flag set in SPECD_ARGS: existing occurrences
    (`--flag value` or `--flag=value`) removed, the new `--flag value` appended; a missing
    SPECD_ARGS line is added. Other lines are kept as they are. A flag whose value is ""
    is a switch (`--no-x`): it is written bare, and both it and its opposite (`--x`) are
    removed first."""
    lines = text.splitlines()
    index = next((i for i, line in enumerate(lines) if line.startswith("SPECD_ARGS=")), None)
    words = lines[index].split("=", 1)[1].split() if index is not None else []
    switches = {f for f, v in flags.items() if v == ""}
    switches |= {_opposite(f) for f in switches}
    kept: list[str] = []
    skip_next = False
    for word in words:
        if skip_next:
            skip_next = False
        elif word in switches:
            continue
        elif word in flags:
            skip_next = True
        elif word.split("=", 1)[0] not in flags:
            kept.append(word)
    for flag, value in flags.items():
        kept += [flag] if value == "" else [flag, value]
    new_line = "SPECD_ARGS=" + " ".join(kept)
    if index is None:
        lines.append(new_line)
    else:
        lines[index] = new_line
    return "\n".join(lines) + "\n"


def _opposite(switch: str) -> str:
    """--no-x <-> --x."""
    return "--" + switch[5:] if switch.startswith("--no-") else "--no-" + switch[2:]


def update_env_file(path: Path, flags: dict[str, str]) -> str:
    """Rewrite `path` with `update_env_args` (atomically: a temporary file renamed over it);
    returns the new SPECD_ARGS line. A missing file is created."""
    text = path.read_text() if path.exists() else ""
    new_text = update_env_args(text, flags)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as out:
        out.write(new_text)
    if path.exists():
        os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)
    return next(line for line in new_text.splitlines() if line.startswith("SPECD_ARGS="))


@click.command("tune-spec")
@click.option("--batch-sizes", "batch_text", default="1,2,4,8,16,32", show_default=True,
              help="batch sizes to measure (comma-separated)")
@click.option("--max-tokens", type=int, default=48, show_default=True,
              help="output tokens per request while measuring")
@click.option("--write-env", type=click.Path(path_type=Path), default=None,
              help="update this environment file's SPECD_ARGS with the chosen settings")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
@click.pass_context
def tune_spec(ctx: click.Context, batch_text: str, max_tokens: int, write_env: Path | None,
              as_json: bool) -> None:
    """Measure where speculation stops paying on this machine and print the settings."""
    settings: Settings = ctx.obj
    batch_sizes = int_list(batch_text)
    if max_tokens < 2:
        raise click.UsageError(f"--max-tokens must be >= 2, got {max_tokens}")
    tuning = run_client_call(lambda: asyncio.run(measure(
        settings.socket_path, batch_sizes, max_tokens, max(settings.timeout, 600.0))))
    if as_json or settings.as_json:
        click.echo(json.dumps(tuning))
    else:
        click.echo(format_tuning(tuning))
    if write_env is not None:
        changed = update_env_file(write_env, tuning["recommended_flags"])
        click.echo(f"updated {write_env}: {changed}", err=True)
