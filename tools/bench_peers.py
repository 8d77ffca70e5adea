"""Peers on the same weights, side by side: llama.cpp (llama-cpp-python's server, the GGUF
file itself), vLLM's CPU build (the imported directory, with the EAGLE-3 head through
`--speculative-config`) and specd (the named model and its head), each through its
OpenAI-compatible server, driven by one client.

    python -m tools.bench_peers --llamacpp-python /tmp/venv-llamacpp/bin/python \
        --vllm /tmp/venv-vllm/bin/vllm --rounds 3 --out bench_out/bench_peers.json

The tool starts each server itself (a free loopback port each, one process group each,
stopped at the end whatever happens; `--only` picks some) and waits for `/health` (where
the server has it) and `/v1/models`. Then,
per concurrency (1 and 8), rounds alternate the order in which the servers serve the same
held-out chat questions (tools/chat_prompts.py, the model's chat template rendered by
transformers, sent as text to `POST /v1/completions`), greedy (temperature 0), up to
`--max-tokens` tokens or the end of the turn, streamed; `--workload code` sends a base
model (`--model fixture`) the fixture's held-out code prompts instead, continued for exactly
`--max-tokens` tokens (`ignore_eos`). At concurrency 1 the questions go
one after another, at 8 eight at a time. specd serves two configurations from one daemon:
`specd-eagle3` (speculation on, its head, a chain of 5) and `specd-off` (the same requests
with `"speculative": false`); vLLM fixes speculation per server, so `--only vllm` starts two,
`vllm-eagle3` (the head, 5 speculative tokens) and `vllm-off`.

Per server and concurrency: output tokens/s (the round's tokens over its wall time), TTFT
(request sent to the first text), TPOT (first to last text over the tokens after the first),
ITL (the mean gap between streamed chunks; a speculative step's tokens come in one chunk),
acceptance length where the server exposes it (specd: `usage.speculation`; vLLM: its
`/metrics` spec-decode counters, 1 + accepted / drafts), medians over the rounds, and
whether each greedy text equals specd-off's. Tokens are counted from the stream's usage
where a server sends one, else by tokenizing the text with the model's tokenizer (noted per
server). Nothing is tuned: each server runs its defaults, with the same thread count for
all (`--threads`, default 1), the same `--dtype` where given and vLLM's CPU KV cache at
`--vllm-kv-gib`; `--specd-option` adds one option to specd's command (`--cpu-compile`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import glob
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tools.chat_answers import resolve_model_dir
from tools.chat_prompts import questions
from tools.workload import load_prompts

READY_TIMEOUT_S = 1500.0  # vLLM's first start compiles for minutes on a shared 2-core VM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One peer's server process (its own process group) and how to talk to it."""

    name: str
    command: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    model_id: str = ""
    started_s: float = 0.0
    ready_s: float = 0.0
    compiled_s: float = 0.0  # specd: start to no compile pending (`_wait_compiled`)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child holds it; closed at exit
        self.started_s = time.monotonic()
        self.process = subprocess.Popen(self.command, env={**os.environ, **self.env},
                                        stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} exited before serving; log {self.log_path}:"
                                   f"\n{tail}")
            try:
                # A server that has /health (specd, vLLM) may list its model before it can
                # serve (specd's front answers 503 "starting" until its scheduler is up).
                async with session.get(f"{self.base_url}/health") as health:
                    if health.status not in (200, 404):
                        await asyncio.sleep(1.0)
                        continue
                async with session.get(f"{self.base_url}/v1/models") as response:
                    if response.status == 200:
                        self.model_id = (await response.json())["data"][0]["id"]
                        self.ready_s = time.monotonic() - self.started_s
                        await self._wait_compiled(session, deadline)
                        return
            except aiohttp.ClientError:
                pass  # not listening yet
            await asyncio.sleep(1.0)
        raise TimeoutError(f"{self.name} not serving after {READY_TIMEOUT_S:.0f}s; log "
                           f"{self.log_path}")

    async def _wait_compiled(self, session: aiohttp.ClientSession, deadline: float) -> None:
        """specd with `--cpu-compile-background` serves eagerly while it compiles, with the
        fallback `cpu_compile_pending` on its /metrics: the rounds measure the compiled
        steps, as vLLM's do (its /health answers once it has compiled), so wait for it to
        go; `compiled_s` is when it went (start-up to the first answer stays `ready_s`)."""
        if self.name != "specd":
            return
        while time.monotonic() < deadline:
            async with session.get(f"{self.base_url}/metrics") as response:
                if 'name="cpu_compile_pending"' not in await response.text():
                    self.compiled_s = time.monotonic() - self.started_s
                    return
            await asyncio.sleep(1.0)
        raise TimeoutError(f"{self.name} still compiling after {READY_TIMEOUT_S:.0f}s")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


@dataclass(frozen=True)
class Config:
    """What the client sends to one server for one configuration."""

    name: str
    server: str
    extra_body: dict[str, Any] = field(default_factory=dict)
    has_usage: bool = True
    metrics: str | None = None  # "vllm": acceptance from its /metrics counters


def build_servers(args: argparse.Namespace, model_dir: Path, head_dir: Path, gguf: Path,
                  work: Path) -> dict[str, Server]:
    threads = str(args.threads)
    env = {"OMP_NUM_THREADS": threads}
    dtype = ["--dtype", args.dtype] if args.dtype else []  # llama.cpp: the GGUF file's own
    servers: dict[str, Server] = {}
    if "specd" in args.only:
        port = free_port()
        servers["specd"] = Server("specd", [
            sys.executable, "-P", "-m", "specd.daemon.main", "--socket", str(work / "specd.sock"),
            "--http", f"127.0.0.1:{port}", "--model", str(model_dir), "--draft-model",
            str(head_dir), "--spec-mode", "on", "--no-spec-auto-measure", *dtype,
            *args.specd_option], env, port, work / "specd.log")
    if "llamacpp" in args.only:
        port = free_port()
        servers["llamacpp"] = Server("llamacpp", [
            args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
            "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--n_threads", threads,
            "--n_threads_batch", threads,
            # Its default cancels the request being served when another arrives; this server
            # serves one request at a time, so concurrent requests queue instead.
            "--interrupt_requests", "False"], env, port, work / "llamacpp.log")
    if "vllm" in args.only:
        port = free_port()
        venv = Path(args.vllm).resolve().parent.parent
        iomp = sorted(glob.glob(str(venv / "lib" / "**" / "libiomp5.so"), recursive=True))
        vllm_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
                    **({"LD_PRELOAD": iomp[0]} if iomp else {})}
        spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 5}
        servers["vllm"] = Server("vllm", [
            args.vllm, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--speculative-config", json.dumps(spec), *dtype], vllm_env, port,
            work / "vllm.log")
        # vLLM fixes speculation per server, not per request: a second server serves it off.
        port = free_port()
        servers["vllm-off"] = Server("vllm-off", [
            args.vllm, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            *dtype], vllm_env, port, work / "vllm-off.log")
    return servers


CONFIGS = {
    "specd": [Config("specd-eagle3", "specd", {"stream_options": {"include_usage": True}}),
              Config("specd-off", "specd", {"stream_options": {"include_usage": True},
                                            "speculative": False})],
    "vllm": [Config("vllm-eagle3", "vllm", {"stream_options": {"include_usage": True}},
                    metrics="vllm"),
             Config("vllm-off", "vllm-off", {"stream_options": {"include_usage": True}})],
    "llamacpp": [Config("llamacpp", "llamacpp", {}, has_usage=False)],
}


async def one_request(session: aiohttp.ClientSession, server: Server, config: Config,
                      prompt: str, max_tokens: int) -> dict[str, Any]:
    """Stream one completion: text, tokens (None without usage), TTFT, chunk times."""
    body = {"model": server.model_id, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, **config.extra_body}
    text, times, usage = [], [], None
    sent = time.perf_counter()
    async with session.post(f"{server.base_url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{config.name}: HTTP {response.status}: "
                               f"{(await response.text())[:500]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    text.append(choice["text"])
                    times.append(time.perf_counter())
    if not times:
        raise RuntimeError(f"{config.name}: no text streamed for {prompt[:60]!r}")
    return {"text": "".join(text), "sent": sent, "times": times, "usage": usage}


async def vllm_counters(session: aiohttp.ClientSession, server: Server) -> dict[str, float]:
    """vLLM's spec-decode counters (drafts, accepted tokens), summed over their labels."""
    async with session.get(f"{server.base_url}/metrics") as response:
        body = await response.text()
    out = {"drafts": 0.0, "accepted": 0.0}
    for line in body.splitlines():
        for key, metric in (("drafts", "vllm:spec_decode_num_drafts_total"),
                            ("accepted", "vllm:spec_decode_num_accepted_tokens_total")):
            if line.startswith(metric):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


async def serve_round(session: aiohttp.ClientSession, server: Server, config: Config,
                      prompts: list[str], concurrency: int, max_tokens: int,
                      count_tokens: Any) -> dict[str, Any]:
    """The prompts at `concurrency` at a time: per-request results and the round's figures."""
    before = await vllm_counters(session, server) if config.metrics == "vllm" else None
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        results += await asyncio.gather(*(one_request(session, server, config, p, max_tokens)
                                          for p in prompts[i: i + concurrency]))
    wall = time.perf_counter() - started
    for r in results:
        r["tokens"] = (r["usage"]["completion_tokens"] if config.has_usage and r["usage"]
                       else count_tokens(r["text"]))
    acceptance = None
    if before is not None:
        after = await vllm_counters(session, server)
        drafts = after["drafts"] - before["drafts"]
        acceptance = 1 + (after["accepted"] - before["accepted"]) / drafts if drafts else None
    elif config.has_usage and all((r["usage"] or {}).get("speculation") for r in results):
        lengths = [r["usage"]["speculation"]["acceptance_length"] for r in results]
        acceptance = statistics.mean(lengths)
    return {
        "tokens_per_s": sum(r["tokens"] for r in results) / wall, "wall_s": wall,
        "ttft_s": statistics.median(r["times"][0] - r["sent"] for r in results),
        "tpot_s": statistics.median((r["times"][-1] - r["times"][0]) / max(r["tokens"] - 1, 1)
                                    for r in results),
        "itl_s": statistics.median(_mean_gap(r["times"]) for r in results),
        "acceptance_length": acceptance,
        "texts": [r["text"] for r in results], "tokens": [r["tokens"] for r in results],
    }


def _mean_gap(times: list[float]) -> float:
    """The mean time between consecutive streamed chunks (0 for a single chunk)."""
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0


def summarize(rounds: list[dict[str, Any]], reference: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("tokens_per_s", "ttft_s", "tpot_s", "itl_s"):
        out[key] = statistics.median(r[key] for r in rounds)
    accept = [r["acceptance_length"] for r in rounds if r["acceptance_length"] is not None]
    out["acceptance_length"] = statistics.median(accept) if accept else None
    texts = rounds[0]["texts"]
    out["texts_stable_across_rounds"] = all(r["texts"] == texts for r in rounds)
    if reference is not None:
        out["texts_equal_to_specd_off"] = sum(a == b for a, b in zip(texts, reference,
                                                                     strict=True))
    out["num_texts"] = len(texts)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(args.model)
    needs_head = "specd" in args.only or "vllm" in args.only
    head_dir = Path(args.draft_model) if args.draft_model else (
        _named_head(args.model) if needs_head else Path())
    gguf = Path(args.gguf) if args.gguf else (
        _named_gguf(args.model) if "llamacpp" in args.only else Path())
    tok = AutoTokenizer.from_pretrained(model_dir)
    if args.workload == "chat":
        rows = questions("heldout")
        picked = [rows[i * len(rows) // args.num_prompts]["question"]
                  for i in range(args.num_prompts)]
        prompts = [str(tok.apply_chat_template([{"role": "user", "content": q}],
                                               add_generation_prompt=True, tokenize=False))
                   for q in picked]
        workload_body: dict[str, Any] = {}
    else:  # a base model (the fixtures): code continued for exactly --max-tokens tokens
        picked = prompts = load_prompts(args.num_prompts)
        workload_body = {"ignore_eos": True}

    def count_tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False).input_ids)

    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    servers = build_servers(args, model_dir, head_dir, gguf, work)
    configs = [dataclasses.replace(c, extra_body={**c.extra_body, **workload_body})
               for name in args.only for c in CONFIGS[name]]
    result: dict[str, Any] = {
        "model_dir": str(model_dir), "head": str(head_dir), "gguf": str(gguf),
        "workload": args.workload, "prompts": picked, "max_tokens": args.max_tokens,
        "threads": args.threads, "dtype": args.dtype, "specd_options": args.specd_option,
        "machine": platform.platform(), "processor": platform.processor(),
        "cpus": os.cpu_count(), "load_average_before": os.getloadavg(),
        "servers": {}, "results": {}}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    try:
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            for server in servers.values():  # one at a time: starting is the heaviest part
                server.start()
                await server.wait_ready(session)
                print(f"{server.name} serving {server.model_id} after {server.ready_s:.0f}s "
                      f"({server.log_path})", flush=True)
                result["servers"][server.name] = {"command": server.command, "env": server.env,
                                                  "ready_s": server.ready_s,
                                                  "compiled_s": server.compiled_s}
            for config in configs:  # warm-up: a short request each
                await one_request(session, servers[config.server], config, prompts[0], 8)
            for conc in args.concurrency:
                per: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
                for index in range(args.rounds):
                    shift = index % len(configs)
                    for config in configs[shift:] + configs[:shift]:
                        figures = await serve_round(session, servers[config.server], config,
                                                    prompts, conc, args.max_tokens,
                                                    count_tokens)
                        per[config.name].append(figures)
                        print(f"c={conc} round {index + 1} {config.name}: "
                              f"{figures['tokens_per_s']:.1f} tok/s", flush=True)
                reference = per["specd-off"][0]["texts"] if "specd-off" in per else None
                result["results"][str(conc)] = {
                    name: {**summarize(rounds, reference), "rounds": rounds}
                    for name, rounds in per.items()}
                _write(args.out, result)
    finally:
        for server in servers.values():
            server.stop()
    result["load_average_after"] = os.getloadavg()
    _write(args.out, result)
    return result


def _named_head(model: str) -> Path:
    from specd.workers.named_models import named_model

    named = named_model(model)
    if named is None or named.draft_dir is None:
        raise ValueError(f"{model}: no EAGLE-3 head of its own; pass --draft-model")
    return named.draft_dir


def _named_gguf(model: str) -> Path:
    from specd.workers.named_models import named_model

    named = named_model(model)
    if named is None or named.gguf_source is None or not named.gguf_source.is_file():
        raise ValueError(f"{model}: no GGUF file; pass --gguf")
    return named.gguf_source


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def print_table(result: dict[str, Any]) -> None:
    print(f"{'conc':>4} {'server':>13} {'tok/s':>7} {'TTFT ms':>8} {'TPOT ms':>8} "
          f"{'ITL ms':>7} {'accept':>6} {'same text':>9}")
    for conc, by_name in result["results"].items():
        for name, s in by_name.items():
            accept = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] else "-"
            same = (f"{s['texts_equal_to_specd_off']}/{s['num_texts']}"
                    if "texts_equal_to_specd_off" in s else "-")
            print(f"{conc:>4} {name:>13} {s['tokens_per_s']:7.1f} {s['ttft_s'] * 1e3:8.0f} "
                  f"{s['tpot_s'] * 1e3:8.1f} {s['itl_s'] * 1e3:7.1f} {accept:>6} {same:>9}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a named model (its directory, head, GGUF)")
    p.add_argument("--draft-model", default=None, help="the EAGLE-3 head (default: its own)")
    p.add_argument("--gguf", default=None, help="the GGUF file (default: the named model's)")
    p.add_argument("--only", nargs="+", choices=tuple(CONFIGS),
                   default=["specd", "vllm", "llamacpp"])
    p.add_argument("--llamacpp-python", default="python",
                   help="the python of a venv with llama-cpp-python[server]")
    p.add_argument("--vllm", default="vllm", help="the vllm command of a vllm-cpu venv")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--threads", type=int, default=1, help="compute threads of every server")
    p.add_argument("--specd-option", action="append", default=[],
                   help="one more option for specd's daemon, e.g. --specd-option=--cpu-compile "
                        "(repeatable)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="specd's and vLLM's --dtype (default: each server's own default)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--workload", choices=("chat", "code"), default="chat",
                   help="chat: held-out chat questions to the end of the turn; code: the "
                        "fixture's held-out code prompts, exactly --max-tokens tokens")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench_out/bench_peers.json"))
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print_table(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
