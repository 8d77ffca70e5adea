"""The daemon's configuration: one frozen object built once from the CLI and validated.

Engine options live in `engine` (an `EngineConfig`, whose fields are the CLI's engine flags
one to one); everything here is about the front process: where it listens, how long it
waits for what, how much it buffers. Paths derived from these values are properties.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from specd.daemon.parsers.registry import (
    AUTO,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    check_parser_name,
)
from specd.ipc.paths import default_socket_path
from specd.workers.config import EngineConfig

LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class DaemonConfig:
    """Front-process settings (times in seconds, sizes in bytes).

    max_pending_requests: open generate requests across all clients; one more is answered
        `overloaded` at once.
    max_connections: client connections at once; also the listen backlog, so a burst of
        this many connects waits in the kernel's queue instead of being refused.
    idle_timeout_s: a connection with no open request that sends no frame for this long is
        closed (None: never). A connection whose requests are still running is not idle.
    frame_timeout_s: a frame whose first byte arrived must be complete within this.
    write_buffer_bytes: output the front holds for a client that does not read (beyond
        what the kernel's socket buffer took); when more than this is still unsent as the
        next output comes, the client's requests are aborted (`slow_reader`) and the
        connection closed. At most this much (plus one step's output) per connection.
    operator_uid: besides root, the user whose connections may send control requests
        (drain, stop, spec); None: the daemon's own user. Others get `forbidden`.
    drain_timeout_s: SIGTERM / `specctl drain` waits this long for in-flight requests.
    hang_timeout_s: a scheduler that makes no progress for this long is hung: with work, no
        step output; idle, no answer to the front's probes; loading, no heartbeat.
    startup_timeout_s: the scheduler must send Ready within this (load + warm-up).
    max_stop_strings / max_stop_chars: bounds on a request's stop strings.
    http: serve the OpenAI-compatible HTTP API and /metrics on this address ("HOST:PORT",
        "[IPv6]:PORT", or a bare port for loopback; port 0 takes a free one); None: off.
        Its request bodies are bounded by max_frame_bytes, like the socket's frames.
    api_key_file: with http, Bearer keys (one a line) that every endpoint but /health
        requires; None: the HTTP port is open to anyone who can reach it.
    tool_call_parser / reasoning_parser: how the HTTP API reads tool calls and thinking in
        a chat answer (daemon/parsers/registry.py): a parser's name, `auto` (the one the
        model's chat template calls for, if any) or `none`.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    socket_path: Path = field(default_factory=default_socket_path)
    socket_mode: int = 0o660
    log_format: str = "text"
    log_level: str = "info"
    max_frame_bytes: int = 4 * 2**20
    max_connections: int = 1024
    max_pending_requests: int = 256
    idle_timeout_s: float | None = 300.0
    frame_timeout_s: float = 10.0
    write_buffer_bytes: int = 2**20
    operator_uid: int | None = None
    drain_timeout_s: float = 30.0
    hang_timeout_s: float = 60.0
    startup_timeout_s: float = 1800.0
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    http: str | None = None
    api_key_file: Path | None = None
    tool_call_parser: str = AUTO
    reasoning_parser: str = AUTO

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if not 0 <= self.socket_mode <= 0o777:
            raise ValueError(f"socket_mode must be a permission mode, got {self.socket_mode:o}")
        for name in ("max_frame_bytes", "max_connections", "max_pending_requests",
                     "write_buffer_bytes", "max_stop_strings", "max_stop_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_frame_bytes >= 2**32:
            raise ValueError(f"max_frame_bytes must be < 2**32, got {self.max_frame_bytes}")
        for name in ("frame_timeout_s", "hang_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0 or None, got {self.idle_timeout_s}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.operator_uid is not None and not 0 <= self.operator_uid < 2**32:
            raise ValueError(f"operator_uid must be a uid (>= 0), got {self.operator_uid}")
        if self.http is not None:
            _parse_http_address(self.http)  # raises ValueError naming the option
        check_parser_name("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        check_parser_name("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        if self.api_key_file is not None and self.http is None:
            raise ValueError("api_key_file needs http (the keys guard the HTTP API)")
        if self.engine.node_rank != 0:
            raise ValueError(f"node_rank {self.engine.node_rank}: specd is node 0; node "
                             f"{self.engine.node_rank} runs `specd-worker --nnodes "
                             f"{self.engine.nnodes} --node-rank {self.engine.node_rank} "
                             "--dist-init-addr HOST:PORT`")

    @property
    def http_address(self) -> tuple[str, int] | None:
        """(host, port) the HTTP API listens on; None when it is off."""
        return None if self.http is None else _parse_http_address(self.http)

    @property
    def operator_uids(self) -> frozenset[int]:
        """The peer uids whose control requests are obeyed: root and the operator."""
        operator = os.geteuid() if self.operator_uid is None else self.operator_uid
        return frozenset((0, operator))

    @property
    def socket_dir(self) -> Path:
        return self.socket_path.parent

    @property
    def runtime_base_dir(self) -> Path:
        """Where the front makes its private ZeroMQ link directory.

        Under systemd this is the service's own runtime directory (`$RUNTIME_DIRECTORY`,
        from `RuntimeDirectory=specd-engine`; the first entry when several are listed):
        the socket's directory `/run/specd` belongs to specd.socket and the service
        cannot write there. Without systemd, next to the socket.
        """
        runtime = os.environ.get("RUNTIME_DIRECTORY")
        if runtime:
            return Path(runtime.split(":")[0])
        return self.socket_dir

    @property
    def restart_count_path(self) -> Path | None:
        """Where the service counts its exits for a failed scheduler (each one restarted
        by systemd): `$STATE_DIRECTORY/scheduler_restarts` under systemd (the unit's
        StateDirectory=specd, kept across restarts); None elsewhere, where nothing
        restarts the daemon."""
        state = os.environ.get("STATE_DIRECTORY")
        return Path(state.split(":")[0]) / "scheduler_restarts" if state else None


LOOPBACK = "127.0.0.1"


def _parse_http_address(text: str) -> tuple[str, int]:
    """"HOST:PORT", "[IPv6]:PORT", ":PORT" or "PORT" (loopback) -> (host, port)."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "", text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"http: write an IPv6 address in brackets ([::1]:8000), got {text!r}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"http expects HOST:PORT with a port in [0, 65535], got {text!r}")
    return host or LOOPBACK, int(port_text)
