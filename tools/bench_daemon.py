"""Daemon overhead benchmark: the same workload through the daemon (client library, Unix
socket, front, ZeroMQ, scheduler process) and through the in-process engine.

For each concurrency (default 1 and 32): output tokens per second both ways and their
ratio (target >= 0.95), and the per-token latency the daemon adds, in microseconds
((daemon wall - engine wall) / output tokens at concurrency 1; at higher concurrency the
same difference per engine step). Greedy, `ignore_eos`, fixed `--max-tokens`. The daemon is
started here on a private socket unless `--socket` names a running one. Prints a table
and writes JSON.

    python -m tools.bench_daemon --out bench_out/bench_daemon.json [--device cuda]

`--device` serves both paths there (default: cuda when available, else cpu). The JSON is
rewritten after each concurrency, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import specd
from specd.client import AsyncClient, Client, DaemonUnavailable, SpecdError
from tools.workload import load_prompts

READY_TIMEOUT_S = 600.0


def bench_engine(engine: Any, prompts: list[str], max_tokens: int) -> dict[str, float]:
    params = specd.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


async def _bench_daemon(socket_path: Path, prompts: list[str], max_tokens: int
                        ) -> dict[str, float]:
    async with AsyncClient(socket_path, timeout=600) as client:
        async def one(prompt: str) -> int:
            count = 0
            async for delta in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True):
                count += len(delta.token_ids)
            return count

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - started
    tokens = sum(counts)
    return {"output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def bench_daemon(socket_path: Path, prompts: list[str], max_tokens: int) -> dict[str, float]:
    return asyncio.run(_bench_daemon(socket_path, prompts, max_tokens))


class DaemonProcess:
    """`specd` on a private socket, for the benchmark's duration."""

    def __init__(self, model: str | None, extra: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-daemon-"))
        self.socket_path = self.dir / "specd.sock"
        self.log = open(self.dir / "specd.log", "w")  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-P", "-m", "specd.daemon.main", "--socket",
                   str(self.socket_path), "--log-level", "warning",
                   *(["--model", model] if model else []), *extra]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"specd exited {self.process.returncode}; log in {self.dir}")
            try:
                with Client(self.socket_path, timeout=10) as client:
                    if client.status().state == "ready":
                        return
            except (DaemonUnavailable, SpecdError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"specd not ready; log in {self.dir}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
        self.log.close()


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory [default: fixture]")
    parser.add_argument("--device", default=_default_device(), help="cpu or cuda[:N] "
                        "(default: cuda when available, else cpu)")
    parser.add_argument("--socket", type=Path, default=None, help="use this running daemon")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per figure")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads for both paths (OMP_NUM_THREADS for the "
                        "daemon); set it on a shared machine so both run alike")
    parser.add_argument("--out", type=Path, default=Path("bench_out/bench_daemon.json"))
    args = parser.parse_args(argv)

    if args.torch_threads is not None:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # inherited by the daemon
        torch.set_num_threads(args.torch_threads)
    engine = specd.Engine(model=args.model, device=args.device)
    daemon = None
    socket_path = args.socket
    if socket_path is None:
        daemon = DaemonProcess(args.model, ["--device", args.device])
        daemon.wait_ready()
        socket_path = daemon.socket_path
    rows: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model or "fixture", "device": args.device,
              "torch_threads": args.torch_threads,
              "max_tokens": args.max_tokens, "repeats": args.repeats,
              "machine": platform.platform(), "cpus": os.cpu_count(), "rows": rows}
    try:
        for concurrency in args.concurrency:
            prompts = load_prompts(concurrency)
            bench_engine(engine, prompts[:1], 4)  # warm the in-process path
            bench_daemon(socket_path, prompts[:1], 4)
            best_engine = max((bench_engine(engine, prompts, args.max_tokens)
                               for _ in range(args.repeats)), key=lambda r: r["tokens_per_s"])
            best_daemon = max((bench_daemon(socket_path, prompts, args.max_tokens)
                               for _ in range(args.repeats)), key=lambda r: r["tokens_per_s"])
            steps = best_engine["output_tokens"] / concurrency
            rows.append({
                "concurrency": concurrency,
                "engine": best_engine,
                "daemon": best_daemon,
                "throughput_ratio": best_daemon["tokens_per_s"] / best_engine["tokens_per_s"],
                "added_latency_per_token_us":
                    1e6 * (best_daemon["wall_s"] - best_engine["wall_s"]) / steps,
            })
            args.out.write_text(json.dumps(result, indent=2))
    finally:
        if daemon is not None:
            daemon.stop()
    print(f"{'concurrency':>11} {'engine tok/s':>13} {'daemon tok/s':>13} {'ratio':>6} "
          f"{'added us/token':>15}")
    for row in rows:
        print(f"{row['concurrency']:>11} {row['engine']['tokens_per_s']:>13.1f} "
              f"{row['daemon']['tokens_per_s']:>13.1f} {row['throughput_ratio']:>6.3f} "
              f"{row['added_latency_per_token_us']:>15.0f}")
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
