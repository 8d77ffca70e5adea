"""Every open request accounted for: the front's open requests against the engine's.

Every probe interval (`HealthWatch`), and before every status or stats reply, the front
asks the scheduler which requests it holds (`Reconcile`, answered `Holding`). The link
keeps order both ways: the answer is handled after the output of every step the engine
ran before it, and the question after every AddRequest sent before it. So, when the
answer is read:

* a request the front sent before asking, still open, that the engine does not hold is
  **lost** (a bug dropped it: no frame would ever come). It ends with an `internal_error`
  frame naming it, one ERROR record `request_lost`, the counter `requests_lost` and a
  problem that `specctl status` shows and `specctl doctor` fails on;
* a request the engine holds while it is **idle** (no step moved for `idle_after_s`: it
  holds work it does not do) makes the daemon's state `stalled`; once neither the request
  nor the engine moved for `hang_timeout_s`, the request ends the same way (aborted in the
  engine), `request_stalled`;
* a request the engine holds that the front had already ended when it asked (an abort
  that never arrived) is aborted there: one WARNING record `request_orphaned`.

No torch is imported here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from specd.daemon.incidents import Incidents
from specd.daemon.request_flow import RequestFlow
from specd.daemon.request_table import OpenRequest, RequestTable
from specd.daemon.scheduler_queries import SchedulerQueries
from specd.ipc import messages as m
from specd.logs import log_event

log = logging.getLogger("specd.front")


@dataclass(frozen=True)
class _Asked:
    """What the front held when it asked: the AddRequests sent so far and the open ids."""

    num_submissions: int
    open_ids: frozenset[str]


class Reconciler:
    """Asks the scheduler what it holds (`probe`) and settles each answer (`on_holding`)
    against the front's request `table`: ends the lost and stalled requests through
    `requests`, records each kind in `problems`.

    idle_after_s: an engine that has not moved for this long while holding requests is
    idle (the daemon's state says `stalled`); stall_timeout_s: a request that neither moved
    nor saw the engine move for this long ends."""

    def __init__(self, table: RequestTable, requests: RequestFlow, queries: SchedulerQueries,
                 problems: Incidents, *, idle_after_s: float, stall_timeout_s: float) -> None:
        self.table = table
        self.requests = requests
        self.queries = queries
        self.problems = problems
        self.idle_after_s = idle_after_s
        self.stall_timeout_s = stall_timeout_s
        self._asked: dict[int, _Asked] = {}
        self._stalled_ids: list[str] = []  # held by an idle engine at the last answer

    def probe(self) -> None:
        """Ask without waiting (the health watch's probe: any answer shows it alive; a
        status reply's question: the answer is settled before the figures asked after it
        arrive)."""
        self.queries.tell(self._question)

    def _question(self, query_id: int) -> m.Reconcile:
        self._asked[query_id] = _Asked(self.table.num_submissions,
                                       frozenset(r.request_id for r in self.table))
        return m.Reconcile(query_id)

    def stalled_ids(self) -> list[str]:
        """The open requests an idle engine held at the last answer (the `stalled` state)."""
        return [r for r in self._stalled_ids if self.table.get(r) is not None]

    def on_holding(self, holding: m.Holding) -> None:
        """Settle one answer (before `SchedulerQueries.on_reply` wakes whoever waits)."""
        asked = self._asked.pop(holding.query_id, None)
        for query_id in [q for q in self._asked if q < holding.query_id]:
            del self._asked[query_id]  # asked earlier: never answered (a full inbox)
        if asked is None:
            return
        held = set(holding.request_ids)
        is_idle = holding.idle_s >= self.idle_after_s
        now = time.monotonic()
        stalled = []
        for request in self.table:
            if not request.is_submitted or request.submission >= asked.num_submissions:
                continue  # sent after the question: the answer cannot know it
            if request.request_id not in held:
                self._end_lost(request, holding, now)
            elif is_idle and min(now - request.last_moved,
                                 holding.idle_s) >= self.stall_timeout_s:
                self._end_stalled(request, holding, now)
            elif is_idle:
                stalled.append(request.request_id)
        self._stalled_ids = stalled
        orphans = sorted(r for r in held - asked.open_ids if self.table.get(r) is None)
        if orphans:
            log_event(log, logging.WARNING, "request_orphaned",
                      f"the engine held {len(orphans)} requests the front had ended; "
                      "aborted there", request_ids=orphans)
            self.requests.abort_in_scheduler(orphans)

    def _end_lost(self, request: OpenRequest, holding: m.Holding, now: float) -> None:
        what = (f"request {request.request_id} was lost: the scheduler no longer holds it, "
                f"{request.num_output_tokens} tokens after it started "
                f"({now - request.started:.1f} s ago); a bug in specd")
        self._end(request, "request_lost", "requests_lost", what, holding)

    def _end_stalled(self, request: OpenRequest, holding: m.Holding, now: float) -> None:
        what = (f"request {request.request_id} stalled: the scheduler holds it but ran no "
                f"step for {holding.idle_s:.1f} s, and it has had no output for "
                f"{now - request.last_moved:.1f} s ({request.num_output_tokens} tokens so "
                "far); a bug in specd")
        self._end(request, "request_stalled", "requests_stalled", what, holding)

    def _end(self, request: OpenRequest, event: str, kind: str, what: str,
             holding: m.Holding) -> None:
        log_event(log, logging.ERROR, event, what, request_id=request.request_id,
                  client_id=request.client_id, connection=request.peer.connection_id,
                  num_output_tokens=request.num_output_tokens,
                  engine_holds=len(holding.request_ids), engine_idle_s=round(holding.idle_s, 3))
        self.problems.record(kind, what)
        # Aborted too: a stalled request is still the engine's, and a lost one may have
        # left state behind there (the abort of a request it does not hold is a no-op).
        self.requests.end_with_error(request, "internal_error", what + f" (see the log: "
                                     f"{event})", abort=True)
