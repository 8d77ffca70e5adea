"""OpenAI's error object and the HTTP status of every specd error code.

An error answer is `{"error": {"message", "type", "param", "code"}}`, as OpenAI's API
writes it (the `openai` SDK raises the typed exception of its status: 400
`BadRequestError`, 401 `AuthenticationError`, 404 `NotFoundError`, 429 `RateLimitError`,
5xx `InternalServerError`). `code` is specd's error code (docs/protocol.md) where the
request flow produced the error, or OpenAI's (`invalid_api_key`, `model_not_found`,
`request_too_large`) for what only HTTP refuses. `param` names the request field at fault.
"""

from __future__ import annotations

from typing import Any

import msgspec

# specd's error codes (ipc.messages.ERROR_CODES) -> HTTP status. duplicate_id and
# slow_reader cannot happen over HTTP (one request per peer, no write buffer to overrun):
# seen anyway, they are a bug, 500.
STATUS_OF_CODE = {
    "bad_request": 400,
    "prompt_too_long": 400,
    "not_found": 404,
    "forbidden": 403,
    "overloaded": 429,
    "starting": 503,
    "shutting_down": 503,
    "scheduler_unavailable": 503,
    "drained": 503,
    "deadline_exceeded": 504,
    "internal_error": 500,
}
RETRY_AFTER_S = 1  # the Retry-After of a 429: the open requests turn over within a second


class HttpError(Exception):
    """A request answered with an error object instead of a completion.

    is_counted: already counted in the front's counters (`error_<code>`), as the request
    flow counts the errors it sends; the HTTP server counts the others."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, is_counted: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.is_counted = is_counted

    @classmethod
    def from_specd(cls, code: str, message: str) -> HttpError:
        """The HTTP answer to an Error frame of the request flow (which counted it)."""
        return cls(STATUS_OF_CODE.get(code, 500), message, code, is_counted=True)

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return msgspec.json.encode(self.body())


def error_type(status: int) -> str:
    """OpenAI's `type` for a status."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"
