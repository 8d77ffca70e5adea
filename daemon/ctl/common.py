"""What every specctl command shares: the group's settings, specctl's exit codes and the one
place that maps client failures onto them, and option parsing."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from specd.ipc.client import Client
from specd.ipc.errors import ClientTimeout, DaemonUnavailable, SpecdError

EXIT_DAEMON_ERROR = 1
EXIT_UNREACHABLE = 3
EXIT_TIMEOUT = 4
EXIT_DOCTOR_PROBLEM = 5

T = TypeVar("T")


class Settings:
    """Options shared by every command (set on the group, `ctx.obj`)."""

    def __init__(self, socket_path: Path | None, timeout: float, as_json: bool) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.as_json = as_json

    def client(self) -> Client:
        return Client(self.socket_path, timeout=self.timeout)


def run_client_call(action: Callable[[], T]) -> T:
    """Run a client call; map its failures to an exit code and a one-line message."""
    try:
        return action()
    except DaemonUnavailable as exc:
        click.echo(f"specctl: daemon unreachable: {exc}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    except ClientTimeout as exc:
        click.echo(f"specctl: timeout: {exc}", err=True)
        sys.exit(EXIT_TIMEOUT)
    except SpecdError as exc:
        click.echo(f"specctl: {exc.code}: {exc.message}", err=True)
        sys.exit(EXIT_DAEMON_ERROR)


def int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers >= 1 (click.BadParameter otherwise)."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise click.BadParameter(f"expected integers >= 1, got {text!r}")
    return values
