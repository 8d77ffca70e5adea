"""Soak and fuzz: 32 concurrent clients drive one real daemon (front + scheduler,
speculation in its default auto mode) with a seeded random mix, for a bounded time:

* generates: prompts in the fixture's style (Python), as text, token ids or chat messages;
  max_tokens 1..10; greedy or sampled (temperature, top_k, top_p, min_p, seed); sometimes
  stop strings, logprobs, ignore_eos, speculative false; streamed or not; some streams are
  aborted after a few deltas, some connections dropped mid-stream;
* poison parameters the protocol accepts at their extremes (temperature 1e-40 and 1e300,
  top_p 5e-324, min_p 1.0, top_k 2**63 - 1, seed -2**63 and 2**64 - 1, max_tokens
  2**63 - 1, 16 stop strings of up to 256 characters ...): they must end normally;
* invalid requests (out of range, wrong types, unknown keys): `bad_request` (or
  `prompt_too_long`) for their id, on a connection that serves on; a duplicate id in flight
  (`duplicate_id`); an abort of an id not in flight (`not_found`);
* fuzzed frames on their own connections (random bodies, truncated msgpack, deep nesting,
  bodies up to the 4 MiB cap, wrong and huge length prefixes, zero lengths, truncated and
  stalled frames): the exact error frames a model of the framing predicts, then a clean
  close when the stream broke, and a live connection when only a body was bad.

Then: every request got exactly one terminal frame and no frame came for an id not in
flight; each output is consistent in itself (deltas + final = the final's counts, text =
the detokenized token ids cut at its stop string, logprobs one per token); greedy outputs
of one prompt agree wherever and however they ran (a token-prefix check across every
connection and batch); the front's counters count exactly the error and final frames the
clients saw; the daemon is alive, ready and idle with every KV block free; the front's RSS
grew by less than 100 MB from after the warm-up round to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer as HFTokenizer

from specd.ipc import messages as m
from specd.ipc.framing import DEFAULT_MAX_FRAME_BYTES, HEADER, FrameCodec
from specd.workers.config import FIXTURE_DIR
from tests.integration.daemon_harness import Daemon, model_under_test

SEED = 2025
NUM_CLIENTS = 32
ROUNDS = 2  # per client, after a short warm-up round; a round runs 2-4 operations at once
MAX_NEW_TOKENS = 10
WARM_UP_TOKENS = 3  # max_tokens in the warm-up round (it brings the front to its size)
FRAME_TIMEOUT_S = 2.0  # the daemon's --frame-timeout-s: how long a stalled frame costs
RUN_TIMEOUT_S = 300.0  # a lost request shows up as this timeout, with the ids still open
RSS_GROWTH_LIMIT = 100 * 2**20
HUGE = 2**63 - 1
MAX_FRAME = DEFAULT_MAX_FRAME_BYTES  # the daemon's default cap

PROMPTS = [  # short: prefill is most of the engine's work here
    "def fib(n):\n",
    "import os\n",
    "class Stack:\n",
    "for i in range(",
    "    return ",
    "try:\n    import ",
    "if __name__ ==",
    "# Sort a list\n",
    "s = 'café 日本'\n",
]
STOPS = ["\n\n", "return", ":", "(", "self", "def ", "  ", "é"]

# Sampling at the edges of what the protocol accepts, and whether the tokens must be the
# greedy ones (a filter that keeps only the most likely token; exact ties aside).
POISON: list[tuple[dict[str, Any], bool]] = [
    ({"temperature": 1e-40}, True),
    ({"temperature": 5e-324}, True),
    ({"temperature": 1.0, "top_p": 1e-300}, True),
    ({"temperature": 1.0, "top_p": 5e-324, "seed": 0}, True),
    ({"temperature": 0.8, "min_p": 1.0}, True),
    ({"temperature": 1.0, "top_k": 1}, True),
    ({"temperature": 1e-40, "top_p": 1e-300, "min_p": 1.0, "top_k": HUGE, "seed": 2**64 - 1},
     True),
    ({"stop_token_ids": [HUGE, 0]}, True),
    ({"stop": ["x" * 256] + [f"#{i}" for i in range(15)]}, True),
    ({"temperature": 1.0, "top_k": HUGE, "seed": -(2**63)}, False),
    ({"temperature": 1.0, "seed": 2**64 - 1, "logprobs": 20}, False),
    ({"temperature": 1.0, "seed": 2**63}, False),
    ({"temperature": 1e300}, False),
    ({"temperature": sys.float_info.max, "top_k": 0}, False),
    ({"temperature": 1e-5}, False),  # the greedy threshold itself: sampled
    ({"temperature": 0.7, "min_p": 5e-324, "top_p": 1.0, "top_k": 4097}, False),
]


def _gen(sampling: dict[str, Any] | None = None, **keys: Any) -> dict[str, Any]:
    request: dict[str, Any] = {"type": "generate", "prompt": "x = 1\n"}
    if sampling is not None:
        request["sampling"] = {"max_tokens": 2, **sampling}
    request.update(keys)
    return request


# Requests the front must refuse for their id, keeping the connection:
# (request without its id, error code, a fragment of the message).
INVALID: list[tuple[dict[str, Any], str, str]] = [
    (_gen({"temperature": -1.0}), "bad_request", "temperature"),
    (_gen({"temperature": float("nan")}), "bad_request", "temperature"),
    (_gen({"temperature": float("inf")}), "bad_request", "temperature"),
    (_gen({"temperature": "hot"}), "bad_request", "$.sampling.temperature"),
    (_gen({"top_p": 0.0}), "bad_request", "top_p"),
    (_gen({"top_p": 1.0000001}), "bad_request", "top_p"),
    (_gen({"min_p": 1.0000001}), "bad_request", "min_p"),
    (_gen({"min_p": -5e-324}), "bad_request", "min_p"),
    (_gen({"top_k": -2}), "bad_request", "top_k"),
    (_gen({"top_k": 2**63}), "bad_request", "top_k"),
    (_gen({"top_k": 1.0}), "bad_request", "$.sampling.top_k"),
    (_gen({"seed": 1.5}), "bad_request", "$.sampling.seed"),
    (_gen({"seed": "7"}), "bad_request", "$.sampling.seed"),
    (_gen({"max_tokens": 0}), "bad_request", "max_tokens"),
    (_gen({"max_tokens": 2**63}), "bad_request", "max_tokens"),
    (_gen({"max_tokens": True}), "bad_request", "$.sampling.max_tokens"),
    (_gen({"logprobs": 21}), "bad_request", "logprobs"),
    (_gen({"logprobs": -1}), "bad_request", "logprobs"),
    (_gen({"stop": [""]}), "bad_request", "non-empty"),
    (_gen({"stop": "\n"}), "bad_request", "$.sampling.stop"),
    (_gen({"stop": ["s"] * 17}), "bad_request", "17 stop strings"),
    (_gen({"stop": ["b" * 257]}), "bad_request", "longer than 256"),
    (_gen({"stop_token_ids": [-1]}), "bad_request", "stop_token_ids"),
    (_gen({"ignore_eos": 1}), "bad_request", "$.sampling.ignore_eos"),
    (_gen({"speculative": "no"}), "bad_request", "$.sampling.speculative"),
    (_gen({"beam_width": 4}), "bad_request", "unknown field `beam_width`"),
    (_gen(stream="yes"), "bad_request", "$.stream"),
    (_gen(deadline_s=0.0), "bad_request", "$.deadline_s"),
    (_gen(deadline_s=1e6), "bad_request", "$.deadline_s"),
    (_gen(colour="red"), "bad_request", "unknown field `colour`"),
    (_gen(prompt=12), "bad_request", "$.prompt"),
    (_gen(prompt=""), "bad_request", "encodes to no tokens"),
    (_gen(prompt_token_ids=[5]), "bad_request", "exactly one"),
    (_gen(prompt=None), "bad_request", "exactly one"),
    (_gen(prompt=None, prompt_token_ids=[]), "bad_request", "must not be empty"),
    (_gen(prompt=None, prompt_token_ids=[5, 2**31]), "bad_request", "$.prompt_token_ids[1]"),
    (_gen(prompt=None, prompt_token_ids=[5, 10**6]), "bad_request", "prompt token ids"),
    (_gen(prompt=None, prompt_token_ids=[5] * 4096), "prompt_too_long", "tokens"),
    (_gen(prompt=None, messages=[{"role": "", "content": "x"}]), "bad_request",
     "$.messages[0].role"),
    (_gen(prompt=None, messages="hi"), "bad_request", "$.messages"),
    ({"type": "teleport"}, "bad_request", "Invalid value 'teleport'"),
    ({"type": "abort"}, "bad_request", "`target`"),
    ({"type": "abort", "target": -1}, "bad_request", "$.target"),
    ({"type": "spec", "mode": "sometimes"}, "bad_request", "$.mode"),
    ({"type": "status", "verbose": True}, "bad_request", "unknown field `verbose`"),
]


def frame(obj: Any) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return HEADER.pack(len(body)) + body


def front_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


@dataclass
class Meta:
    """What a generate asked for, to judge its output by."""

    key: tuple[str, int]  # the prompt, for comparing greedy outputs
    prompt_ids: list[int] | None  # when known here (not for chat messages)
    greedy: bool
    max_tokens: int
    stops: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0
    speculative: bool = True
    ignore_eos: bool = False
    abort_after: int | None = None  # deltas to wait for before aborting it


@dataclass
class Call:
    """One request in flight on a checked connection and the frames it got."""

    conn: Conn
    id: int
    kind: str
    stream: bool = False
    duplicates: int = 0  # duplicate_id errors still expected for this id
    deltas: list[m.Delta] = field(default_factory=list)
    duplicate_errors: list[m.Error] = field(default_factory=list)
    terminal: m.ServerMessage | None = None
    terminal_seq: int = -1
    done: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    def __str__(self) -> str:
        return f"{self.conn.name} id {self.id} ({self.kind})"


class Conn:
    """A client connection that attributes every frame to a request in flight and reports
    any frame that has none (an id not open, a delta where none may come)."""

    def __init__(self, soak: Soak, name: str) -> None:
        self.soak = soak
        self.name = name
        self.open: dict[int, Call] = {}
        self.used: set[int] = set()
        self.next_id = 1
        self.seq = 0
        self.codec: FrameCodec[m.ServerMessage] = FrameCodec(m.ServerMessage, 2**24)

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_unix_connection(str(self.soak.path))
        self.task = asyncio.create_task(self._read())

    def new_id(self, rng: random.Random) -> int:
        """Ids in flight are unique here; every connection counts from 1 (the same ids on
        every connection), with now and then an extreme or a reused one."""
        choice = rng.random()
        if choice < 0.1:
            candidate = rng.choice([0, HUGE, rng.randrange(2**63)])
        elif choice < 0.2 and self.used:
            candidate = rng.choice(sorted(self.used))
        else:
            candidate = self.next_id
            self.next_id += 1
        while candidate in self.open:
            candidate = self.next_id
            self.next_id += 1
        self.used.add(candidate)
        return candidate

    def register(self, request_id: int, kind: str, stream: bool = False) -> Call:
        call = Call(self, request_id, kind, stream)
        self.open[request_id] = call
        return call

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def request(self, request: dict[str, Any], kind: str) -> Call:
        call = self.register(request["id"], kind,
                             kind == "generate" and request.get("stream", True))
        await self.send(frame(request))
        return call

    async def _read(self) -> None:
        partial = b""
        try:
            while data := await self.reader.read(2**16):
                bodies, partial = self.codec.split(partial + data)
                for body in bodies:
                    self._on_reply(self.codec.decode(body))
        except Exception as exc:  # noqa: BLE001 - reported, then every open call ends
            self.soak.problem(f"{self.name}: reading replies failed: {exc!r}")
        for call in self.open.values():
            self.soak.problem(f"{call}: the connection closed while it was in flight")
            call.done.set()
        self.open.clear()

    def _on_reply(self, reply: m.ServerMessage) -> None:
        self.seq += 1
        call = self.open.get(reply.id) if reply.id is not None else None
        if call is None:
            self.soak.problem(f"{self.name}: a frame for id {reply.id}, which is not in "
                              f"flight: {reply!r:.300}")
            return
        call.progress.set()
        if isinstance(reply, m.Delta):
            if not call.stream:
                self.soak.problem(f"{call}: a delta, not asked for: {reply!r:.200}")
            call.deltas.append(reply)
            return
        if isinstance(reply, m.Error) and reply.code == "duplicate_id" and call.duplicates:
            call.duplicates -= 1
            call.duplicate_errors.append(reply)
            self.soak.errors[reply.code] += 1
            return
        call.terminal = reply
        call.terminal_seq = self.seq
        del self.open[reply.id]
        if isinstance(reply, m.Error):
            self.soak.errors[reply.code] += 1
        call.done.set()

    async def close(self) -> None:
        for call in self.open.values():
            self.soak.problem(f"{call}: still in flight when its client finished")
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()
        await self.task


class Soak:
    def __init__(self, daemon: Daemon, tokenizer: HFTokenizer, resolved: dict[str, Any]) -> None:
        self.daemon = daemon
        self.path = daemon.socket_path
        self.tok = tokenizer
        self.eos = set(resolved["eos_token_ids"])
        self.request_codec: FrameCodec[m.ClientMessage] = FrameCodec(m.ClientMessage, MAX_FRAME)
        self.prompt_ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in PROMPTS]
        self.problems: list[str] = []
        self.errors: Counter[str] = Counter()  # error frames seen, by code
        self.finals: Counter[str] = Counter()  # final frames seen, by finish reason
        self.output_tokens = 0
        self.ops: Counter[str] = Counter()
        self.greedy: dict[tuple[str, int], list[tuple[list[int], str]]] = {}
        self.conns: list[Conn] = []
        self.rss: list[int] = []
        self.rss_after_warmup = 0
        self.warm_up_s = 0.0
        self.go_on = False  # past the warm-up round
        self.warm = asyncio.Barrier(NUM_CLIENTS + 1)
        self.go = asyncio.Barrier(NUM_CLIENTS + 1)

    def problem(self, text: str) -> None:
        self.problems.append(text)

    # ---- the run -----------------------------------------------------------------------

    async def run(self) -> None:
        sampler = asyncio.create_task(self._sample_rss())
        clients = asyncio.gather(*(self.client(i) for i in range(NUM_CLIENTS)))
        started = time.monotonic()
        try:
            async with asyncio.timeout(RUN_TIMEOUT_S):
                with contextlib.suppress(asyncio.BrokenBarrierError):  # a client failed
                    await self.warm.wait()
                    self.warm_up_s = time.monotonic() - started
                    self.rss_after_warmup = front_rss(self.daemon.process.pid)
                    self.go_on = True
                    await self.go.wait()
                await clients
        except TimeoutError:
            lost = [str(call) for conn in self.conns for call in conn.open.values()]
            self.problem(f"the soak did not end within {RUN_TIMEOUT_S} s; still in flight "
                         f"(lost?): {lost[:20]}")
        finally:
            clients.cancel()
            sampler.cancel()
        self.rss.append(front_rss(self.daemon.process.pid))

    async def _sample_rss(self) -> None:
        while True:
            self.rss.append(front_rss(self.daemon.process.pid))
            await asyncio.sleep(0.5)

    async def client(self, index: int) -> None:
        rng = random.Random(SEED * 1000 + index)
        conn = Conn(self, f"client {index}")
        self.conns.append(conn)
        try:
            await conn.connect()
            for round_number in range(ROUNDS + 1):
                ops = [self.pick(rng) for _ in range(rng.randint(2, 4))]
                if round_number == 0 and index < 3:
                    ops.append("large")  # frames of megabytes before the baseline is taken
                seeds = [rng.randrange(2**32) for _ in ops]
                await asyncio.gather(*(self.run_op(op, conn, random.Random(seed))
                                       for op, seed in zip(ops, seeds, strict=True)))
                if round_number == 0:
                    await self.warm.wait()
                    await self.go.wait()
            await conn.close()
        except Exception as exc:  # noqa: BLE001 - reported; the others need not wait for it
            self.problem(f"{conn.name} failed: {exc!r}")
            await self.warm.abort()
            await self.go.abort()

    @staticmethod
    def pick(rng: random.Random) -> str:
        ops, weights = zip(*[("generate", 34), ("poison", 14), ("invalid", 16), ("fuzz", 14),
                             ("abort", 7), ("query", 5), ("not_found", 4), ("duplicate", 3),
                             ("disconnect", 3)], strict=True)
        return rng.choices(ops, weights)[0]

    async def run_op(self, op: str, conn: Conn, rng: random.Random) -> None:
        self.ops[op] += 1
        try:
            await self._run_op(op, conn, rng)
        except Exception:  # noqa: BLE001 - reported with the rest
            self.problem(f"{conn.name}: {op} raised:\n{traceback.format_exc()}")

    async def _run_op(self, op: str, conn: Conn, rng: random.Random) -> None:
        if op in ("generate", "poison", "abort"):
            await self.generate(conn, rng, op)
        elif op == "invalid":
            await self.invalid(conn, rng)
        elif op == "query":
            await self.query(conn, rng)
        elif op == "not_found":
            await self.abort_unknown(conn, rng)
        elif op == "duplicate":
            await self.duplicate(conn, rng)
        elif op == "disconnect":
            await self.disconnect(rng)
        else:
            await self.fuzz(rng, large=op == "large")

    # ---- requests on a checked connection ----------------------------------------------

    def make_generate(self, conn: Conn, rng: random.Random, op: str
                      ) -> tuple[dict[str, Any], Meta]:
        p = rng.randrange(len(PROMPTS))
        request: dict[str, Any] = {"type": "generate", "id": conn.new_id(rng)}
        form = rng.random()
        key = ("prompt", p)
        prompt_ids: list[int] | None = self.prompt_ids[p]
        if form < 0.75:
            request["prompt"] = PROMPTS[p]
        elif form < 0.92:
            request["prompt_token_ids"] = prompt_ids
        else:
            request["messages"] = [{"role": "user", "content": PROMPTS[p]}]
            key, prompt_ids = ("chat", p), None
        sampling: dict[str, Any]
        if op == "poison":
            poison, greedy = rng.choice(POISON)
            sampling = dict(poison)
        elif rng.random() < 0.5:
            sampling, greedy = rng.choice([{}, {"temperature": 0.0}]), True
        else:
            greedy = False
            sampling = {"temperature": round(rng.uniform(0.2, 1.5), 3),
                        "top_k": rng.choice([-1, 0, 5, 40, 1000]),
                        "top_p": rng.choice([1.0, 0.9, 0.5]),
                        "min_p": rng.choice([0.0, 0.0, 0.05, 0.2]),
                        "seed": rng.choice([None, rng.randrange(2**32)])}
        sampling["max_tokens"] = rng.randint(1, MAX_NEW_TOKENS if self.go_on else WARM_UP_TOKENS)
        if op != "poison":
            if rng.random() < 0.2:
                sampling["stop"] = rng.sample(STOPS, rng.randint(1, 3))
            if rng.random() < 0.2:
                sampling["logprobs"] = rng.randint(1, 5)
            if rng.random() < 0.2:
                sampling["speculative"] = False
            if rng.random() < 0.3:
                sampling["ignore_eos"] = True
        request["stream"] = rng.random() < 0.6
        if rng.random() < 0.1:
            request["deadline_s"] = RUN_TIMEOUT_S
        abort_after = None
        if op == "abort":
            request["stream"] = True
            abort_after = rng.randint(1, 3 if self.go_on else 1)
            sampling["max_tokens"] = rng.choice([rng.randint(4, 16), HUGE])
        request["sampling"] = sampling
        return request, Meta(
            key=key, prompt_ids=prompt_ids, greedy=greedy, max_tokens=sampling["max_tokens"],
            stops=tuple(sampling.get("stop", ())),
            stop_token_ids=tuple(sampling.get("stop_token_ids", ())),
            logprobs=sampling.get("logprobs", 0), speculative=sampling.get("speculative", True),
            ignore_eos=sampling.get("ignore_eos", False), abort_after=abort_after)

    async def generate(self, conn: Conn, rng: random.Random, op: str) -> None:
        request, meta = self.make_generate(conn, rng, op)
        call = await conn.request(request, "generate")
        if meta.abort_after is not None:
            await self.abort_mid_stream(conn, call, meta.abort_after, rng)
        await call.done.wait()
        self.check_generate(call, meta)

    async def abort_mid_stream(self, conn: Conn, call: Call, after: int,
                               rng: random.Random) -> None:
        while len(call.deltas) < after and not call.done.is_set():
            call.progress.clear()
            await call.progress.wait()
        ended_before = call.done.is_set()
        abort = await conn.request({"type": "abort", "id": conn.new_id(rng),
                                    "target": call.id}, "abort")
        await asyncio.gather(call.done.wait(), abort.done.wait())
        final, reply = call.terminal, abort.terminal
        aborted = isinstance(final, m.Final) and final.finish_reason == "abort"
        if aborted and not ended_before:
            expected: tuple[str, str | None] = ("Ack", None)
        else:
            expected = ("Error", "not_found")
        got = (type(reply).__name__, getattr(reply, "code", None))
        if got != expected:
            self.problem(f"{abort} of {call.id}: {reply!r:.200}, expected {expected} after "
                         f"{final!r:.200}")
        elif abort.terminal_seq < call.terminal_seq:
            self.problem(f"{abort}: answered before the final of {call.id}")

    def check_generate(self, call: Call, meta: Meta) -> None:
        final = call.terminal
        if not isinstance(final, m.Final):
            self.problem(f"{call}: ended with {final!r:.300} instead of a final")
            return
        self.finals[final.finish_reason] += 1
        self.output_tokens += final.num_output_tokens
        ids = [t for d in call.deltas for t in d.token_ids] + list(final.token_ids)
        text = "".join(d.text for d in call.deltas) + final.text
        logprobs = [x for d in call.deltas for x in d.logprobs] + list(final.logprobs)
        where = f"{call} {meta}"
        bad: list[str] = []
        reason = final.finish_reason
        if final.num_output_tokens != len(ids):
            bad.append(f"num_output_tokens {final.num_output_tokens}, {len(ids)} token ids")
        if len(ids) > meta.max_tokens or (reason == "length" and len(ids) != meta.max_tokens):
            bad.append(f"{len(ids)} tokens, finish {reason}")
        if reason not in ("length", "stop", "abort") or (
                reason == "abort" and meta.abort_after is None):
            bad.append(f"finish_reason {reason}")
        ends = set(meta.stop_token_ids) | (set() if meta.ignore_eos else self.eos)
        if any(t in ends for t in ids[:-1]):
            bad.append(f"went on past an end token: {ids}")
        if reason == "stop" and final.stop_string is None and (not ids or ids[-1] not in ends):
            bad.append(f"finish stop without a stop string or an end token: {ids}")
        if meta.prompt_ids is not None and final.num_prompt_tokens != len(meta.prompt_ids):
            bad.append(f"num_prompt_tokens {final.num_prompt_tokens}, "
                       f"expected {len(meta.prompt_ids)}")
        if final.num_accepted > final.num_drafted or (not meta.speculative
                                                      and final.num_drafted):
            bad.append(f"drafted {final.num_drafted}, accepted {final.num_accepted}")
        if meta.logprobs:
            if len(logprobs) != len(ids):
                bad.append(f"{len(logprobs)} logprobs for {len(ids)} tokens")
            for token, lp in zip(ids, logprobs, strict=False):
                if not (len(lp.top_ids) == len(lp.top_logprobs) == meta.logprobs
                        and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
                        and lp.logprob <= lp.top_logprobs[0] + 1e-4
                        and (not meta.greedy or lp.top_ids[0] == token)):
                    bad.append(f"logprob {lp} for token {token}")
                    break
        elif logprobs:
            bad.append("logprobs that were not asked for")
        full = self.tok.decode(ids, skip_special_tokens=True)
        hits = {s: full.find(s) for s in meta.stops if s in full}
        cut = full[:min(hits.values())] if hits else full
        if text != cut:
            bad.append(f"text {text!r} is not its tokens' {cut!r}")
        if hits and hits.get(final.stop_string or "") != min(hits.values()):
            bad.append(f"stop_string {final.stop_string!r}, the first in {full!r} is another")
        if (not hits and final.stop_string is not None) or (
                final.stop_string is not None and reason != "stop"):
            bad.append(f"stop_string {final.stop_string!r}, finish {reason}")
        if bad:
            self.problem(f"{where}: " + "; ".join(bad))
        if meta.greedy:
            self.greedy.setdefault(meta.key, []).append((ids, where))

    async def invalid(self, conn: Conn, rng: random.Random) -> None:
        template, code, fragment = rng.choice(INVALID)
        call = await conn.request({**template, "id": conn.new_id(rng)}, "invalid")
        await call.done.wait()
        reply = call.terminal
        if not (isinstance(reply, m.Error) and reply.code == code and fragment in reply.message):
            self.problem(f"{call} {template!r:.200}: {reply!r:.300}, expected {code} "
                         f"naming {fragment!r}")

    async def query(self, conn: Conn, rng: random.Random) -> None:
        kind = rng.choice(["status", "stats"])
        call = await conn.request({"type": kind, "id": conn.new_id(rng)}, kind)
        await call.done.wait()
        reply = call.terminal
        if kind == "status" and not (isinstance(reply, m.StatusReply)
                                     and reply.state == "ready"):
            self.problem(f"{call}: {reply!r:.300}")
        if kind == "stats" and not isinstance(reply, m.StatsReply):
            self.problem(f"{call}: {reply!r:.300}")

    async def abort_unknown(self, conn: Conn, rng: random.Random) -> None:
        target = rng.randrange(2**63)
        while target in conn.open:
            target = rng.randrange(2**63)
        call = await conn.request({"type": "abort", "id": conn.new_id(rng), "target": target},
                                  "abort")
        await call.done.wait()
        if not (isinstance(call.terminal, m.Error) and call.terminal.code == "not_found"):
            self.problem(f"{call} of {target}: {call.terminal!r:.300}, expected not_found")

    async def duplicate(self, conn: Conn, rng: random.Random) -> None:
        """A generate, then at once another with the same id (and another prompt)."""
        request, meta = self.make_generate(conn, rng, "generate")
        request["sampling"] = {"max_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
        meta = Meta(meta.key, meta.prompt_ids, greedy=True, max_tokens=MAX_NEW_TOKENS,
                    ignore_eos=True)
        other = {"type": "generate", "id": request["id"], "prompt": PROMPTS[0][::-1]}
        call = conn.register(request["id"], "generate", request["stream"])
        call.duplicates = 1
        await conn.send(frame(request) + frame(other))
        await call.done.wait()
        if call.duplicates or len(call.duplicate_errors) != 1:
            self.problem(f"{call}: {len(call.duplicate_errors)} duplicate_id errors")
        self.check_generate(call, meta)

    async def disconnect(self, rng: random.Random) -> None:
        """A stream that would never end; the client leaves after its first delta."""
        reader, writer = await asyncio.open_unix_connection(str(self.path))
        p = rng.randrange(len(PROMPTS))
        writer.write(frame({"type": "generate", "id": 1, "prompt": PROMPTS[p],
                            "sampling": {"max_tokens": HUGE, "ignore_eos": True}}))
        replies, _ = await self.read_replies(reader, 1)
        if not (len(replies) == 1 and isinstance(replies[0], m.Delta) and replies[0].id == 1):
            self.problem(f"disconnect: {replies!r:.300}, expected a delta")
        if rng.random() < 0.5:
            writer.transport.abort()
        else:
            writer.close()

    # ---- fuzzed frames on their own connections ----------------------------------------

    async def read_replies(self, reader: asyncio.StreamReader, count: int | None = None
                           ) -> tuple[list[m.ServerMessage], bool]:
        """`count` frames, or (None) every frame up to the end; and whether it ended."""
        codec: FrameCodec[m.ServerMessage] = FrameCodec(m.ServerMessage, 2**24)
        replies: list[m.ServerMessage] = []
        partial = b""
        async with asyncio.timeout(60):
            while count is None or len(replies) < count:
                try:
                    data = await reader.read(2**16)
                except ConnectionResetError:  # it closed with our bytes unread: an end
                    data = b""
                if not data:
                    if partial:
                        self.problem(f"fuzz: the daemon's last frame was cut: {partial!r:.100}")
                    return replies, True
                bodies, partial = codec.split(partial + data)
                replies += [codec.decode(body) for body in bodies]
        return replies, False

    def fails_to_decode(self, body: bytes) -> bool:
        try:
            self.request_codec.decode(body)
        except msgspec.DecodeError:
            return True
        return False

    def bad_body(self, rng: random.Random) -> bytes:
        """A frame with a sound length and a body that is no valid request."""
        while True:
            kind = rng.randrange(8)
            if kind == 0:
                body = rng.randbytes(rng.randint(1, 64))
            elif kind == 1:  # valid msgpack, cut short
                whole = msgspec.msgpack.encode(self.some_request(rng))
                body = whole[:rng.randint(1, len(whole) - 1)]
            elif kind == 2:  # nested arrays or maps in a value skipped before the tag
                depth = rng.choice([rng.randint(1, 3000), rng.randint(3000, 1_000_000)])
                deep = rng.choice([b"\x91", b"\x81\xa1k"]) * depth + b"\xc0"
                body = (b"\x83" + msgspec.msgpack.encode("prompt") + deep
                        + msgspec.msgpack.encode("id") + b"\x01"
                        + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("generate"))
            elif kind == 3:  # nested where a map is expected
                body = b"\x91" * rng.randint(1, 100_000) + b"\xc0"
            elif kind == 4:  # msgpack values that are not a map
                body = msgspec.msgpack.encode(rng.choice(
                    [1, -5, 2**64 - 1, "generate", None, True, 1.5, [1, 2], b"\x00", {}]))
            elif kind == 5:  # reserved bytes, ext types
                body = rng.choice([b"\xc1", b"\xc1" * 7, b"\xd4\x01\x00", b"\xc7\x00\x05"])
            elif kind == 6:  # a request with one value replaced by junk
                request = self.some_request(rng)
                request[rng.choice(sorted(request))] = rng.choice(
                    [None, -1, 2**64 - 1, "", "x" * 300, [None], {"a": 1}, 1e309, b"\xff"])
                body = msgspec.msgpack.encode(request)
            else:  # no id or a mistyped one: an error that belongs to the connection
                body = msgspec.msgpack.encode(rng.choice([
                    {"type": "generate", "prompt": "x"}, {"type": "status", "id": "1"},
                    {"id": 1}, {"type": "status", "id": 1.0}, {"type": 7, "id": 1}]))
            if self.fails_to_decode(body):
                return HEADER.pack(len(body)) + body

    @staticmethod
    def some_request(rng: random.Random) -> dict[str, Any]:
        return rng.choice([
            {"type": "generate", "id": rng.randrange(2**63), "prompt": rng.choice(PROMPTS),
             "sampling": {"max_tokens": 3, "temperature": 0.5}, "stream": False},
            {"type": "status", "id": rng.randrange(2**63)},
            {"type": "abort", "id": 3, "target": 4}])

    def large_body(self, rng: random.Random) -> bytes:
        """A bad body of megabytes, within the frame cap."""
        size = rng.randint(2**20, MAX_FRAME - 64)
        if rng.random() < 0.5:
            body = b"\xc1" + rng.randbytes(size)
        else:  # a prompt of megabytes, then a key that does not exist
            body = msgspec.msgpack.encode({"type": "generate", "id": 1, "prompt": "y" * size,
                                           "colour": 1})
        assert self.fails_to_decode(body)
        return HEADER.pack(len(body)) + body

    def broken_stream(self, rng: random.Random) -> bytes:
        """Bytes after which the frame layer is out of step: a bad, huge or zero length, a
        length that does not match its body, a frame or header cut short, raw junk."""
        kind = rng.randrange(6)
        body = msgspec.msgpack.encode(self.some_request(rng))
        if kind == 0:
            length = rng.choice([MAX_FRAME + 1, 2**32 - 1, rng.randint(MAX_FRAME + 1, 2**32 - 1)])
            return HEADER.pack(length) + rng.randbytes(rng.randint(0, 16))
        if kind == 1:
            return b"\x00\x00\x00\x00" + rng.randbytes(rng.randint(0, 8))
        if kind == 2:
            delta = rng.choice([d for d in range(1 - len(body), 41) if d])
            tail = frame({"type": "status", "id": 5}) if rng.random() < 0.5 else b""
            return HEADER.pack(len(body) + delta) + body + tail
        if kind == 3:
            return HEADER.pack(len(body)) + body[:rng.randint(0, len(body) - 1)]
        if kind == 4:
            return HEADER.pack(len(body))[:rng.randint(1, 3)]
        return rng.randbytes(rng.randint(1, 64))

    def expected_codes(self, data: bytes) -> tuple[list[str], bool] | None:
        """The error codes the daemon answers `data` with before the stream ends, from a
        model of the frame layer, and whether the last is for a frame still incomplete
        (the daemon waits for the rest); None when a frame in it is a valid request."""
        codes: list[str] = []
        offset = 0
        while offset < len(data):
            if len(data) - offset < HEADER.size:
                return [*codes, "bad_frame"], True
            (length,) = HEADER.unpack_from(data, offset)
            end = offset + HEADER.size + length
            if length == 0 or length > MAX_FRAME:
                return [*codes, "bad_frame"], False
            if end > len(data):
                return [*codes, "bad_frame"], True
            if not self.fails_to_decode(data[offset + HEADER.size:end]):
                return None
            codes.append("bad_request")
            offset = end
        return codes, False

    async def fuzz(self, rng: random.Random, large: bool) -> None:
        """Bad bodies then a status query (answered: the connection lives on); then, mostly,
        a broken stream, answered with exactly the frames `expected_codes` predicts and an
        end; sometimes cut short and left stalled (bad_frame after the frame timeout)."""
        bodies = [self.bad_body(rng) for _ in range(rng.randint(1, 3))]
        if large:
            bodies.insert(rng.randrange(len(bodies) + 1), self.large_body(rng))
        status_id = rng.randrange(2**63)
        reader, writer = await asyncio.open_unix_connection(str(self.path))
        try:
            writer.write(b"".join(bodies) + frame({"type": "status", "id": status_id}))
            replies, ended = await self.read_replies(reader, len(bodies) + 1)
            got = [(type(r).__name__, getattr(r, "code", None)) for r in replies]
            want = [("Error", "bad_request")] * len(bodies) + [("StatusReply", None)]
            if got != want or replies[-1].id != status_id:
                self.problem(f"fuzz {[b[:24] for b in bodies]!r:.300}: got {replies!r:.500}")
            self.count_errors(replies)
            broken, incomplete = b"", False  # mostly replaced by a broken stream
            want_codes: list[str] = []
            while not broken and rng.random() < 0.7:
                data = self.broken_stream(rng)
                model = self.expected_codes(data)
                if model is not None:
                    broken, (want_codes, incomplete) = data, model
            stall = incomplete and rng.random() < 0.15
            if broken:
                with contextlib.suppress(OSError):  # it may close before taking it all
                    writer.write(broken)
                    await writer.drain()
            if not stall:
                with contextlib.suppress(OSError):
                    writer.write_eof()
            started = time.monotonic()
            replies, ended = await self.read_replies(reader)
            self.count_errors(replies)
            got_codes = [getattr(r, "code", type(r).__name__) for r in replies]
            if got_codes != want_codes or not ended:
                self.problem(f"fuzz {broken!r:.200}: got {replies!r:.300}, expected "
                             f"{want_codes} and the end")
            if stall and time.monotonic() - started < FRAME_TIMEOUT_S * 0.9:
                self.problem(f"fuzz {broken!r:.200}: a stalled frame ended too soon")
        finally:
            writer.close()

    def count_errors(self, replies: list[m.ServerMessage]) -> None:
        for reply in replies:
            if isinstance(reply, m.Error):
                self.errors[reply.code] += 1

    # ---- after the run -----------------------------------------------------------------

    def check_greedy(self) -> int:
        """Greedy outputs of a prompt agree (each is a prefix of the longest); returns how
        many outputs were compared with another."""
        compared = 0
        for key, outputs in self.greedy.items():
            longest, where = max(outputs, key=lambda o: len(o[0]))
            for ids, other in outputs:
                if longest[:len(ids)] != ids:
                    self.problem(f"greedy outputs of {key} disagree: {other}: {ids} vs "
                                 f"{where}: {longest}")
            compared += len(outputs) if len(outputs) > 1 else 0
        return compared


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # float32: greedy outputs are compared across batches of every shape (see test_daemon).
    d = Daemon(tmp_path_factory.mktemp("soak"), "--dtype", "float32",
               "--max-connections", "256", "--frame-timeout-s", str(FRAME_TIMEOUT_S))
    try:
        yield d.wait_ready()
    finally:
        d.stop()


def _tokenizer() -> HFTokenizer:
    return HFTokenizer.from_file(str(Path(model_under_test() or FIXTURE_DIR) / "tokenizer.json"))


@pytest.mark.slow  # about a minute
def test_soak_and_fuzz_32_clients(daemon: Daemon) -> None:
    with daemon.client() as client:
        resolved = client.status().resolved
        before = client.stats()["front"]
    soak = Soak(daemon, _tokenizer(), resolved)
    started = time.monotonic()
    asyncio.run(soak.run())
    elapsed = time.monotonic() - started
    compared = soak.check_greedy()

    assert daemon.process.poll() is None, "the daemon exited"
    with daemon.client() as client:
        deadline = time.monotonic() + 10  # aborts and closes cross the steps in flight
        while True:
            stats = client.stats()
            engine = stats["engine"]
            if (engine["num_running"] == engine["num_waiting"] == 0
                    and engine["num_free_kv_blocks"] == engine["num_kv_blocks"]
                    and stats["connections"] == 1 or time.monotonic() > deadline):
                break
            time.sleep(0.1)
        status = client.status()
    front = Counter(stats["front"]) - Counter(before)
    growth = soak.rss[-1] - soak.rss_after_warmup
    spec = {k: round(engine[k], 1) for k in (
        "num_steps", "num_verify_passes", "num_drafted", "num_accepted", "spec_transitions",
        "draft_s", "verify_s", "catch_up_s")}
    summary = (f"soak: {elapsed:.1f} s (warm-up round {soak.warm_up_s:.1f} s), engine {spec}, "
               f"ops {dict(soak.ops)}, finals {dict(soak.finals)}, "
               f"errors {dict(soak.errors)}, "
               f"{soak.output_tokens} tokens, {compared} greedy "
               f"outputs compared in {len(soak.greedy)} prompts; front RSS "
               f"{soak.rss_after_warmup / 2**20:.0f} MB after warm-up, max "
               f"{max(soak.rss) / 2**20:.0f}, end {soak.rss[-1] / 2**20:.0f}")
    print(summary)
    assert not soak.problems, f"{len(soak.problems)} problems:\n" + "\n".join(
        soak.problems[:40]) + "\n" + summary

    assert status.state == "ready" and status.num_open_requests == 0, status
    assert engine["num_running"] == engine["num_waiting"] == 0, engine
    assert engine["num_free_kv_blocks"] == engine["num_kv_blocks"], engine
    assert engine["num_requests_failed"] == engine["num_step_failures"] == 0, engine
    assert stats["open_requests"] == 0 and stats["connections"] == 1, stats
    # The front counted exactly the frames the clients saw.
    seen = Counter({f"error_{code}": n for code, n in soak.errors.items()})
    seen.update({f"finished_{reason}": n for reason, n in soak.finals.items()})
    seen["output_tokens"] = soak.output_tokens
    counted = {k: v for k, v in front.items() if k.startswith(("error_", "finished_", "output_"))}
    assert counted == dict(+seen), summary
    assert len(daemon.events("client_gone")) == soak.ops["disconnect"]
    assert not daemon.events("internal_error") and not daemon.events("scheduler_failed")

    # The mix did what it is for: every kind of operation ran, outputs were compared.
    assert set(soak.ops) >= {"generate", "poison", "invalid", "fuzz", "abort", "query",
                             "not_found", "duplicate", "disconnect", "large"}, soak.ops
    assert soak.finals["abort"] and soak.errors["bad_frame"] and compared >= 50, summary
    assert growth < RSS_GROWTH_LIMIT, summary


def test_a_stop_string_in_the_last_step_finishes_with_stop(daemon: Daemon) -> None:
    tok = _tokenizer()
    with daemon.client() as client:
        ids = client.generate(PROMPTS[0], max_tokens=8, ignore_eos=True).token_ids
        # The first token whose text brings a string not seen before: as a stop string, it
        # matches in the step that produces that token, and no earlier.
        for k in range(1, len(ids) + 1):
            before, now = tok.decode(ids[:k - 1]), tok.decode(ids[:k])
            stop = now[len(before):].strip()
            if now.startswith(before) and stop and stop not in before:
                break
        else:
            pytest.fail(f"no token of {ids} brings text not seen before")
        result = client.generate(PROMPTS[0], max_tokens=k, ignore_eos=True, stop=(stop,))
    if result.stop_string != stop or result.text != now[:now.index(stop)]:
        pytest.fail(f"stop string {stop!r} not applied: {result}")  # not the bug: fails
    assert result.finish_reason == "stop"  # the bug: "length"
