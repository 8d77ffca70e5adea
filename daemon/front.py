"""The front process: client requests in, scheduler output out, and the daemon's lifecycle
(its states: `lifecycle.State`).

Everything runs on one asyncio (uvloop) thread; no handler awaits a client, so one client
never delays another, and long prompts are tokenized on a worker thread (`prompts.py`).
A generate request is open (in the request table) from its arrival: while its prompt is
tokenized, then in the scheduler until its last frame (`request_flow.RequestFlow`).
Queries and control requests are answered by `control.Control`. With `--http`, the
OpenAI-compatible API and /metrics (`daemon/http/`) serve on the same loop, through the
same request flow; `health_watch.HealthWatch` watches the scheduler. The front builds these
parts and hands each what it uses (the status of `front_status.py`, the request table, the
scheduler handle, the counters, the lifecycle, a sibling or one of the front's own steps);
none holds the front. No torch is imported here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import socket
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import Any

import aiohttp

from specd import provenance
from specd.daemon.config import DaemonConfig
from specd.daemon.control import Control
from specd.daemon.front_status import FrontStatus
from specd.daemon.health_watch import HealthWatch, probe_interval_s
from specd.daemon.http.listener import HttpListener
from specd.daemon.http.metrics import Metrics
from specd.daemon.http.server import HttpServer
from specd.daemon.http_warmup import HttpWarmUpFailed, local_host, warm_up_http
from specd.daemon.http_warmup import cases as http_cases
from specd.daemon.incidents import Incidents
from specd.daemon.lifecycle import Lifecycle, State
from specd.daemon.reconcile import Reconciler
from specd.daemon.request_flow import RequestFlow
from specd.daemon.request_table import RequestTable
from specd.daemon.scheduler_handle import SchedulerHandle
from specd.daemon.scheduler_queries import SchedulerQueries
from specd.daemon.server import Connection, start_server
from specd.daemon.socket_watch import SocketWatch
from specd.exit_codes import EXIT_CONFIG, EXIT_OK, EXIT_SCHEDULER_FAILED, EXIT_SOFTWARE
from specd.ipc import messages as m
from specd.ipc.framing import FrameCodec
from specd.ipc.zmq_link import LinkSendError
from specd.logs import log_event
from specd.tokenizer import Tokenizer

log = logging.getLogger("specd.front")

TICK_S = 0.1
EXIT_GRACE_S = 0.3  # after the scheduler exits, wait this long for its SchedulerFailed
SHUTDOWN_WAIT_S = 5.0


class Front:
    """Owns the listeners, the connections, the request table, the scheduler handle and
    the daemon's lifecycle (ready, drain, failure, exit); builds its parts and hands each
    what it uses: the request flow, the control requests, the health watch, the HTTP API.

    http_listener: the HTTP API's bound port (None: HTTP off). scheduler_restarts: how
    often this service already exited for a failed scheduler (`scheduler_restarts` in
    the front's counters). tokenizer_misfits: the evidence that the tokenizer is another
    model's (specd/model_fit.py), a problem from the start."""

    def __init__(self, config: DaemonConfig, lifecycle: Lifecycle, tokenizer: Tokenizer,
                 listener: socket.socket, socket_watch: SocketWatch,
                 http_listener: HttpListener | None = None, scheduler_restarts: int = 0,
                 tokenizer_misfits: Sequence[str] = ()) -> None:
        self.config = config
        self.lifecycle = lifecycle
        self.listener = listener
        self.socket_watch = socket_watch  # the listener's file (a re-bound one is served too)
        self.servers: list[asyncio.Server] = []
        self.http_listener = http_listener
        self.codec: FrameCodec[m.ClientMessage] = FrameCodec(
            m.ClientMessage, config.max_frame_bytes, nil_is_default=True)
        self.table = RequestTable()
        self.connections: dict[int, Connection] = {}
        self.status = FrontStatus()
        self.code_version = provenance.code_version()
        self.is_stopping = False
        self.exit_code: int | None = None
        self.counters: Counter[str] = Counter(scheduler_restarts=scheduler_restarts)
        self.metrics = Metrics()
        self._next_connection_id = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._drain_timer: asyncio.TimerHandle | None = None
        self._done = asyncio.Event()
        self.scheduler = SchedulerHandle(config.engine, config.runtime_base_dir,
                                         config.log_format, config.log_level)
        log_event(log, logging.INFO, "scheduler_spawned", "scheduler process started",
                  scheduler_pid=self.scheduler.pid, code_version=self.code_version)
        self.queries = SchedulerQueries(self.scheduler)
        # What an operator must act on: the front's problems (a lost request, a removed
        # socket file) and its degraded parts (an HTTP handler that raised).
        self.problems = Incidents(self.counters)
        self.fallbacks = Incidents(self.counters)
        if tokenizer_misfits:  # found before the front was built, logged there
            self.problems.record("tokenizer_misfit", "; ".join(tokenizer_misfits))
        self.requests = RequestFlow(config, tokenizer, self.status, self.table, self.counters,
                                    self.metrics.latency, self.scheduler, spawn=self.spawn,
                                    note_progress=self._note_progress,
                                    check_drained=self.check_drained)
        self.reconciler = Reconciler(self.table, self.requests, self.queries, self.problems,
                                     idle_after_s=probe_interval_s(config),
                                     stall_timeout_s=config.hang_timeout_s)
        self.health = HealthWatch(config, self.status, self.table, self.connections, lifecycle,
                                  self.scheduler, probe=self.reconciler.probe,
                                  stalled_ids=self.reconciler.stalled_ids,
                                  unreachable=lambda: socket_watch.lost, spawn=self.spawn,
                                  fail=self.fail)
        self.control = Control(config, self.status, self.table, self.connections, self.counters,
                               self.scheduler, self.queries, self.health, self.problems,
                               self.fallbacks, reconcile=self.reconciler.probe,
                               spawn=self.spawn, begin_drain=self.begin_drain)
        self.tokenizer = tokenizer
        # The warm-up's requests carry this token: the only ones admitted before READY.
        self.warmup_token = secrets.token_hex(16)
        self.http = None if http_listener is None else HttpServer(
            config, http_listener, self.status, self.counters, self.metrics, self.requests,
            self.control, self.health, self.fallbacks, new_connection_id=self.new_connection_id,
            warmup_token=self.warmup_token)

    # ---- lifecycle ---------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until drained or failed; returns the process exit code."""
        loop = asyncio.get_running_loop()
        await self._serve(self.listener)
        if self.http is not None:
            await self.http.start()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        self.scheduler.watch_exit(self._on_scheduler_exit)
        self.lifecycle.starting("scheduler: spawn")
        background = [asyncio.create_task(self._pump()), asyncio.create_task(self._tick())]
        await self._done.wait()
        for server in self.servers:
            server.close()
        for connection in list(self.connections.values()):
            connection.close("daemon exiting")
        await asyncio.sleep(0.05)  # let the transports flush their last frames
        if self.http is not None:
            await self.http.close()  # the requests have ended; their handlers finish writing
        for task in background + list(self._tasks):
            task.cancel()
        self.requests.close()
        self.scheduler.close()
        return self.exit_code if self.exit_code is not None else EXIT_SOFTWARE

    def _finish_run(self, code: int) -> None:
        if self.exit_code is None:
            self.exit_code = code
        self._done.set()

    def new_connection_id(self) -> int:
        """A connection id no other client has (socket connections and HTTP requests)."""
        self._next_connection_id += 1
        return self._next_connection_id

    def _note_progress(self) -> None:
        self.health.progressed()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as a task, cancelled when the front exits."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.status.state is State.DRAINING:
            log_event(log, logging.WARNING, "signal", f"{name} again: ending the drain now")
            self._drain_expired()
            return
        self.begin_drain(self.config.drain_timeout_s, f"{name} received")

    async def _serve(self, listener: socket.socket) -> None:
        self.servers.append(await start_server(self._on_connection, listener, self.config))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self.health.check(now)
            rebound = self.socket_watch.check(now, self.problems)
            if rebound is not None:
                self.spawn(self._serve(rebound))

    def begin_drain(self, timeout_s: float, reason: str) -> None:
        """Stop accepting; end when the open requests are done or `timeout_s` passed. During
        a drain, a shorter timeout (a `stop`: 0) brings its end forward."""
        if self.status.state is State.DRAINING:
            self._shorten_drain(timeout_s)
            return
        if self.status.state is State.FAILED:
            return
        was_ready = self.status.state is State.READY
        self.status.state = State.DRAINING
        self.lifecycle.draining(len(self.table), timeout_s)
        log_event(log, logging.INFO, "drain", f"draining: {reason}",
                  open_requests=len(self.table), timeout_s=timeout_s)
        if not was_ready:
            self.spawn(self._stop_scheduler(graceful=False))
        elif not self.table:
            self.spawn(self._stop_scheduler(graceful=True))
        else:
            self._drain_timer = asyncio.get_running_loop().call_later(
                timeout_s, self._drain_expired)

    def _shorten_drain(self, timeout_s: float) -> None:
        if self._drain_timer is None:  # no request was open: the scheduler is stopping
            return
        loop = asyncio.get_running_loop()
        if loop.time() + timeout_s < self._drain_timer.when():
            self._drain_timer.cancel()
            self._drain_timer = loop.call_later(timeout_s, self._drain_expired)

    def _drain_expired(self) -> None:
        open_requests = list(self.table)
        if open_requests:
            log_event(log, logging.WARNING, "drain_timeout",
                      "drain timeout: ending the requests still open",
                      request_ids=[r.request_id for r in open_requests])
        for request in open_requests:
            self.requests.end_with_error(request, "drained", "the daemon is shutting down",
                                         abort=True)
        self.check_drained()

    def check_drained(self) -> None:
        """While draining: once no request is open, stop the scheduler and exit."""
        if self.status.state is State.DRAINING and not self.table and not self.is_stopping:
            if self._drain_timer is not None:
                self._drain_timer.cancel()
            self.spawn(self._stop_scheduler(graceful=True))

    async def _stop_scheduler(self, graceful: bool) -> None:
        self.is_stopping = True
        if graceful:
            try:
                self.scheduler.send(m.Shutdown())
            except LinkSendError as exc:
                log_event(log, logging.WARNING, "shutdown", f"could not send Shutdown: {exc}")
        returncode = await self.scheduler.wait_exit(SHUTDOWN_WAIT_S if graceful else 0.0)
        if returncode is None:
            self.scheduler.kill()
        log_event(log, logging.INFO, "stopped", "daemon stopped", scheduler_returncode=returncode)
        self._finish_run(EXIT_OK)

    def fail(self, code: int, cause: str, traceback: str | None = None,
             event: str = "scheduler_failed") -> None:
        """The scheduler is gone or useless (or, `event` saying so, the front's own
        start-up failed): error every open request, log once, exit."""
        if self.status.state is State.FAILED or self.is_stopping:
            return
        self.status.state = State.FAILED
        self.lifecycle.failed(cause)
        open_requests = list(self.table)
        log_event(log, logging.ERROR, event, cause, exit_code=code,
                  scheduler_pid=self.scheduler.pid, open_requests=len(open_requests),
                  scheduler_traceback=traceback)
        for request in open_requests:
            self.requests.end_with_error(request, "scheduler_unavailable", cause, abort=False)
        self.scheduler.kill()
        self._finish_run(code)

    def _on_scheduler_exit(self) -> None:
        self.scheduler.stop_watching()
        if self.is_stopping or self.status.state is State.FAILED:
            return
        # Its last message (SchedulerFailed) may still be in transit: give it a moment.
        asyncio.get_running_loop().call_later(EXIT_GRACE_S, self._on_scheduler_gone)

    def _on_scheduler_gone(self) -> None:
        returncode = self.scheduler.returncode
        if returncode is not None and returncode < 0:
            how = f"killed by {signal.Signals(-returncode).name}"
        else:
            how = f"exited with status {returncode}"
        stage = self.status.scheduler_stage if self.status.state is State.STARTING else "loop"
        self.fail(EXIT_SCHEDULER_FAILED,
                  f"scheduler process {self.scheduler.pid} {how} (stage {stage})")

    # ---- scheduler -> front ------------------------------------------------------------

    async def _pump(self) -> None:
        while True:
            message = await self.scheduler.receive()
            self.health.heard()
            try:
                self._on_scheduler_message(message)
            except Exception as exc:  # noqa: BLE001 - a front bug: report it and exit
                log.exception("front failed handling %s", type(message).__name__)
                self.fail(EXIT_SOFTWARE, f"front error: {exc!r}")

    def _on_scheduler_message(self, message: m.FromScheduler) -> None:
        if isinstance(message, m.StepOutput):
            self.health.progressed()
            for prompt in message.prompt_logprobs:
                self.requests.on_prompt_logprobs(prompt)
            for delta in message.deltas:
                self.requests.on_delta(delta)
        elif isinstance(message, m.QueryReply):
            self.queries.on_reply(message)
        elif isinstance(message, m.Holding):
            self.health.progressed()  # the loop answers between steps: not hung
            self.reconciler.on_holding(message)
        elif isinstance(message, m.RequestRejected):
            self.requests.on_rejected(message)
        elif isinstance(message, m.StartupStage):
            self.health.progressed()
            if message.code_version and message.code_version != self.code_version:
                self._refuse_other_code(message)
                return
            if message.stage == self.status.scheduler_stage and message.detail:  # a heartbeat
                self.lifecycle.still_starting(f"scheduler: {message.stage}, {message.detail}",
                                              time.monotonic() - self.status.started)
                return
            self.status.scheduler_stage = message.stage
            self.lifecycle.starting(f"scheduler: {message.stage}")
            log_event(log, logging.INFO, "scheduler_stage", f"scheduler: {message.stage}")
        elif isinstance(message, m.Ready):
            self._on_ready(message)
        elif isinstance(message, m.SchedulerFailed):
            # Before Ready the scheduler tells a code bug (70) from bad configuration (78).
            is_starting = self.status.state is State.STARTING
            code = message.exit_code if is_starting else EXIT_SCHEDULER_FAILED
            self.fail(code, f"scheduler failed in stage {message.stage}: {message.error}",
                       traceback=message.traceback)
        elif isinstance(message, m.Stopped):
            log_event(log, logging.INFO, "scheduler_stopped", "scheduler stopped")

    def _refuse_other_code(self, stage: m.StartupStage) -> None:
        """The scheduler imported other code than the front (exit 78, before it loads)."""
        files = provenance.differing_files(provenance.file_digests(), stage.file_digests)
        shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        self.fail(EXIT_CONFIG, f"scheduler code version {stage.code_version} (from "
                   f"{stage.source_root}) differs from the front's {self.code_version} (from "
                   f"{provenance.package_dirs()['specd']}): a stale or mixed installation; "
                   f"files that differ: {shown}; reinstall specd and restart")

    def _on_ready(self, ready: m.Ready) -> None:
        if ready.code_version != self.code_version:
            self.fail(EXIT_CONFIG, f"scheduler code version {ready.code_version} differs from "
                       f"the front's {self.code_version}: a stale or mixed installation "
                       f"(scheduler modules: {ready.modules.get('specd')})")
            return
        self.status.ready = ready
        self.health.progressed()
        if self.http is None or self.http_listener is None:
            self._become_ready(ready, 0.0)
            return
        self.status.scheduler_stage = "http warm-up"
        self.lifecycle.starting("front: http warm-up")
        self.spawn(self._warm_up_http(ready, self.http.model, self.http_listener))

    async def _warm_up_http(self, ready: m.Ready, model: str, listener: HttpListener) -> None:
        """Every HTTP path once, through the request flow, before READY (http_warmup.py);
        its requests leave no figures behind. A path that fails is a bug: exit 70."""
        host, port = listener.address
        keys = listener.api_keys
        saved = Counter(self.counters)
        started = time.monotonic()
        all_cases = http_cases(model, bool(self.tokenizer.chat_templates.templates),
                               int(ready.resolved["max_model_len"]),
                               self.config.max_pending_requests)
        try:
            await warm_up_http(local_host(host), port, keys[0] if keys else None,
                               self.warmup_token, all_cases, self.config.max_pending_requests)
        except (HttpWarmUpFailed, aiohttp.ClientError, TimeoutError) as exc:
            self.fail(EXIT_SOFTWARE, f"HTTP warm-up failed: {exc}", event="http_warmup_failed")
            return
        # Its requests' counts go (not an incident seen meanwhile), and the engine's figures.
        for key, count in (self.counters - saved).items():
            if key not in self.problems.last and key not in self.fallbacks.last:
                self.counters[key] -= count
                if not self.counters[key]:
                    del self.counters[key]
        try:
            self.scheduler.send(m.ForgetFigures())
        except LinkSendError as exc:
            log_event(log, logging.WARNING, "forget_figures", f"not sent: {exc}")
        self._become_ready(ready, time.monotonic() - started)

    def _become_ready(self, ready: m.Ready, http_warmup_s: float) -> None:
        if self.status.state is not State.STARTING:
            return  # a drain or a failure came first
        self.status.state = State.READY
        self.health.progressed()
        log_event(log, logging.INFO, "ready", "scheduler ready", resolved=ready.resolved,
                  warmup_s=round(ready.warmup_s, 3), http_warmup_s=round(http_warmup_s, 3),
                  scheduler_pid=ready.pid)
        self.lifecycle.ready(f"model {ready.resolved.get('model_name')}")

    # ---- clients -> front --------------------------------------------------------------

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        connection = Connection(self.new_connection_id(), reader, writer, self.codec,
                                self.config, self.counters)
        # Never admitted: told why, then closed. While draining a connection is admitted
        # for the operator's commands (status, a second drain, stop); a generate on it is
        # refused `shutting_down` (request_flow.py).
        if len(self.connections) >= self.config.max_connections:
            await connection.refuse("overloaded", "too many connections")
            return
        self.connections[connection.connection_id] = connection
        await connection.serve(self)

    def on_close(self, connection: Connection, reason: str) -> None:
        self.connections.pop(connection.connection_id, None)
        self.requests.on_connection_closed(connection, reason)

    def has_open_requests(self, connection: Connection) -> bool:
        return (bool(self.table.of_connection(connection.connection_id))
                or self.control.is_answering(connection.connection_id))

    def on_large_frame(self) -> None:
        self.requests.prompts.release_memory_soon()

    def on_message(self, connection: Connection, message: m.ClientMessage) -> None:
        try:
            self._dispatch(connection, message)
        except Exception:  # noqa: BLE001 - a handler bug must not take the server down
            log.exception("internal error handling %s", type(message).__name__,
                          extra={"event": "internal_error",
                                 "connection": connection.connection_id})
            connection.reject(message.id, "internal_error", "internal error; see the log")
            connection.close("internal error", error_code="internal_error")

    def end_requests(self, connection: Connection, code: str, reason: str) -> None:
        self.requests.end_connection_requests(connection, code, reason)

    def _dispatch(self, connection: Connection, message: m.ClientMessage) -> None:
        if isinstance(message, m.Generate):
            self.requests.admit(connection, message)
        elif self.requests.is_in_flight(connection, message.id):
            connection.reject(message.id, "duplicate_id", f"request id {message.id} is that "
                              f"of a generate in flight (which goes on)")
        elif isinstance(message, m.Abort):
            self.requests.on_abort(connection, message)
        elif isinstance(message, m.Tokenize):
            self.requests.tokenize(connection, message)
        else:
            self.control.handle(connection, message)
