"""`specctl status` as text: one line per fact, the problems first-screen visible (a scheduler
that does not answer, a fallback in force, a request the scheduler lost), the `?` of a
missing figure never standing in for them."""

from __future__ import annotations

from typing import Any

from specd.ipc.messages import StatusReply


def status_lines(reply: StatusReply) -> list[str]:
    """The text of `specctl status` for `reply`."""
    engine = reply.engine
    front = reply.provenance.get("front", {})
    lines = [
        f"state        {reply.state}",
        f"model        {reply.model}",
        f"version      specd {reply.version}, protocol {reply.protocol}",
        *provenance_lines(front, reply.provenance.get("scheduler", {})),
        f"uptime       {reply.uptime_s:.0f} s",
        f"requests     {reply.num_open_requests} open, {reply.num_connections} connections",
    ]
    if "error" in engine:
        lines.append(f"scheduler    {engine['error']}; process {engine.get('scheduler_pid')} is "
                     f"{engine.get('scheduler_process')}")
        if reply.fallbacks:  # the front's own, known without the scheduler
            lines += fallback_lines(reply.fallbacks)
    elif engine:
        lines += [
            f"batch        {engine.get('num_running', '?')} running, "
            f"{engine.get('num_waiting', '?')} waiting",
            f"kv blocks    {engine.get('num_free_kv_blocks', '?')} free of "
            f"{engine.get('num_kv_blocks', '?')}, "
            f"{reply.resolved.get('kv_bytes_per_token', '?')} bytes per token",
            f"kv cache     {reply.resolved.get('kv_cache_tokens', '?')} tokens in a budget of "
            f"{reply.resolved.get('kv_budget_bytes', '?')} bytes "
            f"({reply.resolved.get('kv_budget_source', '?')})",
            f"speculation  mode {engine.get('spec_mode', '?')}, active "
            f"{engine.get('spec_active', '?')}, drafted {engine.get('num_drafted', 0)}, "
            f"accepted {engine.get('num_accepted', 0)}" + threshold_text(engine),
            *fallback_lines({**(engine.get("fallbacks") or {}), **reply.fallbacks}),
        ]
    lines += problem_lines({**(engine.get("problems") or {}), **reply.problems})
    for key, value in reply.resolved.items():
        lines.append(f"resolved     {key} = {value}")
    return lines


def threshold_text(engine: dict[str, Any]) -> str:
    """Auto mode's live marks (what the last `spec` request set); "" without a draft."""
    if engine.get("spec_threshold") is None:
        return ""
    return (f", off above {engine['spec_threshold']} running, on again at "
            f"{engine.get('spec_resume_at', '?')}")


def fallback_lines(fallbacks: dict[str, str]) -> list[str]:
    """`fallbacks    none`, or one line per fallback in force with its reason."""
    if not fallbacks:
        return ["fallbacks    none"]
    return [f"fallback     {name}: {reason}" for name, reason in sorted(fallbacks.items())]


def problem_lines(problems: dict[str, str]) -> list[str]:
    """`problems     none`, or one line per kind of problem seen (the front's: a lost or
    stalled request, a removed socket file; the engine's: a draft head whose drafts are
    not accepted) with how often and the last case."""
    if not problems:
        return ["problems     none"]
    return [f"problem      {name}: {text}" for name, text in sorted(problems.items())]


def provenance_lines(front: dict[str, Any], scheduler: dict[str, Any]) -> list[str]:
    """Which code runs: its fingerprint (and whether the scheduler's matches), where it is
    installed from, editable or not, and the checkout's git commit when there is one."""
    version = front.get("code_version", "?")
    if not scheduler:
        agreement = "scheduler not ready"
    elif scheduler.get("code_version") == version:
        agreement = "scheduler the same"
    else:
        agreement = f"scheduler {scheduler.get('code_version')}"
    install = front.get("install", {})
    kind = "editable" if install.get("editable") else "regular"
    if not install.get("installed"):
        kind = "not installed"
    git = front.get("git") or {}
    commit = (f", git {git['sha'][:12]}" + (f" ({git['branch']})" if git.get("branch") else "")
              if git.get("sha") else "")
    return [
        f"code         {version} over {front.get('num_source_files', '?')} files, {agreement}",
        f"install      {kind}, {front.get('root', '?')}{commit}",
    ]
