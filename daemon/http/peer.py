"""One HTTP request's end of the request flow: where the flow's frames for it go.

The socket's `Connection` writes frames to its client; an `HttpPeer` keeps them for the
request's handler, which turns them into OpenAI objects. It has the connection's
interface (`connection_id`, `send`, `reject`), so the request flow admits, ends and
aborts an HTTP request exactly as a socket one.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from specd.ipc import messages as m


class HttpPeer:
    """Frames for one request (or one stats query), taken by its handler with `receive`.

    `send` never blocks and never fails; `reject` also counts the error like a socket
    connection's (`error_<code>` in the front's counters). Frames sent after the handler
    left are kept until the peer is dropped (the flow sends nothing more once a request
    has ended)."""

    def __init__(self, connection_id: int, counters: Counter[str]) -> None:
        self.connection_id = connection_id
        self._counters = counters
        self._frames: list[m.ServerMessage] = []
        self._waiter: asyncio.Future[None] | None = None

    def send(self, message: m.ServerMessage) -> None:
        self._frames.append(message)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def reject(self, client_id: int | None, code: str, message: str) -> None:
        self._counters[f"error_{code}"] += 1
        self.send(m.Error(client_id, code, message))

    async def receive(self) -> list[m.ServerMessage]:
        """Every frame sent since the last call; waits for one when there is none."""
        if not self._frames:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        frames, self._frames = self._frames, []
        return frames
