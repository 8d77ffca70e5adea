"""The front's table of open generate requests, by scheduler request id and by connection.

A request is open from the moment it is admitted (its prompt may still be tokenizing) until
its Final or Error frame is written; it is *submitted* once its AddRequest was sent. The
scheduler may still send output for a request after it left the table (an abort crosses a
step in flight), and such output is dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Protocol

from specd.daemon.detokenizer import IncrementalDetokenizer
from specd.ipc import messages as m


class Peer(Protocol):
    """The connection a request answers to (daemon.server.Connection)."""

    connection_id: int

    def send(self, message: m.ServerMessage) -> None: ...


class OpenRequest:
    """One in-flight generate request: where its output goes and what has been produced."""

    def __init__(self, request_id: str, client_id: int, peer: Peer,
                 detokenizer: IncrementalDetokenizer, stream: bool, num_prompt_tokens: int,
                 want_logprobs: bool, is_warmup: bool = False) -> None:
        self.request_id = request_id
        self.client_id = client_id
        self.peer = peer
        self.detokenizer = detokenizer
        self.stream = stream
        self.num_prompt_tokens = num_prompt_tokens
        self.want_logprobs = want_logprobs
        self.is_warmup = is_warmup  # the front's own warm-up request (daemon/http_warmup.py)
        self.started = time.monotonic()
        self.deadline: asyncio.TimerHandle | None = None
        # Output not yet sent to the client (all of it when not streaming).
        self.unsent_token_ids: list[int] = []
        self.unsent_logprobs: list[m.Logprob] = []
        # A `Prompt` frame goes before its first delta (Generate.report_prompt; with the
        # log-probabilities when its sampling asks for prompt_logprobs: `prompt_token_ids`
        # are kept for it).
        self.reports_prompt = False
        self.prompt_token_ids: list[int] = []
        self.num_output_tokens = 0
        self.num_sampling_steps = 0  # steps that gave this request tokens (acceptance length)
        self.is_submitted = False  # its AddRequest was sent (see RequestTable.mark_submitted)
        # Its place among the AddRequests sent (-1: not sent): the reconciliation checks
        # only requests sent before its question (daemon/reconcile.py).
        self.submission = -1
        self.last_moved = self.started  # submitted, or its last output arrived


class RequestTable:
    """Open requests; `len()` is what admission control counts, `num_submitted` those the
    scheduler has (what the hang watchdog waits on), `num_submissions` the AddRequests sent
    since the front started."""

    def __init__(self) -> None:
        self._by_id: dict[str, OpenRequest] = {}
        self._by_peer: dict[int, dict[int, OpenRequest]] = {}
        self.num_submitted = 0
        self.num_submissions = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[OpenRequest]:
        return iter(list(self._by_id.values()))

    def add(self, request: OpenRequest) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request id {request.request_id} is already open")
        self._by_id[request.request_id] = request
        self._by_peer.setdefault(request.peer.connection_id, {})[request.client_id] = request

    def mark_submitted(self, request: OpenRequest) -> None:
        """`request` (open, not yet submitted) was sent to the scheduler."""
        if self._by_id.get(request.request_id) is not request or request.is_submitted:
            raise ValueError(f"request {request.request_id} is not open and unsubmitted")
        request.is_submitted = True
        request.submission = self.num_submissions
        request.last_moved = time.monotonic()
        self.num_submitted += 1
        self.num_submissions += 1

    def get(self, request_id: str) -> OpenRequest | None:
        return self._by_id.get(request_id)

    def find(self, connection_id: int, client_id: int) -> OpenRequest | None:
        return self._by_peer.get(connection_id, {}).get(client_id)

    def of_connection(self, connection_id: int) -> list[OpenRequest]:
        return list(self._by_peer.get(connection_id, {}).values())

    def remove(self, request: OpenRequest) -> None:
        """Forget `request` (idempotent) and cancel its deadline timer."""
        if self._by_id.pop(request.request_id, None) is None:
            return
        if request.is_submitted:
            self.num_submitted -= 1
        peer_requests = self._by_peer.get(request.peer.connection_id, {})
        peer_requests.pop(request.client_id, None)
        if not peer_requests:
            self._by_peer.pop(request.peer.connection_id, None)
        if request.deadline is not None:
            request.deadline.cancel()
