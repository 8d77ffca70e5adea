"""The HTTP API's listening socket and API keys, opened before the front starts, so that a
port in use or an unreadable key file is a configuration failure (exit 78) reported before
the scheduler is spawned."""

from __future__ import annotations

import hmac
import socket
from dataclasses import dataclass
from pathlib import Path

from specd.daemon.config import DaemonConfig


@dataclass(frozen=True)
class HttpListener:
    """A bound, listening TCP socket and the Bearer keys it accepts (empty: no key needed).

    `is_authorized` compares in constant time (hmac.compare_digest) against every key,
    so neither a key's length nor how much of it matched shows in the answer's timing
    beyond the number of keys."""

    sock: socket.socket
    api_keys: tuple[bytes, ...]

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    def is_authorized(self, authorization: str | None) -> bool:
        """Whether an Authorization header value carries one of the keys."""
        if not self.api_keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        matched = False
        for key in self.api_keys:
            matched |= hmac.compare_digest(given, key)
        return scheme.lower() == "bearer" and matched


def open_http_listener(config: DaemonConfig) -> HttpListener | None:
    """Bind `config.http_address` and read `config.api_key_file`; None when HTTP is off.

    Raises OSError (address in use, not permitted, key file unreadable) or ValueError
    (a key file with no key)."""
    address = config.http_address
    if address is None:
        return None
    keys = () if config.api_key_file is None else load_api_keys(config.api_key_file)
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family,
                                backlog=min(config.max_connections, socket.SOMAXCONN))
    return HttpListener(sock, keys)


def load_api_keys(path: Path) -> tuple[bytes, ...]:
    """The keys in `path`: one a line; blank lines and lines starting with # are skipped.
    Raises OSError when unreadable, ValueError when it holds no key."""
    lines = path.read_text().splitlines()
    keys = tuple(line.strip().encode() for line in lines
                 if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"api_key_file {path} holds no key")
    return keys
