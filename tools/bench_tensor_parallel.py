"""Tensor parallelism on this machine: start-up time and greedy decode throughput of an
embedded fixture at tensor-parallel sizes 1 and 2 (workers/parallel/), or with
`--messaging` the per-step cost of getting rank 0's calls to the other ranks.

    python -m tools.bench_tensor_parallel [--model fixture|fixture-moe] [--tokens 32]
        [--batch 4] [--expert-parallel] [--json out.json]
    python -m tools.bench_tensor_parallel --messaging [--sizes 2 4 8] [--batch 1 32]
        [--steps 300] [--context 1024] [--hidden 7168] [--gap-ms 2] [--json out.json]
    python -m tools.bench_tensor_parallel --collectives [--batch 1 32] [--hidden 7168]

Engine: each size builds an `EngineCore` (float32, speculation off), times the build,
then runs `--batch` held-out prompts to `--tokens` new tokens each and reports output
tokens per second of the generation alone. On a CPU the ranks share its cores, so size 2
measures the cost of the split (collectives, one process more), not a speed-up.

Messaging: rank 0 sends one decode step's calls as the driver does, `forward` (input ids,
positions, the CPU attention metadata of B sequences of `--context` tokens, three captured
layers) and `logits` (hidden [B, --hidden] bfloat16), to N - 1 receiver processes (fresh
interpreters), `--steps` times with `--gap-ms` between steps (the step's compute, during
which receivers wait for the next call). Two transports:

* `pipe`: the path before the step ring: torch.save of each call once, written down one
  pipe per receiver (a socketpair, as multiprocessing's Pipe), torch.load on each;
* `ring`: the step ring (workers/parallel/ring.py) carrying codec.py's frames.

Per size and batch: `send_us`, rank 0's time to encode and hand a step's calls over (the
median); `decode_us`, a receiver's time to decode them once read; `latency_us`, from the
start of the send to the last receiver holding the decoded calls (median and p90): the
time a step of the other ranks waits on messaging. Clocks are CLOCK_MONOTONIC, shared by
the processes.

Collectives: two processes over gloo (TCP on 127.0.0.1, as two nodes on one host) time
what crosses between ranks per layer under tensor parallelism, an all-reduce of the hidden
states [B, --hidden] float32, against what would cross once per step between two pipeline
stages, a send of the same tensor (half a ping-pong); medians of 300.
"""

from __future__ import annotations

import argparse
import io
import json
import socket
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.parallel.codec import decode, encode
from specd.workers.parallel.ring import RingReader, RingWriter
from specd.workers.runner.attention import build_attention_metadata
from tests.integration.heldout import heldout_prompt_ids

BLOCK = 16
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
SELF = [sys.executable, "-m", "tools.bench_tensor_parallel"]  # a receiver, from ROOT


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


# ---- messaging ---------------------------------------------------------------------------

def step_calls(batch: int, context: int, hidden: int) -> list[tuple[str, tuple[Any, ...]]]:
    """One decode step's calls as rank 0 sends them."""
    lens = [context + i for i in range(batch)]
    tables = [list(range(i * 200, i * 200 + -(-n // BLOCK))) for i, n in enumerate(lens)]
    meta = build_attention_metadata([1] * batch, lens, tables, BLOCK, CPU)
    ids = torch.randint(0, 1000, (batch,))
    positions = torch.tensor([n - 1 for n in lens])
    return [("forward", (ids, positions, meta, (2, 16, 29))),
            ("logits", (torch.randn(batch, hidden).bfloat16(),))]


def torch_save(op: str, args: tuple[Any, ...]) -> bytes:
    buffer = io.BytesIO()
    torch.save((op, args), buffer)
    return buffer.getvalue()


class PipeSender:
    """The baseline: torch.save once, one pipe per receiver."""

    def __init__(self, num_receivers: int) -> None:
        self.pairs = [socket.socketpair() for _ in range(num_receivers)]
        self.pipes = [Connection(ours.detach()) for ours, _ in self.pairs]

    def receiver_args(self, index: int) -> tuple[list[str], int]:
        fd = self.pairs[index][1].fileno()
        return ["--fd", str(fd)], fd

    def send(self, op: str, args: tuple[Any, ...]) -> None:
        data = torch_save(op, args)
        for pipe in self.pipes:
            pipe.send_bytes(data)

    def started(self) -> None:
        for _, theirs in self.pairs:
            theirs.close()


class RingSender:
    """The step ring: codec frames written once."""

    def __init__(self, num_receivers: int) -> None:
        self.ring = RingWriter(num_receivers)

    def receiver_args(self, index: int) -> tuple[list[str], int]:
        return ["--fd", str(self.ring.fd), "--index", str(index)], self.ring.fd

    def send(self, op: str, args: tuple[Any, ...]) -> None:
        self.ring.write(encode(op, *args).frame)

    def started(self) -> None:
        """The readers mapped the ring; nothing to release."""


def messaging(transport: str, size: int, batch: int, args: argparse.Namespace
              ) -> dict[str, Any]:
    calls = step_calls(batch, args.context, args.hidden)
    sender: PipeSender | RingSender = (PipeSender if transport == "pipe" else RingSender)(
        size - 1)
    receivers, acks = [], []
    for i in range(size - 1):
        extra, fd = sender.receiver_args(i)
        ack_ours, ack_theirs = socket.socketpair()
        receivers.append(subprocess.Popen(
            [*SELF, "--receive", transport, *extra, "--ack-fd",
             str(ack_theirs.fileno()), "--steps", str(args.steps), "--calls", str(len(calls))],
            pass_fds=(fd, ack_theirs.fileno()), stdout=subprocess.PIPE, text=True, cwd=ROOT))
        ack_theirs.close()
        acks.append(Connection(ack_ours.detach()))
    sender.started()
    for ack in acks:  # every receiver is up (imports done) before the clock runs
        ack.recv_bytes()
    starts, send_s = [], []
    for _ in range(args.steps):
        time.sleep(args.gap_ms / 1e3)
        t0 = time.perf_counter()
        for op, call_args in calls:
            sender.send(op, call_args)
        send_s.append(time.perf_counter() - t0)
        starts.append(t0)
        for ack in acks:
            ack.recv_bytes()
    results = [json.loads(r.communicate(timeout=120)[0]) for r in receivers]
    skip = args.steps // 10  # the first steps warm caches and allocators up
    latency = sorted(max(r["done"][i] for r in results) - starts[i]
                     for i in range(skip, args.steps))
    return {"transport": transport, "tensor_parallel_size": size, "batch": batch,
            "send_us": round(statistics.median(send_s[skip:]) * 1e6, 1),
            "decode_us": round(statistics.median(r["decode_s"] for r in results) * 1e6, 1),
            "latency_us": round(statistics.median(latency) * 1e6, 1),
            "latency_p90_us": round(latency[int(0.9 * len(latency))] * 1e6, 1)}


def receive(args: argparse.Namespace) -> None:
    """A receiver process: read and decode every call; ack each step; print the times."""
    torch.set_num_threads(1)
    ack = Connection(args.ack_fd)
    if args.receive == "pipe":
        pipe = Connection(args.fd)

        def next_call() -> float:
            data = pipe.recv_bytes()
            t0 = time.perf_counter()
            torch.load(io.BytesIO(data), map_location=CPU, weights_only=False)
            return time.perf_counter() - t0
    else:
        reader = RingReader(args.fd, args.index)

        def next_call() -> float:
            frame = reader.read()
            t0 = time.perf_counter()
            decode(frame, CPU)
            return time.perf_counter() - t0

    ack.send_bytes(b"up")
    done, decode_s = [], []
    for _ in range(args.steps):
        decode_s.append(sum(next_call() for _ in range(args.calls)))
        done.append(time.perf_counter())
        ack.send_bytes(b"1")
    print(json.dumps({"done": done, "decode_s": statistics.median(decode_s)}))


def collectives(batch: int, hidden: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([*SELF, "--collective-rank", str(r), "--port", str(port),
                               "--batch", str(batch), "--hidden", str(hidden)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for r in (0, 1)]
    outputs = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    return {"batch": batch, "hidden": hidden, **outputs[0]}


def collective_rank(rank: int, port: int, batch: int, hidden: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    x = torch.randn(batch, hidden)
    reduce_s, send_s = [], []
    for i in range(350):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if i >= 50:
            reduce_s.append(time.perf_counter() - t0)
    for i in range(350):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        if i >= 50:
            send_s.append((time.perf_counter() - t0) / 2)
    dist.destroy_process_group()
    print(json.dumps({"all_reduce_us": round(statistics.median(reduce_s) * 1e6, 1),
                      "send_us": round(statistics.median(send_s) * 1e6, 1)}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="fixture", choices=("fixture", "fixture-moe"))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--messaging", action="store_true")
    parser.add_argument("--transports", nargs="+", default=["pipe", "ring"],
                        choices=("pipe", "ring"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--collectives", action="store_true")
    parser.add_argument("--json", type=Path)
    # A receiver of --messaging, a rank of --collectives (started by this tool).
    parser.add_argument("--collective-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--receive", choices=("pipe", "ring"), help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ack-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.receive:
        receive(args)
        return 0
    if args.collective_rank is not None:
        collective_rank(args.collective_rank, args.port, args.batch[0], args.hidden)
        return 0
    torch.set_num_threads(1)
    if args.collectives:
        rows = [collectives(b, args.hidden) for b in args.batch or [1, 32]]
        print(f"{'batch':>5} {'hidden':>6} {'all-reduce us':>13} {'send us':>8}")
        for row in rows:
            print(f"{row['batch']:>5} {row['hidden']:>6} {row['all_reduce_us']:>13} "
                  f"{row['send_us']:>8}")
    elif args.messaging:
        rows = [messaging(t, n, b, args) for b in args.batch or [1, 32] for n in args.sizes
                for t in args.transports]
        print(f"{'transport':>9} {'N':>2} {'batch':>5} {'send us':>8} {'decode us':>9} "
              f"{'latency us':>10} {'p90 us':>8}")
        for row in rows:
            print(f"{row['transport']:>9} {row['tensor_parallel_size']:>2} {row['batch']:>5} "
                  f"{row['send_us']:>8} {row['decode_us']:>9} {row['latency_us']:>10} "
                  f"{row['latency_p90_us']:>8}")
    else:
        batch = (args.batch or [4])[0]
        rows = [measure(args.model, size, args.tokens, batch, args.expert_parallel)
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
