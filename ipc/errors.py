"""The client library's errors: one `SpecdError` subclass per error code of the protocol
(`docs/protocol.md`), and the client-side failures (unreachable daemon, timeout, a frame
this client does not understand)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specd.ipc import messages as m

if TYPE_CHECKING:
    from specd.ipc.generation import StreamDelta


class SpecdError(Exception):
    """An error frame from the daemon (or a client-side failure with its own code).

    request_id: the request it ends (None: the connection's error). partial: the output
    the request produced before the error (text, token ids, logprobs), None when none."""

    code = "error"

    def __init__(self, message: str, request_id: int | None = None,
                 partial: StreamDelta | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.partial = partial


class BadFrame(SpecdError):
    """The daemon could not parse the frame; it closed."""

    code = "bad_frame"


class BadRequest(SpecdError):
    """The request was invalid (the message says why)."""

    code = "bad_request"


class PromptTooLong(SpecdError):
    """The prompt is longer than the model allows."""

    code = "prompt_too_long"


class Overloaded(SpecdError):
    """The daemon's queue is full; retry later."""

    code = "overloaded"


class Starting(SpecdError):
    """The daemon is still loading the model."""

    code = "starting"


class ShuttingDown(SpecdError):
    """The daemon is draining."""

    code = "shutting_down"


class SchedulerUnavailable(SpecdError):
    """The scheduler died or hung."""

    code = "scheduler_unavailable"


class DeadlineExceeded(SpecdError):
    """The request's deadline passed."""

    code = "deadline_exceeded"


class Drained(SpecdError):
    """The drain timeout ended the request."""

    code = "drained"


class SlowReader(SpecdError):
    """The client did not read its output in time."""

    code = "slow_reader"


class DuplicateId(SpecdError):
    """A request with this id is already in flight."""

    code = "duplicate_id"


class NotFound(SpecdError):
    """No such request in flight."""

    code = "not_found"


class Forbidden(SpecdError):
    """A control request (drain, stop, spec) from a user who is not an operator."""

    code = "forbidden"


class InternalError(SpecdError):
    """A bug in the daemon; see its log."""

    code = "internal_error"


ERRORS: dict[str, type[SpecdError]] = {
    cls.code: cls for cls in (BadFrame, BadRequest, PromptTooLong, Overloaded, Starting,
                              ShuttingDown, SchedulerUnavailable, DeadlineExceeded, Drained,
                              SlowReader, DuplicateId, NotFound, Forbidden, InternalError)}


class DaemonUnavailable(SpecdError):
    """The socket could not be reached, or the daemon closed the connection."""

    code = "unavailable"


class ClientTimeout(SpecdError, TimeoutError):
    """No answer within the client's timeout."""

    code = "timeout"


class ProtocolError(SpecdError):
    """The daemon sent something this client does not understand."""

    code = "protocol_error"


def error_from_frame(error: m.Error, partial: StreamDelta | None = None) -> SpecdError:
    """The exception for an error frame (`partial`: what the request produced before)."""
    cls = ERRORS.get(error.code, SpecdError)
    exc = cls(error.message, error.id, partial)
    if cls is SpecdError:
        exc.code = error.code
    return exc
