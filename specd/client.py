"""`from specd.client import Client, AsyncClient`: the client library (specd.ipc: client,
async_client, errors, generation)."""

from specd.ipc.async_client import AsyncClient
from specd.ipc.client import Client, Stream
from specd.ipc.errors import ERRORS as ERRORS_BY_CODE
from specd.ipc.errors import ClientTimeout, DaemonUnavailable, ProtocolError, SpecdError
from specd.ipc.generation import GenerateResult, StreamDelta

__all__ = ["ERRORS_BY_CODE", "AsyncClient", "Client", "ClientTimeout", "DaemonUnavailable",
           "GenerateResult", "ProtocolError", "SpecdError", "Stream", "StreamDelta"]
