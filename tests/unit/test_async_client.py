"""The asyncio client's waiting for an answer: a cancellation is never lost, even when it
arrives together with the answer (Python 3.11's `asyncio.wait_for` returned the answer and
dropped the cancellation there, and the benchmark's stats sampler, cancelled at the end of
a point, ran on forever: a sweep hung after 59 points)."""

from __future__ import annotations

import asyncio

import pytest

from specd.ipc import messages as m
from specd.ipc.async_client import AsyncClient
from specd.ipc.errors import ClientTimeout, SpecdError


def test_a_cancellation_arriving_with_the_answer_cancels() -> None:
    async def scenario() -> None:
        client = AsyncClient("/nonexistent.sock", timeout=5.0)
        inbox: asyncio.Queue[m.ServerMessage | SpecdError] = asyncio.Queue()
        waiter = asyncio.create_task(client._next(inbox))
        await asyncio.sleep(0)  # the waiter now waits on the empty inbox
        inbox.put_nowait(m.Ack(1, "ok"))  # the answer arrives...
        waiter.cancel()  # ... in the same turn of the loop as the cancellation
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(scenario())


def test_no_answer_within_the_timeout_raises_client_timeout() -> None:
    async def scenario() -> None:
        client = AsyncClient("/nonexistent.sock", timeout=0.05)
        inbox: asyncio.Queue[m.ServerMessage | SpecdError] = asyncio.Queue()
        with pytest.raises(ClientTimeout, match="no answer within 0.05 s"):
            await client._next(inbox)

    asyncio.run(scenario())
