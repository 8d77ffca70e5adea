"""The front's reconciliation of its open requests against what the engine holds: only
requests sent before the question are judged, a lost one ends at once, a held one of an
idle engine is `stalled` and ends after the stall timeout, one the front already ended is
aborted in the engine."""

from __future__ import annotations

import time
from collections import Counter
from typing import cast

from specd.daemon.detokenizer import IncrementalDetokenizer
from specd.daemon.incidents import Incidents
from specd.daemon.reconcile import Reconciler
from specd.daemon.request_flow import RequestFlow
from specd.daemon.request_table import OpenRequest, RequestTable
from specd.daemon.scheduler_handle import SchedulerHandle
from specd.daemon.scheduler_queries import SchedulerQueries
from specd.ipc import messages as m

STALL_S = 10.0


class _Peer:
    connection_id = 1

    def send(self, message: m.ServerMessage) -> None:
        raise AssertionError("the fake flow ends requests itself")


class _Flow:
    """What the reconciler uses of RequestFlow: it ends and aborts requests."""

    def __init__(self, table: RequestTable) -> None:
        self.table = table
        self.ended: list[tuple[str, str, str]] = []
        self.aborted: list[str] = []

    def end_with_error(self, request: OpenRequest, code: str, message: str,
                       abort: bool) -> None:
        self.ended.append((request.request_id, code, message))
        if abort:
            self.aborted.append(request.request_id)
        self.table.remove(request)

    def abort_in_scheduler(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


class _Link:
    def __init__(self) -> None:
        self.sent: list[m.ToScheduler] = []

    def send(self, message: m.ToScheduler) -> None:
        self.sent.append(message)


def _setup() -> tuple[RequestTable, _Flow, _Link, Incidents, Reconciler]:
    table = RequestTable()
    flow = _Flow(table)
    link = _Link()
    problems = Incidents(Counter())
    reconciler = Reconciler(table, cast(RequestFlow, flow),
                            SchedulerQueries(cast(SchedulerHandle, link)),
                            problems, idle_after_s=1.0, stall_timeout_s=STALL_S)
    return table, flow, link, problems, reconciler


def _open(table: RequestTable, request_id: str, submit: bool = True) -> OpenRequest:
    request = OpenRequest(request_id, len(table), _Peer(),
                          cast(IncrementalDetokenizer, None), True, 3, False)
    table.add(request)
    if submit:
        table.mark_submitted(request)
    return request


def _asked(link: _Link) -> int:
    question = link.sent[-1]
    assert isinstance(question, m.Reconcile)
    return question.query_id


def test_a_request_sent_before_the_question_and_not_held_is_lost() -> None:
    table, flow, link, problems, reconciler = _setup()
    _open(table, "r1")
    _open(table, "r2")
    reconciler.probe()
    late = _open(table, "r3")  # sent after the question: the answer cannot know it
    reconciler.on_holding(m.Holding(_asked(link), ["r2"], idle_s=0.0))
    assert [(rid, code) for rid, code, _ in flow.ended] == [("r1", "internal_error")]
    assert "request r1 was lost: the scheduler no longer holds it" in flow.ended[0][2]
    assert table.get("r2") is not None and table.get(late.request_id) is not None
    assert problems.counters["requests_lost"] == 1
    assert problems.summary()["requests_lost"].startswith("1 since start; last: request r1")
    assert reconciler.stalled_ids() == []


def test_a_request_not_yet_submitted_or_answered_for_another_question_is_not_judged() -> None:
    table, flow, link, _, reconciler = _setup()
    _open(table, "r1", submit=False)  # still tokenizing: not the engine's yet
    reconciler.probe()
    reconciler.on_holding(m.Holding(_asked(link) + 7, [], idle_s=0.0))  # asked by nobody
    reconciler.on_holding(m.Holding(_asked(link), [], idle_s=0.0))
    assert flow.ended == []


def test_an_idle_engine_holding_a_request_is_stalled_then_the_request_ends() -> None:
    table, flow, link, problems, reconciler = _setup()
    request = _open(table, "r1")
    reconciler.probe()
    reconciler.on_holding(m.Holding(_asked(link), ["r1"], idle_s=0.5))
    assert reconciler.stalled_ids() == []  # the engine moved half a second ago
    reconciler.probe()
    reconciler.on_holding(m.Holding(_asked(link), ["r1"], idle_s=2.0))
    assert reconciler.stalled_ids() == ["r1"] and flow.ended == []
    request.last_moved = time.monotonic() - STALL_S  # neither moved for the stall timeout
    reconciler.probe()
    reconciler.on_holding(m.Holding(_asked(link), ["r1"], idle_s=STALL_S + 1))
    ((rid, code, message),) = flow.ended
    assert (rid, code) == ("r1", "internal_error") and "stalled" in message
    assert flow.aborted == ["r1"] and problems.counters["requests_stalled"] == 1
    assert reconciler.stalled_ids() == []


def test_a_new_request_to_a_long_idle_engine_gets_its_own_stall_timeout() -> None:
    table, flow, link, _, reconciler = _setup()
    _open(table, "r1")  # just submitted to an engine idle for an hour
    reconciler.probe()
    reconciler.on_holding(m.Holding(_asked(link), ["r1"], idle_s=3600.0))
    assert flow.ended == [] and reconciler.stalled_ids() == ["r1"]


def test_a_request_the_front_had_ended_is_aborted_in_the_engine() -> None:
    table, flow, link, problems, reconciler = _setup()
    gone = _open(table, "r1")
    table.remove(gone)  # ended before the question, its abort lost on the way
    _open(table, "r2")
    reconciler.probe()
    reconciler.on_holding(m.Holding(_asked(link), ["r1", "r2"], idle_s=0.0))
    assert flow.aborted == ["r1"] and flow.ended == []
    assert not problems.last
