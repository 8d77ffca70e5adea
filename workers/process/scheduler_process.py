"""The scheduler process: owns torch and the device, runs the engine loop.

Started by the front (`python -P -m specd.workers.process.scheduler_process ...`), never by hand.
Start-up is a handshake: it reports each stage (`StartupStage`), builds the `EngineCore`,
warms it up, then sends `Ready` with what it resolved, its code version and the files it
imported. A stage that raises sends `SchedulerFailed` (stage + traceback) and the process
waits for the front to end it, so the message is never lost to an early exit.

The loop is `receive -> step -> send`: messages from the front arrive on an IO thread
(`LinkIO`), each engine step (`EngineCore.step`: schedule -> execute -> update) produces one
`StepOutput`, which the send thread encodes. A step runs whenever the engine has work; with
none, the loop blocks on the inbox. A step that raises because of one request ends that
request with an error delta (the engine isolates it: workers/engine/isolation.py); any other
exception in the loop ends the process with exit code 75 (`fail`), as does a tensor-parallel
node found failed by the thread that watches it (workers/parallel/nodes.py).

Signals: SIGINT and SIGTERM are ignored (a terminal's Ctrl-C or a control-group SIGTERM
must not kill the scheduler under a draining front); the front stops it with `Shutdown`,
and if the front dies, PR_SET_PDEATHSIG kills it. SIGUSR1 dumps every thread's stack to
`LinkPaths.stack_dump_file` (the front's hang watchdog asks for it).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from specd import provenance
from specd.exit_codes import EXIT_SCHEDULER_FAILED as EXIT_LOOP_FAILED
from specd.exit_codes import startup_exit_code
from specd.ipc import messages as m
from specd.ipc.zmq_link import LinkPaths
from specd.logs import setup_logging
from specd.workers.config import EngineConfig
from specd.workers.process.host_memory import keep_freed_host_memory
from specd.workers.process.io_threads import LinkFailure, LinkIO
from specd.workers.process.parent import die_with_parent
from specd.workers.process.stage_watch import StageWatch

if TYPE_CHECKING:
    from specd.workers.engine.core import EngineCore
    from specd.workers.engine.records import RequestDelta

FAILED_WAIT_S = 30.0
HEARTBEAT_S = 0.25  # most time between StepOutputs while steps produce no tokens
IDLE_WAIT_S = 0.01  # after SchedulerFailed, how long to wait for the front to end us


class LinkBroken(RuntimeError):
    """An IO thread failed; raised in the engine loop."""


def token_delta(delta: RequestDelta) -> m.TokenDelta:
    return m.TokenDelta(
        request_id=delta.request_id,
        new_token_ids=delta.new_token_ids,
        finish_reason=delta.finish_reason,
        num_prompt_tokens=delta.num_prompt_tokens,
        num_output_tokens=delta.num_output_tokens,
        num_cached_tokens=delta.num_cached_tokens,
        num_drafted=delta.num_drafted,
        num_accepted=delta.num_accepted,
        logprobs=[m.Logprob(lp.logprob, lp.top_ids, lp.top_logprobs) for lp in delta.logprobs],
        error=delta.error,
    )


def prompt_logprobs(deltas: list[RequestDelta]) -> list[m.PromptLogprobs]:
    """The prompt log-probabilities the deltas carry (the first output of requests that
    asked for them)."""
    return [m.PromptLogprobs(d.request_id, [m.Logprob(lp.logprob, lp.top_ids, lp.top_logprobs)
                                            for lp in d.prompt_logprobs])
            for d in deltas if d.prompt_logprobs]


class EngineLoop:
    """Feeds front messages to the engine and engine steps to the front."""

    def __init__(self, core: EngineCore, io: LinkIO) -> None:
        self.core = core
        self.io = io
        self.num_steps = 0
        self.is_stopping = False
        self.last_sent = time.monotonic()
        self.last_engine_steps = -1
        self.is_stuck = False  # the last steps scheduled nothing
        # When a step last moved (applied a step's results or produced tokens): a `Holding`
        # reports the time since, so the front tells an idle engine holding its requests
        # from one that works on them.
        self.last_moved = time.monotonic()
        self._moved_at_steps = core.num_steps

    def run(self) -> None:
        """Until Shutdown: handle every waiting message, then run one step if there is work."""
        while not self.is_stopping:
            has_work = self.core.has_unfinished()
            # Block when idle; when a step could not schedule anything, wait a moment for
            # a message (an abort, say) instead of spinning.
            timeout = None if not has_work else (IDLE_WAIT_S if self.is_stuck else 0.0)
            for message in self.io.receive_all(timeout):
                self.handle(message)
            if self.core.has_unfinished() and not self.is_stopping:
                self.step()
        self.io.send(m.Stopped())

    def step(self) -> None:
        """One engine step. Its output goes to the front; a step that produced no tokens
        (a prefill chunk) still sends a heartbeat now and then, so the front's progress
        watchdog sees the engine move; a step that scheduled nothing sends nothing."""
        deltas = self.core.step()
        self.num_steps += 1
        now = time.monotonic()
        if deltas or self.core.num_steps != self._moved_at_steps:
            self.last_moved = now
            self._moved_at_steps = self.core.num_steps
        if deltas:
            self.io.send(m.StepOutput(self.num_steps, [token_delta(d) for d in deltas],
                                      prompt_logprobs(deltas)))
            self.last_sent = now
            self.is_stuck = False
        elif now - self.last_sent > HEARTBEAT_S:
            engine_steps = self.core.stats().num_steps
            self.is_stuck = engine_steps == self.last_engine_steps
            if not self.is_stuck:
                self.io.send(m.StepOutput(self.num_steps))
                self.last_sent = now
            self.last_engine_steps = engine_steps

    def handle(self, message: m.ToScheduler | LinkFailure) -> None:
        if isinstance(message, LinkFailure):
            raise LinkBroken(f"{message.thread}: {message.error}\n{message.traceback}")
        if isinstance(message, m.AddRequest):
            try:
                self.core.add_request(
                    message.request_id, message.prompt_token_ids, message.sampling)
            except ValueError as exc:
                self.io.send(m.RequestRejected(message.request_id, str(exc)))
        elif isinstance(message, m.AbortRequests):
            for request_id in message.request_ids:
                self.core.abort_request(request_id)
        elif isinstance(message, m.SetSpecMode):
            self._set_spec_mode(message)
        elif isinstance(message, m.QueryStats):
            stats = dataclasses.asdict(self.core.stats())
            self.io.send(m.QueryReply(message.query_id, stats))
        elif isinstance(message, m.ForgetFigures):
            self.core.forget_figures()
        elif isinstance(message, m.Reconcile):
            self.io.send(m.Holding(message.query_id, self.core.request_ids(),
                                   time.monotonic() - self.last_moved))
        elif isinstance(message, m.Shutdown):
            self.is_stopping = True

    def _set_spec_mode(self, message: m.SetSpecMode) -> None:
        try:
            self.core.set_spec_mode(message.mode, message.threshold)
        except ValueError as exc:
            self.io.send(m.QueryReply(message.query_id, {}, error=str(exc)))
            return
        stats = dataclasses.asdict(self.core.stats())
        self.io.send(m.QueryReply(message.query_id, stats))


def start_engine(config_json: str, io: LinkIO) -> EngineCore:
    """Stages config -> import -> load -> warmup -> ready. Raises StageError naming the
    stage that failed."""
    stage = "config"
    try:
        config = engine_config_from_json(config_json)
        # Hash the sources as this process starts, as the front did just before starting
        # it (the same moment, give or take a second), before importing them: the version
        # of the code we run, which the front checks before the model loads.
        code_version = provenance.code_version()
        stage = "import"
        io.send(m.StartupStage(stage))
        from specd.workers.engine.core import EngineCore

        stage = "load"
        io.send(m.StartupStage(stage, code_version=code_version,
                               source_root=str(provenance.package_dirs()["specd"]),
                               file_digests=provenance.file_digests()))
        with StageWatch(io, stage):  # heartbeats while the load moves (the front's watchdog)
            core = EngineCore(config)
        stage = "warmup"
        io.send(m.StartupStage(stage))
        started = time.monotonic()
        core.warmup()
        warmup_s = time.monotonic() - started
        stage = "ready"
        io.send(m.Ready(
            resolved=msgspec.to_builtins(dataclasses.asdict(core.resolved)),
            code_version=code_version,
            modules=provenance.imported_modules(),
            packages=provenance.package_versions(),
            pid=os.getpid(),
            warmup_s=warmup_s,
        ))
    except Exception as exc:
        raise StageError(stage, exc) from exc
    return core


class StageError(Exception):
    """`stage` raised `error`; the traceback is the chained exception's."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"scheduler stage {stage!r} failed: {error!r}")
        self.stage = stage
        self.error = error


def run(config_json: str, paths: LinkPaths) -> int:
    """The whole process after set-up; returns the exit code."""
    io = LinkIO(paths)
    io.start()
    stage = "startup"
    try:
        core = start_engine(config_json, io)
        stage = "loop"
        # A node of a multi-node engine that fails while the loop waits for it (silent:
        # inside a collective that would wait COLLECTIVE_TIMEOUT) ends the process from the
        # thread that noticed.
        core.on_rank_failure(lambda error: os._exit(fail(io, "loop", error, EXIT_LOOP_FAILED)))
        EngineLoop(core, io).run()
    except StageError as exc:
        return fail(io, exc.stage, exc.error, startup_exit_code(exc.error))
    except Exception as exc:  # noqa: BLE001 - any loop failure is reported, then we exit
        return fail(io, stage, exc, EXIT_LOOP_FAILED)
    io.close()
    return 0


def fail(io: LinkIO, stage: str, error: BaseException, code: int) -> int:
    """Report the failure to the front (and stderr), then wait for the front to end us."""
    text = "".join(traceback.format_exception(error))
    # The front logs it (one record); stderr gets it only if the front never does.
    io.send(m.SchedulerFailed(stage=stage, error=repr(error), traceback=text, exit_code=code))
    # The front kills us once it has the message; exiting first could lose it in transit.
    time.sleep(FAILED_WAIT_S)
    print(f"specd scheduler: stage {stage} failed\n{text}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="specd scheduler process (started by specd)")
    parser.add_argument("--link-dir", type=Path, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--engine-config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--log-format", default="text")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    die_with_parent(args.parent_pid)
    keep_freed_host_memory()  # the engine's steps reuse their large temporaries
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    paths = LinkPaths(args.link_dir)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    with open(paths.stack_dump_file, "w") as dump:
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
        code = run(args.engine_config, paths)
    sys.stderr.flush()
    os._exit(code)  # daemon IO threads may sit in a ZeroMQ call; do not wait for them


def engine_config_from_json(text: str) -> EngineConfig:
    return msgspec.json.decode(text, type=EngineConfig)


def engine_config_to_json(config: EngineConfig) -> str:
    return msgspec.json.encode(config).decode()


if __name__ == "__main__":
    main()
