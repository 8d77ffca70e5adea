"""The front's answers to everything but generate and abort: status and stats queries, and
the control requests `spec`, `drain` and `stop`.

Control requests change the daemon for every client, so only an operator may send them:
the peer's uid (SO_PEERCRED, taken when it connected) must be root or
`DaemonConfig.operator_uid` (default: the daemon's own user). Anyone else gets `forbidden`
and keeps the connection. Queries that need the scheduler's figures ask it over the link
(`SchedulerQueries`) and wait at most `QUERY_TIMEOUT_S`; a bug in a handler answers
`internal_error`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sized
from typing import Any, TypeAlias

import msgspec

import specd
from specd import provenance
from specd.daemon.config import DaemonConfig
from specd.daemon.front_status import FrontStatus, Spawn
from specd.daemon.health_watch import HealthWatch
from specd.daemon.incidents import Incidents
from specd.daemon.lifecycle import State
from specd.daemon.request_table import RequestTable
from specd.daemon.scheduler_handle import SchedulerHandle
from specd.daemon.scheduler_queries import QUERY_TIMEOUT_S, SchedulerQueries
from specd.daemon.server import Connection
from specd.ipc import messages as m
from specd.ipc.zmq_link import LinkSendError
from specd.logs import log_event

log = logging.getLogger("specd.front")

ControlMessage: TypeAlias = m.StatusQuery | m.StatsQuery | m.SetSpec | m.Drain | m.Stop
OPERATOR_ONLY = (m.SetSpec, m.Drain, m.Stop)


class Control:
    """Answers `ControlMessage`s. Reads the front's `status`, its request `table`, its
    `connections` (how many), `counters`, `problems` and `fallbacks`; asks the scheduler
    through `queries` (after the question of `reconcile()`, whose answer is settled before
    the figures arrive: a lost request has ended when they are read) and reads its process
    through `scheduler`; the state it reports is `health`'s. Its handlers run through
    `spawn`; a drain or stop is the front's `begin_drain(timeout_s, reason)`."""

    def __init__(self, config: DaemonConfig, status: FrontStatus, table: RequestTable,
                 connections: Sized, counters: Counter[str], scheduler: SchedulerHandle,
                 queries: SchedulerQueries, health: HealthWatch, problems: Incidents,
                 fallbacks: Incidents, *, reconcile: Callable[[], None],
                 spawn: Spawn, begin_drain: Callable[[float, str], None]) -> None:
        self.config = config
        self.status = status
        self.table = table
        self.connections = connections
        self.counters = counters
        self.scheduler = scheduler
        self.queries = queries
        self.health = health
        self.problems = problems
        self.fallbacks = fallbacks
        self.reconcile = reconcile
        self.spawn = spawn
        self.begin_drain = begin_drain
        self._num_in_flight: Counter[int] = Counter()  # connection id -> replies it awaits

    def handle(self, connection: Connection, message: ControlMessage) -> None:
        """Answer at once or through a task; never raises for a client's mistake."""
        if isinstance(message, OPERATOR_ONLY) and not self._is_operator(connection):
            connection.reject(message.id, "forbidden",
                              f"{message.__struct_config__.tag} is for an operator (uids "
                              f"{sorted(self.config.operator_uids)}); this connection is "
                              f"uid {connection.peer_uid}")
        elif isinstance(message, m.StatusQuery):
            self._spawn_guarded(connection, message.id, self._reply_status)
        elif isinstance(message, m.StatsQuery):
            self._spawn_guarded(connection, message.id, self._reply_stats)
        elif isinstance(message, m.SetSpec):
            self.spawn(self._guarded(connection, message.id, self._set_spec(connection, message)))
        elif isinstance(message, m.Drain):
            timeout = self.config.drain_timeout_s if message.timeout_s is None \
                else message.timeout_s
            connection.send(m.Ack(message.id, f"draining {len(self.table)} requests"))
            self.begin_drain(timeout, "drain requested by a client")
        elif isinstance(message, m.Stop):
            connection.send(m.Ack(message.id, f"stopping; ending {len(self.table)} requests"))
            self.begin_drain(0.0, "stop requested by a client")

    def _is_operator(self, connection: Connection) -> bool:
        return connection.peer_uid in self.config.operator_uids

    def _spawn_guarded(self, connection: Connection, client_id: int,
                       reply: Callable[[Connection, int], Coroutine[Any, Any, None]]) -> None:
        self.spawn(self._guarded(connection, client_id, reply(connection, client_id)))

    def is_answering(self, connection_id: int) -> bool:
        """Whether a reply to the connection is still being prepared (a query waiting on
        the scheduler): the connection is not idle meanwhile."""
        return self._num_in_flight[connection_id] > 0

    async def _guarded(self, connection: Connection, client_id: int,
                       coro: Coroutine[Any, Any, None]) -> None:
        """Run a query handler; a bug in it answers internal_error instead of vanishing."""
        self._num_in_flight[connection.connection_id] += 1
        try:
            await coro
        except Exception:  # noqa: BLE001 - reported to the client and the log
            log.exception("internal error answering request %d", client_id,
                          extra={"event": "internal_error",
                                 "connection": connection.connection_id})
            connection.reject(client_id, "internal_error", "internal error; see the log")
        finally:
            self._num_in_flight[connection.connection_id] -= 1
            if not self._num_in_flight[connection.connection_id]:
                del self._num_in_flight[connection.connection_id]

    async def _engine_stats(self) -> dict[str, Any]:
        """The scheduler's figures; while it does not answer (or its process is stopped,
        which is not asked), what the front knows instead: `error` and the process state."""
        if self.status.state not in (State.READY, State.DRAINING):
            return {}
        scheduler = self.scheduler
        error = "the scheduler did not answer"
        if not scheduler.is_stopped:
            try:
                # The reconciliation's question first: its answer comes, and is settled,
                # before the figures (the link keeps order), so a lost request has ended
                # when the reply is written.
                self.reconcile()
                return (await self.queries.ask(lambda q: m.QueryStats(q))).result
            except (TimeoutError, LinkSendError) as exc:
                error += f" ({type(exc).__name__} after {QUERY_TIMEOUT_S:g} s)"
        return {"error": error, "scheduler_pid": scheduler.pid,
                "scheduler_process": scheduler.process_state()}

    async def _reply_status(self, connection: Connection, query_id: int) -> None:
        engine = await self._engine_stats()
        status = self.status
        ready = status.ready
        # A scheduler that does not answer is reported, not hidden behind `ready`: the
        # watchdog fails the daemon if it stays silent for the hang timeout.
        connection.send(m.StatusReply(
            id=query_id,
            state="unresponsive" if "error" in engine else self.health.reported_state,
            protocol=m.PROTOCOL_VERSION,
            version=specd.__version__,
            uptime_s=time.monotonic() - status.started,
            model=str(ready.resolved.get("model_name")) if ready else str(
                self.config.engine.model_path),
            num_open_requests=len(self.table),
            num_connections=len(self.connections),
            resolved=ready.resolved if ready else {"stage": status.scheduler_stage},
            engine=engine,
            provenance={
                "front": provenance.report(),
                "scheduler": {} if ready is None else {
                    "code_version": ready.code_version, "pid": ready.pid,
                    "modules": ready.modules, "packages": ready.packages},
            },
            config=msgspec.to_builtins(self.config, enc_hook=str),
            problems=self.problems.summary(),
            fallbacks=self.fallbacks.summary(),
        ))

    async def _reply_stats(self, connection: Connection, query_id: int) -> None:
        engine = await self._engine_stats()
        stats = {"engine": engine, "front": dict(self.counters),
                 "open_requests": len(self.table), "connections": len(self.connections)}
        connection.send(m.StatsReply(query_id, stats))

    async def _set_spec(self, connection: Connection, message: m.SetSpec) -> None:
        state = self.status.state
        if state is not State.READY:
            connection.reject(message.id, "starting" if state is State.STARTING
                              else "shutting_down", "the scheduler is not serving")
            return
        try:
            reply = await self.queries.ask(
                lambda q: m.SetSpecMode(q, message.mode, message.threshold))
        except (TimeoutError, LinkSendError) as exc:
            connection.reject(message.id, "scheduler_unavailable", repr(exc))
            return
        if reply.error is not None:
            connection.reject(message.id, "bad_request", reply.error)
            return
        log_event(log, logging.INFO, "spec_mode", f"speculation set to {message.mode}",
                  threshold=message.threshold)
        connection.send(m.Ack(message.id, f"speculation {message.mode}"
                              + (f" threshold {message.threshold}" if message.threshold else "")))
