"""`from specd.client import Client, AsyncClient`: the client library (specd.ipc.client)."""

from specd.ipc.client import ERRORS as ERRORS_BY_CODE
from specd.ipc.client import (
    AsyncClient,
    Client,
    ClientTimeout,
    DaemonUnavailable,
    GenerateResult,
    ProtocolError,
    SpecdError,
    Stream,
    StreamDelta,
)

__all__ = ["ERRORS_BY_CODE", "AsyncClient", "Client", "ClientTimeout", "DaemonUnavailable",
           "GenerateResult", "ProtocolError", "SpecdError", "Stream", "StreamDelta"]
