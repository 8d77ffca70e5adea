"""`specctl status` as text: fallbacks, an unresponsive scheduler and the install, each on
its own line, and no `?` figures standing in for a scheduler that did not answer."""

from __future__ import annotations

from typing import Any

from specd.daemon.ctl.status_text import status_lines
from specd.ipc import messages as m


def _reply(engine: dict[str, Any], state: str = "ready",
           front: dict[str, Any] | None = None) -> m.StatusReply:
    front = front if front is not None else {
        "code_version": "0123456789abcdef", "num_source_files": 140,
        "root": "/srv/specd/venv/lib/python3.11/site-packages/specd",
        "git": None, "install": {"installed": True, "version": "0.1.0", "editable": False}}
    return m.StatusReply(
        id=1, state=state, protocol=1, version="0.1.0", uptime_s=12.0, model="fixture",
        num_open_requests=0, num_connections=1, resolved={"model_name": "fixture"},
        engine=engine, provenance={"front": front,
                                   "scheduler": {"code_version": front["code_version"]}},
        config={})


def test_each_fallback_is_a_line_with_its_reason() -> None:
    lines = status_lines(_reply({"num_running": 0, "fallbacks": {
        "cuda_graphs_draft_loop": "the draft loop runs eagerly: capture of (4, 32) failed",
        "cuda_graphs": "the target's forwards run eagerly: capture of ... failed"}}))
    assert [x for x in lines if x.startswith("fallback")] == [
        "fallback     cuda_graphs: the target's forwards run eagerly: capture of ... failed",
        "fallback     cuda_graphs_draft_loop: the draft loop runs eagerly: capture of "
        "(4, 32) failed"]
    assert "fallbacks    none" in status_lines(_reply({"num_running": 0, "fallbacks": {}}))


def test_a_scheduler_that_did_not_answer_is_named_instead_of_its_figures() -> None:
    lines = status_lines(_reply({
        "error": "the scheduler did not answer", "scheduler_pid": 42,
        "scheduler_process": "stopped (state T: SIGSTOP or SIGTSTP; SIGCONT resumes it)"},
        state="unresponsive"))
    assert lines[0] == "state        unresponsive"
    assert ("scheduler    the scheduler did not answer; process 42 is stopped (state T: "
            "SIGSTOP or SIGTSTP; SIGCONT resumes it)") in lines
    assert not any(x.startswith(("batch", "kv blocks", "speculation", "fallback"))
                   for x in lines)


def test_the_code_and_its_install_are_shown() -> None:
    lines = status_lines(_reply({}))
    assert "code         0123456789abcdef over 140 files, scheduler the same" in lines
    assert ("install      regular, /srv/specd/venv/lib/python3.11/site-packages/specd"
            in lines)
    checkout = {"code_version": "fedcba9876543210", "num_source_files": 140,
                "root": "/home/me/specd/specd", "install": {"installed": False},
                "git": {"sha": "92818fdfb6261f2e8f2ac1d7c5e0a3b4c5d6e7f8", "branch": "main"}}
    lines = status_lines(_reply({}, front=checkout))
    assert "install      not installed, /home/me/specd/specd, git 92818fdfb626 (main)" in lines


def test_the_live_speculation_threshold_is_shown_with_the_mode() -> None:
    engine = {"num_running": 0, "spec_mode": "auto", "spec_active": True,
              "spec_threshold": 12, "spec_resume_at": 9}
    (line,) = [x for x in status_lines(_reply(engine)) if x.startswith("speculation")]
    assert line.endswith("off above 12 running, on again at 9")
    engine.update(spec_mode="off", spec_active=False, spec_threshold=None)
    (line,) = [x for x in status_lines(_reply(engine)) if x.startswith("speculation")]
    assert "above" not in line  # no draft model: no threshold to show


def test_each_problem_and_the_fronts_fallbacks_are_lines_the_engine_unknown_or_not() -> None:
    reply = _reply({"num_running": 0, "fallbacks": {},
                    "problems": {"spec_acceptance_low": "drafts 2.5% accepted"}})
    reply = m.StatusReply(**{**{f: getattr(reply, f) for f in reply.__struct_fields__},
                             "problems": {"requests_lost": "1 since start; last: request r1"},
                             "fallbacks": {"http_handler": "1 since start; last: KeyError"}})
    lines = status_lines(reply)
    assert "fallback     http_handler: 1 since start; last: KeyError" in lines
    assert [x for x in lines if x.startswith("problem")] == [
        "problem      requests_lost: 1 since start; last: request r1",
        "problem      spec_acceptance_low: drafts 2.5% accepted"]
    assert "problems     none" in status_lines(_reply({"num_running": 0}))
    silent = m.StatusReply(**{**{f: getattr(reply, f) for f in reply.__struct_fields__},
                              "engine": {"error": "the scheduler did not answer"}})
    assert "fallback     http_handler: 1 since start; last: KeyError" in status_lines(silent)
