"""The benchmark's client: the asyncio client plus a stream that keeps the arrival time of
every delta (`timed_request`, one `RequestRecord` per request) and the speculation switch."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from specd.ipc import messages as m
from specd.ipc.async_client import AsyncClient
from specd.ipc.errors import ProtocolError
from specd.ipc.generation import make_generate
from specd.ipc.sampling import SamplingParams


@dataclass(frozen=True)
class RequestRecord:
    """One finished request, timed from the moment it was sent (seconds).

    num_received: token ids that arrived in Delta/Final frames; num_output_tokens: the
    Final's own count (the two must agree). acceptance_length: tokens per target step
    (1.0 for a request that never speculated)."""

    ttft_s: float
    latency_s: float
    itl_s: tuple[float, ...]
    num_received: int
    num_output_tokens: int
    num_prompt_tokens: int
    num_drafted: int
    num_accepted: int
    acceptance_length: float

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first."""
        return (self.latency_s - self.ttft_s) / max(1, self.num_output_tokens - 1)


class BenchClient(AsyncClient):
    """The asyncio client plus what a benchmark needs: a stream that keeps the Final frame
    and the arrival time of every delta, and the speculation switch."""

    async def timed_request(self, prompt: str, sampling: SamplingParams,
                            on_tokens: Callable[[float, int], None] | None = None
                            ) -> RequestRecord:
        """Stream one request to its end; `on_tokens(time, count)` is called for every
        frame that carries tokens, as it arrives."""
        request = make_generate(next(self._ids), prompt, None, None, sampling, True, None, {})
        started = time.perf_counter()
        inbox = await self._send(request)
        arrivals: list[tuple[float, int]] = []  # (time, token ids in the frame)
        try:
            while True:
                reply = await self._next(inbox)
                now = time.perf_counter()
                if isinstance(reply, m.Delta | m.Final) and reply.token_ids:
                    arrivals.append((now, len(reply.token_ids)))
                    if on_tokens is not None:
                        on_tokens(now, len(reply.token_ids))
                if isinstance(reply, m.Final):
                    return _record(started, now, arrivals, reply)
        finally:
            self._inboxes.pop(request.id, None)

    async def set_spec(self, mode: str, threshold: int | None = None) -> str:
        reply = await self._query(m.SetSpec(next(self._ids), mode, threshold))
        if not isinstance(reply, m.Ack):
            raise ProtocolError(f"expected an ack, got {type(reply).__name__}")
        return reply.message


def _record(started: float, ended: float, arrivals: list[tuple[float, int]],
            final: m.Final) -> RequestRecord:
    if not arrivals:
        raise ProtocolError(f"request {final.id} ended ({final.finish_reason}) without tokens")
    times = [t for t, _ in arrivals]
    return RequestRecord(
        ttft_s=times[0] - started,
        latency_s=ended - started,
        itl_s=tuple(b - a for a, b in itertools.pairwise(times)),
        num_received=sum(n for _, n in arrivals),
        num_output_tokens=final.num_output_tokens,
        num_prompt_tokens=final.num_prompt_tokens,
        num_drafted=final.num_drafted,
        num_accepted=final.num_accepted,
        acceptance_length=final.acceptance_length if final.num_drafted else 1.0,
    )
