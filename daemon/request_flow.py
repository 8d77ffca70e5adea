"""The front's generate requests, from admission to their last frame.

A request is admitted only while the scheduler is ready, under `max_pending_requests`, and
with an id not already in flight on its connection; it is open (in the front's request
table) from then on: while its prompt is tokenized (short prompts at once, long ones on the
prompt encoder's worker thread), then in the scheduler. Each step's `TokenDelta` is
detokenized and streamed (or kept for the final frame); the request ends with a final frame
(a finish reason from the engine, a stop string, an abort) or an error frame (a failed
step, a deadline, a drain, a dead scheduler, the daemon closing its connection) preceded by
a delta with the output the client has not seen, and leaves the table. `tokenize`
requests share the prompt encoder and never reach the scheduler.

A request answers to a `Client`: a socket `Connection`, or an HTTP request's peer
(`daemon/http/peer.py`), admitted, ended and aborted the same way. Each output with tokens
is timed for /metrics (`RequestLatency`: time to first token, inter-token latency).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from specd.daemon.config import DaemonConfig
from specd.daemon.detokenizer import IncrementalDetokenizer
from specd.daemon.front_status import FrontStatus, Spawn
from specd.daemon.http.metrics import RequestLatency
from specd.daemon.lifecycle import State
from specd.daemon.prompts import INLINE_TOKENIZE_CHARS, PromptEncoder, PromptText, RequestError
from specd.daemon.request_table import OpenRequest, Peer, RequestTable
from specd.daemon.scheduler_handle import SchedulerHandle
from specd.ipc import messages as m
from specd.ipc.sampling import SamplingParams
from specd.ipc.zmq_link import LinkSendError
from specd.logs import log_event
from specd.tokenizer import Tokenizer

log = logging.getLogger("specd.front")


class Client(Peer, Protocol):
    """Where a request's frames go (`Peer`), and its refusals (`reject`: an error frame,
    counted as `error_<code>`)."""

    def reject(self, client_id: int | None, code: str, message: str) -> None: ...


class RequestFlow:
    """The front's generate requests: admission, tokenizing, submission to the scheduler,
    output to the client, and every way a request ends. Owns the prompt encoder.

    Admits by the front's `status`; keeps the open requests in the front's `table`, counts
    how they end in its `counters` and times their output in `latency`; sends to the
    `scheduler`. Tokenizing off the loop runs through `spawn`; `note_progress()` when the
    first request of an idle scheduler is submitted (idle time is no stall), and
    `check_drained()` each time requests leave the table (a drain ends with the last)."""

    def __init__(self, config: DaemonConfig, tokenizer: Tokenizer, status: FrontStatus,
                 table: RequestTable, counters: Counter[str], latency: RequestLatency,
                 scheduler: SchedulerHandle, *, spawn: Spawn, note_progress: Callable[[], None],
                 check_drained: Callable[[], None]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.status = status
        self.table = table
        self.counters = counters
        self.latency = latency
        self.scheduler = scheduler
        self.spawn = spawn
        self.note_progress = note_progress
        self.check_drained = check_drained
        self.prompts = PromptEncoder(tokenizer, config)
        self._next_request_number = 0

    def close(self) -> None:
        self.prompts.close()

    # ---- client -> scheduler -------------------------------------------------------------

    def admit(self, connection: Client, message: m.Generate, warmup: bool = False) -> None:
        """Open the request, or answer the client why not. `warmup`: one of the front's
        own warm-up requests (daemon/http_warmup.py), admitted once the scheduler is
        ready but before the daemon is, and left out of the latency figures."""
        try:
            self._open(connection, message, warmup)
        except RequestError as exc:
            connection.reject(message.id, exc.code, str(exc))

    def _open(self, connection: Client, message: m.Generate, warmup: bool) -> None:
        """Open the request, or raise RequestError; its prompt is tokenized here when
        short, else on the worker thread while the request waits in the table."""
        status = self.status
        if status.state is State.STARTING and not (warmup and status.ready is not None):
            raise RequestError("starting",
                               f"the scheduler is starting ({status.scheduler_stage})")
        if status.state is State.DRAINING:
            raise RequestError("shutting_down", "the daemon is draining; no new requests")
        if status.state is State.FAILED or status.ready is None:
            raise RequestError("scheduler_unavailable", "the scheduler is not available")
        if self.table.find(connection.connection_id, message.id) is not None:
            raise RequestError("duplicate_id", f"request id {message.id} is already in flight")
        if len(self.table) >= self.config.max_pending_requests:
            raise RequestError("overloaded", f"{len(self.table)} requests open; retry later")
        prompt = self.prompts.prepare(message, self._max_model_len())
        self._next_request_number += 1
        request = OpenRequest(
            f"r{self._next_request_number}", message.id, connection,
            IncrementalDetokenizer(self.tokenizer, message.sampling.stop),
            message.stream, 0, message.sampling.logprobs > 0, is_warmup=warmup)
        request.reports_prompt = message.report_prompt
        self.table.add(request)
        if message.deadline_s is not None:
            request.deadline = asyncio.get_running_loop().call_later(
                message.deadline_s, self._on_deadline, request, message.deadline_s)
        if isinstance(prompt, list):
            self._submit(request, prompt, message.sampling)
        else:
            self.spawn(self._tokenize_and_submit(request, prompt, message.sampling))

    def tokenize(self, connection: Client, message: m.Tokenize) -> None:
        """Answer `tokens`: the prompt ids a generate with the same prompt or messages would
        have (the same rendering and special-token rule), in any daemon state: the tokenizer
        is the front's. Long text is tokenized on the worker thread, like a prompt."""
        try:
            prompt = self.prompts.render(message)
        except RequestError as exc:
            connection.reject(message.id, exc.code, str(exc))
            return
        if len(prompt.text) < INLINE_TOKENIZE_CHARS:
            ids = self.tokenizer.encode(prompt.text, prompt.add_special_tokens)
            connection.send(m.Tokens(message.id, ids))
        else:
            self.spawn(self._tokenize_off_loop(connection, message.id, prompt))

    async def _tokenize_off_loop(self, connection: Client, client_id: int,
                                 prompt: PromptText) -> None:
        try:
            ids = await self.prompts.encode_off_loop(prompt.text, prompt.add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - answers this request; the log has the rest
            log.exception("tokenize request %d failed", client_id,
                          extra={"event": "internal_error"})
            connection.reject(client_id, "internal_error", f"tokenizing failed: {exc!r}")
            return
        connection.send(m.Tokens(client_id, ids))

    def _max_model_len(self) -> int:
        assert self.status.ready is not None  # admission checked it
        return int(self.status.ready.resolved["max_model_len"])

    async def _tokenize_and_submit(self, request: OpenRequest, prompt: PromptText,
                                   sampling: SamplingParams) -> None:
        try:
            prompt_ids = await self.prompts.encode_off_loop(prompt.text,
                                                            prompt.add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - ends this request; the log has the rest
            log.exception("tokenizing request %s failed", request.request_id,
                          extra={"event": "internal_error"})
            if self.table.get(request.request_id) is request:
                self.end_with_error(request, "internal_error", f"tokenizing failed: {exc!r}",
                                    abort=False)
            return
        if self.table.get(request.request_id) is request:  # else aborted or ended since
            self._submit(request, prompt_ids, sampling)

    def _submit(self, request: OpenRequest, prompt_ids: list[int],
                sampling: SamplingParams) -> None:
        """Send an open request to the scheduler, or end it with the reason it cannot go."""
        max_model_len = self._max_model_len()
        if not prompt_ids:
            self.end_with_error(request, "bad_request", "the prompt encodes to no tokens",
                                abort=False)
            return
        if len(prompt_ids) >= max_model_len:
            self.end_with_error(request, "prompt_too_long", f"prompt has {len(prompt_ids)} "
                                f"tokens; this model allows at most {max_model_len - 1}",
                                abort=False)
            return
        try:
            self.scheduler.send(m.AddRequest(request.request_id, prompt_ids, sampling))
        except LinkSendError as exc:
            self.end_with_error(request, "overloaded", f"the scheduler's queue is full: "
                                f"{exc}", abort=False)
            return
        if self.table.num_submitted == 0:
            self.note_progress()  # idle time is not a stall
        request.num_prompt_tokens = len(prompt_ids)
        self.table.mark_submitted(request)
        if sampling.prompt_logprobs is not None:
            request.prompt_token_ids = prompt_ids  # sent with their log-probabilities
        elif request.reports_prompt:
            request.peer.send(m.Prompt(request.client_id, len(prompt_ids)))

    def _on_deadline(self, request: OpenRequest, deadline_s: float) -> None:
        if self.table.get(request.request_id) is request:
            self.end_with_error(request, "deadline_exceeded",
                                f"not finished within {deadline_s:g} s", abort=True)

    def is_in_flight(self, connection: Peer, client_id: int) -> bool:
        """Whether `client_id` is the id of a generate open on `connection`: any other
        request with that id is refused `duplicate_id` (its replies would be mistaken for
        the generate's), the generate going on."""
        return self.table.find(connection.connection_id, client_id) is not None

    def on_abort(self, connection: Client, message: m.Abort) -> None:
        """A client's abort of its own request: a final frame with `abort`, then an ack."""
        request = self.table.find(connection.connection_id, message.target)
        if request is None:
            connection.reject(message.id, "not_found", f"no request {message.target} in flight")
            return
        self.abort_in_scheduler([request.request_id])
        delta = m.TokenDelta(request.request_id, num_prompt_tokens=request.num_prompt_tokens,
                             num_output_tokens=request.num_output_tokens)
        self.finish(request, "abort", delta)
        connection.send(m.Ack(message.id, f"aborted {message.target}"))

    def on_rejected(self, message: m.RequestRejected) -> None:
        """The engine refused the request (a token id outside the vocabulary, ...)."""
        request = self.table.get(message.request_id)
        if request is not None:
            self.end_with_error(request, "bad_request", message.message, abort=False)

    def on_connection_closed(self, connection: Peer, reason: str) -> None:
        """The client left: its open requests are aborted."""
        orphans = self.table.of_connection(connection.connection_id)
        for request in orphans:
            self.table.remove(request)
            self.latency.on_end(request)
        if orphans:
            ids = [r.request_id for r in orphans]
            self.abort_in_scheduler(ids)
            log_event(log, logging.INFO, "client_gone", f"connection closed ({reason}); "
                      f"aborted {len(ids)} requests", connection=connection.connection_id,
                      request_ids=ids)
            self.check_drained()

    def end_connection_requests(self, connection: Peer, code: str, reason: str) -> None:
        """The daemon closes `connection` while the client may still read it (a bad frame,
        a bug): each open generate ends with its own error frame of `code` first."""
        for request in self.table.of_connection(connection.connection_id):
            self.end_with_error(request, code, f"the daemon closes the connection: {reason}",
                                abort=True)

    # ---- scheduler -> client -------------------------------------------------------------

    def on_delta(self, delta: m.TokenDelta) -> None:
        """One request's output of a step: streamed or kept, then the request ends if the
        engine finished or failed it, or a stop string appeared in its text (the tokens
        after the one that completed it are dropped: ids, logprobs and counts agree with
        the text)."""
        request = self.table.get(delta.request_id)
        if request is None:
            return  # aborted while the step ran
        request.last_moved = time.monotonic()
        detokenizer = request.detokenizer
        num_before = len(detokenizer.token_ids)
        text = detokenizer.add(delta.new_token_ids)
        token_ids = detokenizer.token_ids[num_before:]
        request.num_output_tokens = (delta.num_output_tokens
                                     - (len(delta.new_token_ids) - len(token_ids)))
        if token_ids:
            request.num_sampling_steps += 1
            if not request.is_warmup:
                self.latency.on_output(request, len(token_ids))
        logprobs = delta.logprobs[:len(token_ids)] if request.want_logprobs else []
        if request.stream:
            if text or token_ids:
                request.peer.send(m.Delta(request.client_id, text, token_ids, logprobs))
        else:
            request.unsent_token_ids.extend(token_ids)
            request.unsent_logprobs.extend(logprobs)
        if delta.error is not None:
            # A failed step was blamed on this request: the engine ended it, others go on.
            self.end_with_error(request, "internal_error", delta.error, abort=False)
        elif detokenizer.is_stopped:
            # A stop string ends the request as "stop" even when the engine finished it in
            # the same step (for its length): the text was cut at the string.
            if delta.finish_reason is None:
                self.abort_in_scheduler([request.request_id])
            self.finish(request, "stop", delta)
        elif delta.finish_reason is not None:
            self.finish(request, delta.finish_reason, delta)

    def on_prompt_logprobs(self, prompt: m.PromptLogprobs) -> None:
        """A request's prompt log-probabilities, before its first output: its `Prompt`
        frame."""
        request = self.table.get(prompt.request_id)
        if request is not None:
            request.peer.send(m.Prompt(request.client_id, request.num_prompt_tokens,
                                       request.prompt_token_ids, prompt.logprobs))

    def finish(self, request: OpenRequest, reason: str, delta: m.TokenDelta) -> None:
        """End the request with its final frame; `delta` holds the engine's last figures
        (the output's count is the request's own: a stop string may have cut it)."""
        rest = request.detokenizer.finish()
        steps = request.num_sampling_steps
        request.peer.send(m.Final(
            id=request.client_id,
            finish_reason=reason,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            text=rest if request.stream else request.detokenizer.text,
            token_ids=request.unsent_token_ids,
            num_cached_tokens=delta.num_cached_tokens,
            num_drafted=delta.num_drafted,
            num_accepted=delta.num_accepted,
            # No step gave the request a token: no figure (0.0), not a claimed 1.0.
            acceptance_length=request.num_output_tokens / steps if steps else 0.0,
            stop_string=request.detokenizer.stop_string,
            logprobs=request.unsent_logprobs,
        ))
        self.counters[f"finished_{reason}"] += 1
        self.counters["output_tokens"] += request.num_output_tokens
        self.counters["prompt_tokens"] += delta.num_prompt_tokens
        self._forget(request)

    def end_with_error(self, request: OpenRequest, code: str, message: str,
                       abort: bool) -> None:
        """End the request with an error frame (`abort`: and abort it in the scheduler).
        The output it produced and the client has not yet seen comes first, in one delta
        (streamed or not): a deadline or a drain keeps what was generated, as an abort
        does."""
        if abort:
            self.abort_in_scheduler([request.request_id])
        self._send_unsent(request)
        request.peer.send(m.Error(request.client_id, code, message))
        self.counters[f"error_{code}"] += 1
        self._forget(request)

    def _send_unsent(self, request: OpenRequest) -> None:
        rest = request.detokenizer.finish()
        text = rest if request.stream else request.detokenizer.text
        if text or request.unsent_token_ids:
            request.peer.send(m.Delta(request.client_id, text, request.unsent_token_ids,
                                      request.unsent_logprobs))

    def _forget(self, request: OpenRequest) -> None:
        self.table.remove(request)
        self.latency.on_end(request)
        self.check_drained()

    def abort_in_scheduler(self, request_ids: list[str]) -> None:
        if not request_ids or self.status.state is State.FAILED:
            return
        try:
            self.scheduler.send(m.AbortRequests(request_ids))
        except LinkSendError as exc:
            log_event(log, logging.ERROR, "abort_lost", f"abort not sent: {exc}",
                      request_ids=request_ids)
