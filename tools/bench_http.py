"""HTTP API against the Unix socket: the same greedy workload through both protocols of one
daemon, at each concurrency (default 1 and 32).

The socket side streams through `specd.client.AsyncClient`; the HTTP side streams
POST /v1/completions (server-sent events, `stream_options.include_usage`) through aiohttp,
reading the events as they come and decoding only the last one (the usage), so that the
client's own cost, which shares the machine's cores with the daemon, stays small. Both
ask for `--max-tokens` tokens with `ignore_eos`, so both produce the same number of
tokens. Rounds alternate which protocol runs first, and the ratio (HTTP tok/s /
socket tok/s, target >= 0.95) is taken per round; the table gives the median ratio over
the rounds and the median throughput of each side. Beside wall-clock throughput, which a
busy machine makes noisy, it reports the front process's CPU time per output token on each
protocol (from /proc), which load on other cores hardly moves: the cost of the adapter
itself. The daemon is started here (fixture model unless --model) with `--http` on a free
loopback port and `--no-spec-auto-measure`, so both protocols get the same speculation
decisions for the same batch. Prints a table, writes JSON.

    python -m tools.bench_http --torch-threads 1 --out bench_out/bench_http.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from specd.client import AsyncClient, Client, DaemonUnavailable, SpecdError
from tools.workload import load_prompts

READY_TIMEOUT_S = 600.0
USAGE_TAIL_BYTES = 4096  # the stream's last bytes kept: the usage chunk and [DONE]


class BenchDaemon:
    """`specd --http 127.0.0.1:0` on a private socket, for the benchmark's duration."""

    def __init__(self, model: str | None, extra: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-http-"))
        self.socket_path = self.dir / "specd.sock"
        self.log_path = self.dir / "specd.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-P", "-m", "specd.daemon.main", "--socket",
                   str(self.socket_path), "--log-format", "json", "--http", "127.0.0.1:0",
                   "--no-spec-auto-measure",
                   *(["--model", model] if model else []), *extra]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> str:
        """Wait until the daemon serves; returns the HTTP API's base URL."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"specd exited {self.process.returncode}; log "
                                   f"{self.log_path}")
            try:
                with Client(self.socket_path, timeout=10) as client:
                    if client.status().state == "ready":
                        return self._base_url()
            except (DaemonUnavailable, SpecdError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"specd not ready; log {self.log_path}")

    def _base_url(self) -> str:
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{") and '"http_listening"' in line:
                record = json.loads(line)
                return f"http://{record['host']}:{record['port']}"
        raise RuntimeError(f"no http_listening record in {self.log_path}")

    def cpu_s(self) -> float:
        """CPU time (user + system) the front process used so far."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
        self.log.close()


def _figures(counts: list[int], wall: float) -> dict[str, float]:
    return {"output_tokens": sum(counts), "wall_s": wall, "tokens_per_s": sum(counts) / wall}


async def bench_socket(socket_path: Path, prompts: list[str], max_tokens: int
                       ) -> dict[str, float]:
    async with AsyncClient(socket_path, timeout=600) as client:
        async def one(prompt: str) -> int:
            count = 0
            async for delta in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True):
                count += len(delta.token_ids)
            return count

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return _figures(counts, time.perf_counter() - started)


class _Usage(msgspec.Struct):
    completion_tokens: int


class _Chunk(msgspec.Struct):
    usage: _Usage | None = None


async def bench_http(base_url: str, model: str, prompts: list[str], max_tokens: int
                     ) -> dict[str, float]:
    decoder = msgspec.json.Decoder(_Chunk)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base_url, connector=connector) as session:
        async def one(prompt: str) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            tail = b""
            async with session.post("/v1/completions", json=body) as response:
                response.raise_for_status()
                async for data in response.content.iter_any():
                    tail = (tail + data)[-USAGE_TAIL_BYTES:]
            # ... data: {usage chunk}\n\ndata: [DONE]\n\n
            usage = decoder.decode(tail.rsplit(b"data: ", 2)[1]).usage
            if usage is None:
                raise RuntimeError(f"no usage in the stream's last events: {tail!r}")
            return usage.completion_tokens

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return _figures(counts, time.perf_counter() - started)


async def measure(daemon: BenchDaemon, base_url: str, model: str, concurrency: int,
                  max_tokens: int, rounds: int) -> dict[str, Any]:
    prompts = load_prompts(concurrency)
    await bench_socket(daemon.socket_path, prompts[:1], 4)  # warm both paths
    await bench_http(base_url, model, prompts[:1], 4)
    runs: list[dict[str, Any]] = []
    for index in range(rounds):
        pair: dict[str, Any] = {}
        for side in (("socket", "http") if index % 2 == 0 else ("http", "socket")):
            cpu_before = daemon.cpu_s()
            client_before = time.process_time()
            if side == "socket":
                pair[side] = await bench_socket(daemon.socket_path, prompts, max_tokens)
            else:
                pair[side] = await bench_http(base_url, model, prompts, max_tokens)
            tokens = pair[side]["output_tokens"]
            pair[side]["front_cpu_us_per_token"] = 1e6 * (daemon.cpu_s() - cpu_before) / tokens
            pair[side]["client_cpu_us_per_token"] = (
                1e6 * (time.process_time() - client_before) / tokens)
        pair["ratio"] = pair["http"]["tokens_per_s"] / pair["socket"]["tokens_per_s"]
        runs.append(pair)

    def median(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in runs)

    return {
        "concurrency": concurrency,
        "median_ratio": statistics.median(r["ratio"] for r in runs),
        "median_socket_tok_s": median("socket", "tokens_per_s"),
        "median_http_tok_s": median("http", "tokens_per_s"),
        "socket_front_cpu_us_per_token": median("socket", "front_cpu_us_per_token"),
        "http_front_cpu_us_per_token": median("http", "front_cpu_us_per_token"),
        "rounds": runs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory [default: fixture]")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="paired rounds per concurrency")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="OMP_NUM_THREADS for the daemon (set it on a shared machine)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/bench_http.json"))
    args = parser.parse_args(argv)

    if args.torch_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # inherited by the daemon
    daemon = BenchDaemon(args.model, ["--device", args.device])
    base_url = daemon.wait_ready()
    with Client(daemon.socket_path) as client:
        model = client.status().model
    rows: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"model": model, "device": args.device, "torch_threads": args.torch_threads,
              "max_tokens": args.max_tokens, "rounds": args.rounds,
              "machine": platform.platform(), "processor": platform.processor(),
              "cpus": os.cpu_count(), "rows": rows}
    try:
        for concurrency in args.concurrency:
            rows.append(asyncio.run(measure(daemon, base_url, model, concurrency,
                                            args.max_tokens, args.rounds)))
            args.out.write_text(json.dumps(result, indent=2))
    finally:
        daemon.stop()
    print(f"{'concurrency':>11} {'socket tok/s':>13} {'http tok/s':>11} {'median ratio':>13} "
          f"{'front us/token socket':>22} {'http':>6}")
    for row in rows:
        print(f"{row['concurrency']:>11} {row['median_socket_tok_s']:>13.1f} "
              f"{row['median_http_tok_s']:>11.1f} {row['median_ratio']:>13.3f} "
              f"{row['socket_front_cpu_us_per_token']:>22.0f} "
              f"{row['http_front_cpu_us_per_token']:>6.0f}")
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
