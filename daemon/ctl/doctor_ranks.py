"""`specctl doctor`'s tensor-parallel checks: the ranks of the running daemon, and the
failure the last run left in its log.

The ranks come from the status (`resolved.ranks`, "rank R pid P on DEVICE", what the
scheduler reported with Ready); each one's process state is read from /proc where doctor
runs, except for a rank of another node ("... of node N (HOST)"), which node 0 watches
through that node's beats. A stopped rank stalls the next step until the hang timeout, a
gone (or zombie) one fails it: either is a problem named here before any request meets it.

A daemon that exits on a failure answers no status; what the run left is its log. With
`--log PATH` (`-`: stdin, as in `journalctl -u specd -o cat | specctl doctor --log -`)
doctor reads its JSON records (`--log-format json`, as the service logs): the last
`scheduler_failed` record, whose message or traceback names a failed rank as
"rank R (pid P on DEVICE)" (workers/parallel/driver.py), and the `ready` record of the same
run (the same front pid), with the ranks that run served. A failure names no rank when
none was seen failing (a hang: the record then holds the stacks of rank 0, waiting).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from typing import Any

from specd.daemon.ctl.check_result import CheckResult
from specd.daemon.scheduler_handle import process_state
from specd.ipc.messages import StatusReply

RANK_ENTRY = re.compile(r"rank (\d+) pid (\d+) on (\S+)")
FAILED_RANK = re.compile(r"rank (\d+) \(pid (\d+) on ([^)]+)\)")
# States in which a rank cannot take part in the next step.
DOWN_STATES = ("stopped", "a zombie", "dead", "gone")
REMOTE_RANK = " of node "
REMOTE_STATE = "on another node (node 0 watches it; silent for 5 s fails the daemon)"


def check_ranks(status: StatusReply) -> CheckResult | None:
    """Each rank's device and process state (None in one process: no ranks); fails naming
    every rank that is stopped or has exited."""
    every: list[str] = list(status.resolved.get("ranks") or [])
    if not every:
        return None
    # A rank of another node ("... of node N (HOST)") has its process there: node 0 watches
    # that node's beats (a silent node fails the daemon), this /proc cannot see it.
    entries = [entry for entry in every if REMOTE_RANK not in entry]
    remote = [f"{entry}: {REMOTE_STATE}" for entry in every if REMOTE_RANK in entry]
    pids = [_rank_pid(entry) for entry in entries]
    states = [process_state(pid) for pid in pids]
    if states[0] == "gone":  # rank 0 answered the status: this /proc does not show it
        return CheckResult("ranks", True, "; ".join(every) + " (their process states are "
                           "not visible from here: another PID namespace)")
    detail = "; ".join([f"{entry}: {state}" for entry, state in
                        zip(entries, states, strict=True)] + remote)
    down = [(entry, pid, state) for entry, pid, state in zip(entries, pids, states, strict=True)
            if state.startswith(DOWN_STATES)]
    if not down:
        return CheckResult("ranks", True, detail)
    advice = []
    for entry, pid, state in down:
        name = entry.split(" pid ")[0]
        if state.startswith("stopped"):
            advice.append(f"{name} is stopped: kill -CONT {pid} (a step waits for it until "
                          "--hang-timeout-s, then the daemon exits 75)")
        else:
            advice.append(f"{name} has exited: the next step fails the daemon (exit 75); its "
                          "log and the kernel's (the OOM killer: journalctl -k) say why")
    return CheckResult("ranks", False, "failed: " + ", ".join(e for e, _, _ in down)
                       + "; " + detail, "; ".join(advice))


def _rank_pid(entry: str) -> int:
    match = RANK_ENTRY.match(entry)
    if match is None:
        raise ValueError(f"status: a rank entry is not 'rank R pid P on DEVICE': {entry!r}")
    return int(match.group(2))


def read_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON records among `lines` (lines of other programs, or text-format records,
    skipped: a JSON record is one line starting with `{`)."""
    return [json.loads(line) for line in (raw.strip() for raw in lines)
            if line.startswith("{") and line.endswith("}")]


def check_last_failure(records: list[dict[str, Any]]) -> CheckResult:
    """The log's last `scheduler_failed` record: the failed rank (its pid and device) and
    the ranks of that run. Fails unless a later run got ready since (the service restarted
    it), or when the log has no JSON records to read."""
    if not records:
        return CheckResult("last failure", False, "the log holds no JSON records",
                           "pass the daemon's log as JSON lines (--log-format json, as the "
                           "service logs: journalctl -u specd -o cat | specctl doctor --log -)")
    failures = [r for r in records if r.get("event") == "scheduler_failed"]
    if not failures:
        return CheckResult("last failure", True, f"none in {len(records)} log records")
    failed = failures[-1]
    run_ranks = _ranks_of_run(records, failed)
    detail = (f"{_when(failed)}, front pid {failed.get('pid')}, exit {failed.get('exit_code')}: "
              f"{failed.get('msg')}" + _rank_text(failed, run_ranks))
    restarted = any(r.get("event") == "ready" and r.get("ts", 0) > failed.get("ts", 0)
                    for r in records)
    if restarted:
        return CheckResult("last failure", True, "a run since got ready; the one before "
                           f"failed at {detail}")
    return CheckResult("last failure", False, detail,
                       "the record's scheduler_traceback has the stacks or traceback; fix the "
                       "cause (a rank killed: the OOM killer, journalctl -k) and restart")


def _ranks_of_run(records: list[dict[str, Any]], failed: dict[str, Any]) -> list[str]:
    """The ranks the failed run served: its `ready` record's (none if it failed loading)."""
    ready = [r for r in records if r.get("event") == "ready" and r.get("pid") == failed.get("pid")
             and r.get("ts", 0) <= failed.get("ts", 0)]
    if not ready:
        return []
    ranks: list[str] = ready[-1].get("resolved", {}).get("ranks") or []
    return ranks


def _rank_text(failed: dict[str, Any], ranks: list[str]) -> str:
    """"; failed rank R (pid P on DEVICE); ranks: ..." from the record and its run."""
    text = ""
    match = (FAILED_RANK.search(str(failed.get("msg", "")))
             or FAILED_RANK.search(str(failed.get("scheduler_traceback") or "")))
    if match is not None:
        text = f"; failed rank {match.group(1)} (pid {match.group(2)} on {match.group(3)})"
    elif ranks:
        text = "; the record names no failed rank"
    if ranks:
        text += "; the run's ranks: " + ", ".join(ranks)
    return text


def _when(record: dict[str, Any]) -> str:
    ts = record.get("ts")
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "(no time)"
