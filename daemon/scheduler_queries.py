"""The front's questions to the scheduler: each carries a query id, and the scheduler's
`QueryReply` with that id is its answer.

Every question takes its id from one counter (`ask` and `probe` alike), so a reply never
answers a question it was not meant for. An answer to no question waiting (a probe's, or one
that came after its question timed out) is dropped. No torch is imported here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from specd.daemon.scheduler_handle import SchedulerHandle
from specd.ipc import messages as m
from specd.ipc.zmq_link import LinkSendError
from specd.logs import log_event

log = logging.getLogger("specd.front")

QUERY_TIMEOUT_S = 5.0


class SchedulerQueries:
    """The questions in flight to `scheduler`; `on_reply` gets every `QueryReply`."""

    def __init__(self, scheduler: SchedulerHandle) -> None:
        self.scheduler = scheduler
        self._next_query_id = 0
        self._queries: dict[int, asyncio.Future[m.QueryReply]] = {}

    async def ask(self, make: Callable[[int], m.ToScheduler]) -> m.QueryReply:
        """Send `make(query_id)` to the scheduler and wait for its QueryReply (at most
        QUERY_TIMEOUT_S: TimeoutError; a full inbox: LinkSendError)."""
        self._next_query_id += 1
        query_id = self._next_query_id
        future: asyncio.Future[m.QueryReply] = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future
        try:
            self.scheduler.send(make(query_id))
            return await asyncio.wait_for(future, QUERY_TIMEOUT_S)
        finally:
            self._queries.pop(query_id, None)

    def probe(self) -> None:
        """Ask the scheduler for its figures without waiting (the front's idle watchdog: the
        answer moves `HealthWatch.last_heard`; no one reads it)."""
        self._next_query_id += 1
        try:
            self.scheduler.send(m.QueryStats(self._next_query_id))
        except LinkSendError as exc:  # its inbox is full: the watchdog will see no answer
            log_event(log, logging.WARNING, "probe_not_sent", f"cannot ask the scheduler: {exc}")

    def on_reply(self, reply: m.QueryReply) -> None:
        future = self._queries.pop(reply.query_id, None)
        if future is not None and not future.done():
            future.set_result(reply)
