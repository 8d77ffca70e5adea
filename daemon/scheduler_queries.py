"""The front's questions to the scheduler: each carries a query id, and the scheduler's
answer with that id (`QueryReply`; `Holding` to the reconciliation's `Reconcile`) is its
answer.

Every question takes its id from one counter (`ask` and `tell` alike), so an answer never
answers a question it was not meant for. `ask` waits for its `QueryReply`; a question sent
with `tell` is not waited for (whoever handles its answer reads it), and a `QueryReply` to
no question waiting (one that came after its question timed out) is dropped. No torch is
imported here.
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
        query_id = self._new_id()
        future: asyncio.Future[m.QueryReply] = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future
        try:
            self.scheduler.send(make(query_id))
            return await asyncio.wait_for(future, QUERY_TIMEOUT_S)
        finally:
            self._queries.pop(query_id, None)

    def tell(self, make: Callable[[int], m.ToScheduler]) -> None:
        """Send `make(query_id)` without waiting (the front's probes: the answer, like any
        message, moves `HealthWatch.last_heard`)."""
        query_id = self._new_id()
        try:
            self.scheduler.send(make(query_id))
        except LinkSendError as exc:  # its inbox is full: the watchdog will see no answer
            log_event(log, logging.WARNING, "probe_not_sent", f"cannot ask the scheduler: {exc}")

    def on_reply(self, reply: m.QueryReply) -> None:
        future = self._queries.pop(reply.query_id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def _new_id(self) -> int:
        self._next_query_id += 1
        return self._next_query_id
