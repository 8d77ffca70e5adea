"""Failure isolation: an exception in a step that one request caused ends that request,
not the engine.

When a step raises, `EngineCore` drops the step in flight (overlap scheduling), resets the
scheduler (pending samples and drafts forgotten, every running sequence preempted and
recomputed, which is lossless for greedy requests) and tells `Isolation.on_failure` the
unfinished requests of the failed step(s):

* one request: it is the culprit at once;
* several: they become suspects, and a round of isolation starts. The engine runs one
  suspect alone per step (`next_alone`; the other requests wait) until it has produced a
  new token or finished (`after_step`: cleared); a suspect whose step alone raises is a
  culprit. When every suspect has been tried, the culprits are ended and normal batching
  resumes.

A culprit ends (`take_culprits`) with finish reason "error" and its exception's one-line
summary (`describe`), which the front sends as an `internal_error` for that request only,
and one log record (event "request_failed") with the traceback. A failure is
unattributable, and `StepFailed` (chained to the step's exception) leaves the engine so
that the scheduler process exits 75 as for any error there, when: no suspect fails alone,
or none runs alone without failing (a fault that fails every step fails the engine, not
each request); the failed step scheduled no request; or a step fails again before any step
has succeeded since a lone culprit was named (a device that fails every step, as after a
sticky CUDA error, would otherwise fail the requests one by one). An exception outside
`EngineCore.step`, or in the reset itself, is never isolated.

Each isolation is one log record (event "step_failure": cause, request ids, culprits,
cleared, outcome) and counted (`num_step_failures`, `num_requests_failed` in the engine
stats, which `specctl stats` shows).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from specd.workers.engine.sequence import Sequence

log = logging.getLogger("specd.engine")


class StepFailed(RuntimeError):
    """A step raised and no request could be blamed; the step's exception is the cause."""


def describe(error: BaseException) -> str:
    """The one-line summary a failed request carries: `TypeName: first line`."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@dataclass
class _Round:
    """One isolation: the failed step's exception and its suspects, in arrival order."""

    error: Exception
    request_ids: list[str]
    untried: deque[str]
    culprits: dict[str, Exception] = field(default_factory=dict)  # failed alone
    cleared: list[str] = field(default_factory=list)  # ran alone without failing, or left
    current: str | None = None  # the suspect running alone
    baseline: int = 0  # its output tokens when it started running alone


class Isolation:
    """Whom a failed step is blamed on, and which request the next step runs alone."""

    def __init__(self) -> None:
        self.round: _Round | None = None
        # Culprits decided and not ended yet: request id -> the exception blamed on it.
        self.verdict: dict[str, Exception] = {}
        # A lone culprit was named and no step has succeeded since.
        self.unconfirmed = False
        self.num_step_failures = 0  # failed steps blamed on requests (one per isolation)
        self.num_requests_failed = 0  # requests ended with an error

    @property
    def is_active(self) -> bool:
        """Whether suspects are left to run alone (the engine has work while it is)."""
        return self.round is not None

    def next_alone(self, sequences: Mapping[str, Sequence]) -> str | None:
        """The request the next step runs alone, or None for a normal step. `sequences`:
        the unfinished ones by id (a suspect no longer there, aborted, is skipped). Ends
        the round once every suspect was tried (StepFailed if it blames no one)."""
        r = self.round
        if r is None:
            return None
        if r.current is not None:
            if r.current in sequences:
                return r.current
            r.cleared.append(r.current)
            r.current = None
        while r.untried:
            request_id = r.untried.popleft()
            seq = sequences.get(request_id)
            if seq is not None:
                r.current, r.baseline = request_id, seq.num_output_tokens
                return request_id
            r.cleared.append(request_id)
        self._end_round(r)
        return None

    def after_step(self, sequences: Mapping[str, Sequence], ran: bool) -> None:
        """After a step that did not raise (`ran`: it applied a step's results). The
        suspect running alone is cleared once it produced a token or finished; the round
        ends after its last suspect (StepFailed if it blames no one)."""
        if ran:
            self.unconfirmed = False
        r = self.round
        if r is None or r.current is None:
            return
        seq = sequences.get(r.current)
        if seq is None or seq.num_output_tokens > r.baseline:
            r.cleared.append(r.current)
            r.current = None
            if not r.untried:
                self._end_round(r)

    def on_failure(self, error: Exception, alone: str | None, suspects: list[str]) -> None:
        """A step raised `error`. `alone`: the suspect the step ran alone, if any;
        `suspects`: the unfinished requests of the failed step(s), in arrival order.
        StepFailed when the failure is unattributable (see the module docstring)."""
        r = self.round
        if r is not None and alone is not None:
            r.culprits[alone] = error
            r.current = None
            if not r.untried:
                self._end_round(r)
            return
        if r is not None:
            raise StepFailed("a step failed while isolating a failed step") from error
        if self.unconfirmed:
            self._record(error, suspects, [], [], "unattributable")
            raise StepFailed(f"a step failed again ({describe(error)}) before any step "
                             "succeeded since the last request was failed") from error
        if not suspects:
            raise StepFailed(f"a step failed ({describe(error)}) with no request in it "
                             "to blame") from error
        self.num_step_failures += 1
        if len(suspects) > 1:
            self.round = _Round(error, list(suspects), deque(suspects))
            return
        self.unconfirmed = True
        self.verdict[suspects[0]] = error
        self._record(error, suspects, suspects, [], "failed")

    def take_culprits(self) -> dict[str, Exception]:
        """The requests to end with an error now (each logged once, with its traceback),
        and the exception blamed on each."""
        verdict, self.verdict = self.verdict, {}
        for request_id, error in verdict.items():
            self.num_requests_failed += 1
            log.error("request %s failed: %s", request_id, describe(error), exc_info=error,
                      extra={"event": "request_failed", "request_id": request_id})
        return verdict

    def _end_round(self, r: _Round) -> None:
        self.round = None
        culprits = list(r.culprits)
        if not culprits or not r.cleared:
            self._record(r.error, r.request_ids, culprits, r.cleared, "unattributable")
            which = "none of them fails alone" if not culprits else "each fails alone"
            raise StepFailed(f"a step of requests {r.request_ids} failed "
                             f"({describe(r.error)}) and {which}") from r.error
        self.verdict.update(r.culprits)
        self._record(r.error, r.request_ids, culprits, r.cleared, "failed")

    @staticmethod
    def _record(error: Exception, request_ids: list[str], culprits: list[str],
                cleared: list[str], outcome: str) -> None:
        """The one record of an isolation (outcome "failed": the culprits end, the others
        go on; "unattributable": the engine raises StepFailed)."""
        log.log(logging.ERROR if outcome == "unattributable" else logging.WARNING,
                "step failure: %s (%s)", outcome, describe(error), extra={
                    "event": "step_failure", "cause": describe(error),
                    "request_ids": request_ids, "culprits": culprits, "cleared": cleared,
                    "outcome": outcome})
