"""`specctl doctor`: what an operator checks first when something is wrong.

Each check returns ok or the problem with what to do. Checks that need the daemon are
reported as failed (with the reason) when it cannot be reached; local checks still run.
A tensor-parallel daemon's ranks, and the failure a run left in a log passed with `--log`,
are checked by doctor_ranks.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specd import provenance
from specd.daemon.ctl.check_result import CheckResult
from specd.daemon.ctl.doctor_ranks import check_last_failure, check_ranks, read_records
from specd.ipc.client import Client
from specd.ipc.errors import SpecdError
from specd.ipc.messages import StatusReply


def _tree(modules: dict[str, str]) -> str:
    """The directory the `specd` package was imported from."""
    path = modules.get("specd")
    return str(Path(path).parent.parent) if path else "?"


def check_local_install() -> CheckResult:
    info = provenance.install_info()
    dirs = provenance.package_dirs()
    where = ", ".join(f"{k}={v}" for k, v in dirs.items())
    if not info.get("installed"):
        return CheckResult("install", False, f"specd is not installed; imported from {where}",
                           "pip install . (or -e . for development)")
    kind = "editable (source tree)" if info.get("editable") else "installed copy"
    return CheckResult("install", True, f"specd {info.get('version')} {kind}; code "
                       f"{provenance.code_version()}; packages at {where}")


def check_daemon(status: StatusReply | None, error: str) -> CheckResult:
    if status is None:
        gone = ("; if specd runs (systemctl status specd) its socket file was removed: "
                "systemctl restart specd.socket specd" if "No such file" in error else "")
        return CheckResult("daemon", False, error, "start it (specd or systemctl start specd) "
                           "and check --socket / $SPECD_SOCKET; why a run ended: "
                           "journalctl -u specd -o cat | specctl doctor --log -" + gone)
    ok = status.state == "ready"
    engine = status.engine
    silent = (f"; {engine['error']}, process {engine.get('scheduler_pid')} is "
              f"{engine.get('scheduler_process')}" if "error" in engine else "")
    advice = "see the daemon's log (journalctl -u specd)"
    if str(engine.get("scheduler_process", "")).startswith("stopped"):
        advice = (f"someone stopped the scheduler: kill -CONT {engine.get('scheduler_pid')} "
                  "(the daemon exits 75 after --hang-timeout-s without an answer)")
    elif status.state == "stalled":
        advice = ("the engine holds open requests but runs no step for them (a bug in "
                  "specd): they end with an error after --hang-timeout-s, each logged as "
                  "request_stalled; report it")
    return CheckResult("daemon", ok, f"state {status.state}, model {status.model}, up "
                       f"{status.uptime_s:.0f} s, {status.num_open_requests} open requests"
                       + silent, "" if ok else advice)


def check_fallbacks(status: StatusReply) -> CheckResult:
    """A documented fallback in force (a failed capture or compilation: that part runs
    eagerly, slower than configured; an HTTP handler that raised) is a problem to fix, not
    a state to serve in."""
    fallbacks: dict[str, str] = {**(status.engine.get("fallbacks") or {}), **status.fallbacks}
    if not fallbacks:
        return CheckResult("fallbacks", True, "none: everything runs as configured")
    return CheckResult(
        "fallbacks", False, "degraded: " + "; ".join(
            f"{name}: {reason}" for name, reason in sorted(fallbacks.items())),
        "the daemon's log has each failure once with its traceback (journalctl -u specd); "
        "fix the cause and restart, or turn the option off")


# What to do about each kind of problem (StatusReply.problems, the front's and the engine's).
PROBLEM_ADVICE = {
    "requests_lost": "the scheduler dropped requests it was serving (a bug in specd): "
                     "report it with the request_lost records of the log",
    "requests_stalled": "the engine held requests it ran no step for (a bug in specd): "
                        "report it with the request_stalled records of the log",
    "socket_missing": "the socket file was removed while the daemon ran: restart "
                      "specd.socket and specd (systemctl restart specd.socket specd)",
    "spec_acceptance_low": "the draft head's drafts are rarely accepted: check that "
                           "--draft-model is the head trained for this model (and its "
                           "tokenizer); speculation costs more than it gives",
    "tokenizer_misfit": "the model directory's tokenizer looks like another model's: check "
                        "tokenizer.json / tokenizer_config.json against the model's own",
}


def check_problems(status: StatusReply) -> CheckResult:
    """Problems the daemon saw since it started (a request the scheduler lost, a removed
    socket file, a draft head that drafts nothing useful): each is a failure to look into,
    though the daemon serves on."""
    problems: dict[str, str] = {**(status.engine.get("problems") or {}), **status.problems}
    if not problems:
        return CheckResult("problems", True, "none seen since the daemon started")
    return CheckResult(
        "problems", False, "; ".join(f"{name}: {text}" for name, text in sorted(problems.items())),
        "; ".join(PROBLEM_ADVICE.get(name, "see the daemon's log (journalctl -u specd)")
                  for name in sorted(problems)))


def check_provenance(status: StatusReply) -> list[CheckResult]:
    local_version = provenance.code_version()
    front = status.provenance.get("front", {})
    scheduler = status.provenance.get("scheduler", {})
    results = []
    front_version = front.get("code_version")
    results.append(CheckResult(
        "front code", front_version == local_version,
        f"front runs {front_version} from {_tree(front.get('modules', {}))} "
        f"(install: {front.get('install')}); this specctl has {local_version}",
        "the daemon runs other code than this checkout/install: restart it, or reinstall "
        "(a stale install or a different virtualenv)"))
    if scheduler:
        same = scheduler.get("code_version") == front_version
        results.append(CheckResult(
            "scheduler code", same,
            f"scheduler pid {scheduler.get('pid')} runs {scheduler.get('code_version')} from "
            f"{_tree(scheduler.get('modules', {}))}",
            "front and scheduler differ: reinstall specd and restart"))
        packages = scheduler.get("packages", {})
        results.append(CheckResult(
            "packages", True, ", ".join(f"{k} {v}" for k, v in sorted(packages.items()))))
    return results


def check_device() -> CheckResult:
    try:
        import torch
    except ImportError as exc:
        return CheckResult("device", False, f"torch cannot be imported: {exc}",
                           "pip install torch")
    if not torch.cuda.is_available():
        return CheckResult("device", True, f"torch {torch.__version__}: no CUDA device; the "
                           "engine runs on the CPU with the pure-torch kernel references")
    major, minor = torch.cuda.get_device_capability(0)
    return CheckResult("device", True, f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                       f"{torch.cuda.get_device_name(0)}, compute capability {major}.{minor}")


def check_kernels() -> CheckResult:
    """Tree attention on the device against its pure-torch reference (CUDA only)."""
    import torch

    if not torch.cuda.is_available():
        return CheckResult("kernels", True, "skipped: no CUDA device")
    try:
        from specd.kernels.tree_attention import tree_attention, tree_attention_ref
    except ImportError as exc:
        return CheckResult("kernels", False, f"cannot import the kernels: {exc}",
                           "reinstall specd; check triton's version")
    inputs = _tree_attention_inputs(torch)
    out = tree_attention(*inputs)
    ref = tree_attention_ref(*inputs)
    error = float((out.float() - ref.float()).abs().max())
    return CheckResult("kernels", error < 2e-2, f"tree_attention max |kernel - ref| = "
                       f"{error:.2e}", "the Triton kernel is wrong on this device: report it")


def _tree_attention_inputs(torch: Any) -> tuple[Any, ...]:
    """One sequence: 16 prefix tokens and 4 causal query rows, GQA 4:2, head_dim 64."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim, block, blocks = 4, 2, 64, 16, 4
    q = torch.randn(4, heads, dim, device="cuda", generator=gen, dtype=torch.float16)
    k = torch.randn(blocks, block, kv_heads, dim, device="cuda", generator=gen,
                    dtype=torch.float16)
    v = torch.randn_like(k)
    block_tables = torch.arange(blocks, device="cuda", dtype=torch.int32)[None]
    seq_lens = torch.tensor([20], device="cuda", dtype=torch.int32)
    query_start_loc = torch.tensor([0, 4], device="cuda", dtype=torch.int32)
    return (q, k, v, block_tables, seq_lens, query_start_loc, None, dim ** -0.5, 4)


def check_generation(client: Client) -> CheckResult:
    started = time.monotonic()
    try:
        result = client.generate(prompt_token_ids=[1, 2, 3], max_tokens=1)
    except SpecdError as exc:
        return CheckResult("generation", False, f"{exc.code}: {exc.message}",
                           "see the daemon's log")
    return CheckResult("generation", result.num_output_tokens == 1,
                       f"one token in {1000 * (time.monotonic() - started):.0f} ms "
                       f"(finish {result.finish_reason})")


def check_config(status: StatusReply) -> CheckResult:
    engine = status.config.get("engine", {})
    shown = {k: engine.get(k) for k in ("model", "device", "dtype", "max_num_seqs",
                                        "speculative_algorithm", "spec_mode")}
    return CheckResult("config", True, f"{shown}; resolved {status.resolved}")


def run_checks(socket_path: Path | None, timeout: float,
               log_lines: Iterable[str] | None = None) -> list[CheckResult]:
    """Every check in order; `log_lines`: the daemon's log, for the last failure in it."""
    results = [check_local_install()]
    status: StatusReply | None = None
    error = ""
    client: Client | None = None
    try:
        client = Client(socket_path, timeout=timeout)
        status = client.status()
    except SpecdError as exc:
        error = f"{exc.code}: {exc.message}"
    results.append(check_daemon(status, error))
    if status is not None and client is not None:
        results += check_provenance(status)
        results.append(check_config(status))
        if status.engine and "error" not in status.engine:  # the scheduler's own figures
            results.append(check_fallbacks(status))
        results.append(check_problems(status))
        ranks = check_ranks(status)
        if ranks is not None:
            results.append(ranks)
        if status.state == "ready" and (ranks is None or ranks.ok):
            results.append(check_generation(client))
        elif ranks is not None and not ranks.ok:
            results.append(CheckResult("generation", False, "not tried: a rank is down (a "
                                       "step would wait for it, or fail the daemon)"))
    if client is not None:
        client.close()
    if log_lines is not None:
        results.append(check_last_failure(read_records(log_lines)))
    results.append(check_device())
    results.append(check_kernels())
    return results
