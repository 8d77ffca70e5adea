"""specctl's exit codes and the one place that maps client failures onto them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import click

from specd.ipc.errors import ClientTimeout, DaemonUnavailable, SpecdError

EXIT_DAEMON_ERROR = 1
EXIT_UNREACHABLE = 3
EXIT_TIMEOUT = 4
EXIT_DOCTOR_PROBLEM = 5

T = TypeVar("T")


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
