"""`specctl`: control and use a running specd from the command line.

Human-readable output by default, `--json` for scripts (before or after the command name).
The socket comes from `--socket`, else $SPECD_SOCKET, else the daemon's default path.

Exit codes:
    0  success
    1  the daemon answered with an error (its code is printed: overloaded, bad_request, ...)
    2  usage error (bad option or argument)
    3  the daemon cannot be reached (not running, wrong socket, connection lost)
    4  no answer within --timeout
    5  `doctor` found a problem
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import msgspec

from specd.daemon.ctl.common import EXIT_DOCTOR_PROBLEM, EXIT_TIMEOUT, Settings, run_client_call
from specd.daemon.ctl.status_text import status_lines
from specd.ipc.errors import DaemonUnavailable, SpecdError
from specd.ipc.generation import GenerateResult, StreamDelta
from specd.ipc.messages import SPEC_MODES
from specd.ipc.sampling import SamplingParams


def _json_option(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")(command)


def _emit_json(value: Any) -> None:
    """One JSON line; Structs (array-like on the wire) become objects with field names."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.structs.asdict(value)
    click.echo(json.dumps(msgspec.to_builtins(value, enc_hook=str)))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), default=None,
              envvar="SPECD_SOCKET", help="daemon socket [default: $SPECD_SOCKET or the "
              "daemon's default path]")
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="seconds to wait for each answer")
@_json_option
@click.pass_context
def cli(ctx: click.Context, socket_path: Path | None, timeout: float, as_json: bool) -> None:
    """Control and use a running specd.

    Exit codes: 0 success; 1 the daemon answered with an error; 2 usage error; 3 daemon
    unreachable; 4 timeout; 5 doctor found a problem.
    """
    ctx.obj = Settings(socket_path, timeout, as_json)


def _settings(ctx: click.Context, as_json: bool) -> Settings:
    settings: Settings = ctx.obj
    return Settings(settings.socket_path, settings.timeout, settings.as_json or as_json)


# ---- generate ----------------------------------------------------------------------------


@cli.command()
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="send PROMPT as a user message (chat template)")
@click.option("--system", default=None, help="system message (implies --chat)")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=-1, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="> 0; seen tokens' logits divided by it (negative ones multiplied)")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
              help="in [-2, 2]; subtracted per occurrence in the output")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True,
              help="in [-2, 2]; subtracted once for tokens in the output")
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--ignore-eos", is_flag=True)
@click.option("--deadline", type=float, default=None, help="seconds the request may take")
@click.option("--local", is_flag=True,
              help="run the in-process engine (specd.Engine) instead of the daemon")
@click.option("--model", default=None, help="with --local: model directory [default: fixture]")
@_json_option
@click.pass_context
def generate(ctx: click.Context, prompt: str, chat: bool, system: str | None, max_tokens: int,
             temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None,
             repetition_penalty: float, frequency_penalty: float, presence_penalty: float,
             stop: tuple[str, ...], ignore_eos: bool, deadline: float | None, local: bool,
             model: str | None, as_json: bool) -> None:
    """Generate from PROMPT ('-' reads stdin), streaming text to the terminal.

    With --json, prints one JSON line per delta and a final line with the result."""
    settings = _settings(ctx, as_json)
    text = sys.stdin.read() if prompt == "-" else prompt
    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                  min_p=min_p, seed=seed, max_tokens=max_tokens, stop=stop,
                                  ignore_eos=ignore_eos, repetition_penalty=repetition_penalty,
                                  frequency_penalty=frequency_penalty,
                                  presence_penalty=presence_penalty)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    messages = None
    if chat or system is not None:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}]
    started = time.monotonic()
    if local:
        deltas, result_of = _local_stream(model, text, messages, sampling)
        result = _print_stream(deltas, result_of, settings.as_json)
    else:
        result = run_client_call(
            lambda: _daemon_generate(settings, text, messages, sampling, deadline))
    elapsed = time.monotonic() - started
    if settings.as_json:
        _emit_json({"type": "result", **msgspec.to_builtins(result), "elapsed_s": elapsed})
    else:
        click.echo()
        click.echo(f"[{result.finish_reason}: {result.num_prompt_tokens} prompt + "
                   f"{result.num_output_tokens} output tokens in {elapsed:.2f} s, "
                   f"{result.num_output_tokens / max(elapsed, 1e-9):.1f} tok/s"
                   + (f", acceptance length {result.acceptance_length:.2f}"
                      if result.num_drafted else "") + "]", err=True)


def _daemon_generate(settings: Settings, text: str, messages: list[dict[str, str]] | None,
                     sampling: SamplingParams, deadline: float | None) -> GenerateResult:
    with settings.client() as client:
        stream = client.stream(None if messages else text, messages=messages, sampling=sampling,
                               deadline_s=deadline)
        with stream:
            return _print_stream(iter(stream), lambda: stream.result, settings.as_json)


def _print_stream(deltas: Iterator[StreamDelta], result_of: Callable[[], GenerateResult | None],
                  as_json: bool) -> GenerateResult:
    for delta in deltas:
        if as_json:
            _emit_json({"type": "delta", "text": delta.text, "token_ids": delta.token_ids})
        else:
            click.echo(delta.text, nl=False)
            sys.stdout.flush()
    result = result_of()
    if result is None:
        raise SpecdError("the stream ended without a result")
    return result


def _local_stream(model: str | None, text: str, messages: list[dict[str, str]] | None,
                  sampling: SamplingParams
                  ) -> tuple[Iterator[StreamDelta], Callable[[], GenerateResult | None]]:
    """The in-process engine, detokenized the way the daemon does it."""
    from specd.daemon.ctl.local import LocalGeneration

    generation = LocalGeneration(model, text, messages, sampling)
    return generation.deltas(), lambda: generation.result


# ---- control -----------------------------------------------------------------------------


@cli.command()
@_json_option
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Liveness, readiness, model, uptime, queue, batch, speculation, fallbacks."""
    settings = _settings(ctx, as_json)

    def query() -> Any:
        with settings.client() as client:
            return client.status()

    reply = run_client_call(query)
    if settings.as_json:
        _emit_json(reply)
        return
    click.echo("\n".join(status_lines(reply)))


@cli.command()
@_json_option
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Engine and front counters."""
    settings = _settings(ctx, as_json)

    def query() -> dict[str, Any]:
        with settings.client() as client:
            return client.stats()

    figures = run_client_call(query)
    if settings.as_json:
        _emit_json(figures)
        return
    for section, value in figures.items():
        if isinstance(value, dict):
            for key, inner in value.items():
                click.echo(f"{section}.{key} = {inner}")
        else:
            click.echo(f"{section} = {value}")


@cli.command()
@click.argument("mode", type=click.Choice([*SPEC_MODES, "threshold"]))
@click.argument("threshold", type=int, required=False)
@_json_option
@click.pass_context
def spec(ctx: click.Context, mode: str, threshold: int | None, as_json: bool) -> None:
    """Speculation: on, off, auto, or `threshold N` (auto, off above batch size N)."""
    if (mode == "threshold") != (threshold is not None):
        raise click.UsageError("give N with `threshold N`, and only there")
    settings = _settings(ctx, as_json)
    wire_mode = "auto" if mode == "threshold" else mode

    def call() -> str:
        with settings.client() as client:
            return client.set_spec(wire_mode, threshold)

    _report_ack(settings, run_client_call(call))


@cli.command()
@click.option("--timeout", "drain_timeout", type=float, default=None,
              help="seconds in-flight requests may still run [default: the daemon's]")
@click.option("--wait", is_flag=True, help="return only once the daemon has exited")
@_json_option
@click.pass_context
def drain(ctx: click.Context, drain_timeout: float | None, wait: bool, as_json: bool) -> None:
    """Stop accepting requests, finish those in flight, then exit (like SIGTERM)."""
    settings = _settings(ctx, as_json)

    def call() -> str:
        with settings.client() as client:
            return client.drain(drain_timeout)

    message = run_client_call(call)
    if wait:
        _wait_for_exit(settings)
    _report_ack(settings, message)


@cli.command()
@click.option("--wait", is_flag=True, help="return only once the daemon has exited")
@_json_option
@click.pass_context
def stop(ctx: click.Context, wait: bool, as_json: bool) -> None:
    """End every request now and exit."""
    settings = _settings(ctx, as_json)

    def call() -> str:
        with settings.client() as client:
            return client.stop()

    message = run_client_call(call)
    if wait:
        _wait_for_exit(settings)
    _report_ack(settings, message)


def _wait_for_exit(settings: Settings) -> None:
    deadline = time.monotonic() + settings.timeout
    while time.monotonic() < deadline:
        try:
            settings.client().close()
        except DaemonUnavailable:
            return
        time.sleep(0.1)
    click.echo("specctl: the daemon did not exit in time", err=True)
    sys.exit(EXIT_TIMEOUT)


def _report_ack(settings: Settings, message: str) -> None:
    if settings.as_json:
        _emit_json({"ok": True, "message": message})
    else:
        click.echo(message)


@cli.command()
@_json_option
@click.option("--log", "log_file", type=click.File("r"), default=None,
              help="the daemon's JSON log (- for stdin): report the last failure in it")
@click.pass_context
def doctor(ctx: click.Context, as_json: bool, log_file: Any) -> None:
    """Checks to run first when something is wrong; each prints ok or what to do."""
    from specd.daemon.ctl.doctor import run_checks

    settings = _settings(ctx, as_json)
    results = run_checks(settings.socket_path, settings.timeout,
                         None if log_file is None else log_file.read().splitlines())
    if settings.as_json:
        _emit_json([msgspec.structs.asdict(r) for r in results])
    else:
        for r in results:
            click.echo(f"{'ok  ' if r.ok else 'FAIL'}  {r.name}: {r.detail}")
            if not r.ok and r.advice:
                click.echo(f"      -> {r.advice}")
    if not all(r.ok for r in results):
        sys.exit(EXIT_DOCTOR_PROBLEM)


def _register_commands() -> None:
    """Commands that live in their own modules (owned with the features they drive)."""
    from specd.daemon.bench.command import bench
    from specd.daemon.ctl.import_gguf import import_gguf
    from specd.daemon.ctl.plan import plan
    from specd.daemon.ctl.service_install import install_service
    from specd.daemon.ctl.top import top
    from specd.daemon.ctl.tune_spec import tune_spec

    for command in (bench, top, tune_spec, install_service, plan, import_gguf):
        cli.add_command(command)


_register_commands()

if __name__ == "__main__":
    cli()
