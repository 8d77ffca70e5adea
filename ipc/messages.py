"""Every message specd sends between processes: one tagged union per direction and channel.

Two channels:

* client <-> front (Unix socket, length-prefixed msgpack; see docs/protocol.md):
  `ClientMessage` (client -> front) and `ServerMessage` (front -> client). Requests forbid
  unknown fields and bound every value, so a typed decode is the whole validation of shape.
* front <-> scheduler (ZeroMQ, msgpack): `ToScheduler` and `FromScheduler`.

Messages that travel once per token or per step (`Delta`, `TokenDelta`, `StepOutput`) are
`array_like`: a delta is a short msgpack array, not a map with field names. (msgspec writes
every field of an array-like Struct; a decoder fills trailing fields that are missing with
their defaults, so fields may be appended later without breaking old senders.)
Every Struct is frozen; the tag (`"type"` in map-shaped messages, the first element in
array-shaped ones) names the message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from specd.ipc.sampling import SamplingParams

PROTOCOL_VERSION = 1

# The speculation modes, defined once (in the order reports list them): the engine's
# `spec_mode`, the `spec` request, `specctl spec` and the serving benchmark read them here.
SPEC_MODES = ("off", "on", "auto")
SpecMode = Annotated[str, Meta(pattern=f"^({'|'.join(SPEC_MODES)})$")]

# Bounds on what one client request may carry; the frame cap bounds the total as well.
ClientId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
MAX_PROMPT_CHARS = 4 * 2**20
MAX_MESSAGES = 1024
MAX_TOOLS = 256
MAX_TEMPLATE_KWARGS = 64
# Template variables a request cannot set through chat_template_kwargs: the renderer sets
# them from the request's own fields.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents")

ERROR_CODES = (
    "bad_frame",  # framing broken (size, truncation, garbage): the connection is closed
    "bad_request",  # a frame that does not decode to a valid request; the connection stays
    "prompt_too_long",  # prompt tokens + max_tokens exceed the model's maximum length
    "overloaded",  # the request queue is full; retry later
    "starting",  # the scheduler has not finished warming up
    "shutting_down",  # the daemon drains: no new requests
    "scheduler_unavailable",  # the scheduler died or hung; the daemon exits and restarts
    "deadline_exceeded",  # the request's deadline passed before it finished
    "drained",  # the drain timeout ended the request
    "slow_reader",  # the client did not read its output; its requests were aborted
    "duplicate_id",  # a request id already in flight on this connection
    "not_found",  # abort of an id that is not in flight
    "forbidden",  # a control request (spec, drain, stop) from a user who is not an operator
    "internal_error",  # a bug in specd; the log has the traceback
)


# ---- client -> front ---------------------------------------------------------------------


class TextPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One part of a message's content given as a list (only text parts: no media)."""

    type: Literal["text"]
    text: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A chat message as the model's template reads it: `content` is a string, a list of
    text parts, or nil (an assistant turn that only calls tools). `tool_calls` (assistant),
    `tool_call_id` and `name` (a tool's result) are passed to the template as given, and so
    is an assistant's earlier reasoning, `reasoning_content` or `reasoning` (the template
    sees both names: chat_template.py); nil fields are left out of what it sees."""

    role: Annotated[str, Meta(min_length=1, max_length=64)]
    content: (Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]
              | Annotated[list[TextPart], Meta(max_length=MAX_MESSAGES)] | None)
    name: Annotated[str, Meta(max_length=256)] | None = None
    tool_calls: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None
    reasoning_content: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    reasoning: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] | None = None


class _Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    """Every client request carries `id`, chosen by the client and echoed in every reply."""

    id: ClientId


class Generate(_Request, frozen=True, tag="generate"):
    """Exactly one of `prompt` (raw text), `messages` (rendered with the model's chat
    template) or `prompt_token_ids`. `stream=True` sends `Delta` frames as text arrives;
    either way a `Final` (or an `Error`) ends the request. `deadline_s`: seconds from
    arrival after which the request ends with `deadline_exceeded`. With `messages` only:
    `tools` (JSON schemas, the template's `tools`) and `chat_template_kwargs` (template
    variables, e.g. `add_generation_prompt` (default true) or `enable_thinking`).
    `report_prompt`: a `Prompt` frame with the prompt's length comes before the first
    delta (it always does, with the log-probabilities, when sampling asks for
    `prompt_logprobs`)."""

    prompt: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)] | None = None
    prompt_token_ids: list[TokenId] | None = None
    sampling: SamplingParams = SamplingParams()
    stream: bool = True
    deadline_s: Annotated[float, Meta(gt=0, le=86400)] | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: (Annotated[dict[str, Any], Meta(max_length=MAX_TEMPLATE_KWARGS)]
                           | None) = None
    report_prompt: bool = False

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages, prompt_token_ids")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        check_chat_options(self.messages, self.tools, self.chat_template_kwargs)


class Abort(_Request, frozen=True, tag="abort"):
    """Abort the in-flight request `target` of this connection."""

    target: ClientId


class StatusQuery(_Request, frozen=True, tag="status"):
    pass


class StatsQuery(_Request, frozen=True, tag="stats"):
    pass


class SetSpec(_Request, frozen=True, tag="spec"):
    """Speculation mode: on, off or auto (with an optional batch-size threshold)."""

    mode: SpecMode
    threshold: Annotated[int, Meta(ge=1, le=1 << 20)] | None = None


class Drain(_Request, frozen=True, tag="drain"):
    """Stop accepting, let in-flight requests finish within `timeout_s`, then exit 0."""

    timeout_s: Annotated[float, Meta(ge=0, le=86400)] | None = None


class Stop(_Request, frozen=True, tag="stop"):
    """End every request now (error `drained`; during a drain too), stop the scheduler,
    exit 0."""


class Tokenize(_Request, frozen=True, tag="tokenize"):
    """The token ids a generate with the same `prompt` (the tokenizer's own special tokens
    added, as for a generate) or `messages` (with `tools` and `chat_template_kwargs`,
    rendered by the chat template) would have as its prompt; answered `Tokens`."""

    prompt: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: (Annotated[dict[str, Any], Meta(max_length=MAX_TEMPLATE_KWARGS)]
                           | None) = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt, messages")
        check_chat_options(self.messages, self.tools, self.chat_template_kwargs)


def check_chat_options(messages: list[ChatMessage] | None, tools: list[dict[str, Any]] | None,
                       chat_template_kwargs: dict[str, Any] | None) -> None:
    """ValueError unless `tools` and `chat_template_kwargs` come with `messages` only, and
    the kwargs leave the reserved variables alone (`add_generation_prompt` a bool)."""
    if messages is None and (tools is not None or chat_template_kwargs is not None):
        raise ValueError("tools and chat_template_kwargs go with messages only")
    kwargs = chat_template_kwargs or {}
    reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}")
    if not isinstance(kwargs.get("add_generation_prompt", True), bool):
        raise ValueError("chat_template_kwargs.add_generation_prompt must be a bool")


ClientMessage = Generate | Abort | StatusQuery | StatsQuery | SetSpec | Drain | Stop | Tokenize


class Logprob(msgspec.Struct, frozen=True, array_like=True):
    """One output token's log-probability and the top-n alternatives, most likely first."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


# ---- front -> client ---------------------------------------------------------------------


class _Reply(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, tag_field="type"):
    """Replies are msgpack arrays: [tag, field, field, ...] in declaration order
    (docs/protocol.md lists every field)."""


class Delta(_Reply, frozen=True, tag="delta"):
    """Streamed output: new text and the token ids it came from (text may lag the ids by a
    few tokens: it never holds half a UTF-8 character or a possible stop string's start)."""

    id: int
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[Logprob] = []  # one per token id when the request asked for logprobs


class Prompt(_Reply, frozen=True, tag="prompt"):
    """The prompt of a generate that asked (`report_prompt`, or `prompt_logprobs` in its
    sampling), sent once, before its first delta: its length and, with prompt_logprobs,
    its token ids and the log-probability of each token after the first (`logprobs[i]` is
    token i + 1's)."""

    id: int
    num_tokens: int
    token_ids: list[int] = []
    logprobs: list[Logprob] = []


class Final(_Reply, frozen=True, tag="final"):
    """The end of a generate request. `text`/`token_ids` hold the whole output when the
    request did not stream and the rest not yet streamed otherwise.
    finish_reason: "stop" (EOS, stop token or stop string), "length", "abort". After a
    stop string, token_ids end with the token that completed it (num_output_tokens counts
    the same tokens). acceptance_length: num_output_tokens per step that gave the request
    tokens (1.0 without speculation); 0.0 when no step did."""

    id: int
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    text: str = ""
    token_ids: list[int] = []
    num_cached_tokens: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    acceptance_length: float = 0.0
    stop_string: str | None = None
    logprobs: list[Logprob] = []


class Error(_Reply, frozen=True, tag="error"):
    """`id` is the request it ends, or None when the error belongs to the connection."""

    id: int | None
    code: str
    message: str


class StatusReply(_Reply, frozen=True, tag="status"):
    """`problems`: named events an operator must act on, name -> what happened (how often,
    the last case), the front's and the engine's (`requests_lost`, `spec_acceptance_low`,
    ...); `fallbacks`: the front's parts that run degraded (an HTTP handler that raised),
    beside the engine's in `engine["fallbacks"]`."""

    id: int
    state: str  # starting | ready | draining | failed | unresponsive | stalled
    protocol: int
    version: str
    uptime_s: float
    model: str
    num_open_requests: int
    num_connections: int
    resolved: dict[str, Any]
    engine: dict[str, Any]
    provenance: dict[str, Any]
    config: dict[str, Any]
    problems: dict[str, str] = {}
    fallbacks: dict[str, str] = {}


class StatsReply(_Reply, frozen=True, tag="stats"):
    id: int
    stats: dict[str, Any]


class Ack(_Reply, frozen=True, tag="ack"):
    id: int
    message: str


class Tokens(_Reply, frozen=True, tag="tokens"):
    """The answer to `Tokenize`."""

    id: int
    token_ids: list[int] = []


ServerMessage = Delta | Prompt | Final | Error | StatusReply | StatsReply | Ack | Tokens


# ---- front -> scheduler ------------------------------------------------------------------


class _Link(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, tag_field="type"):
    """Link messages are msgpack arrays led by their tag (internal; both ends run the same
    code version, which the Ready handshake checks)."""


class AddRequest(_Link, frozen=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


class AbortRequests(_Link, frozen=True, tag="abort"):
    request_ids: list[str]


class SetSpecMode(_Link, frozen=True, tag="spec"):
    query_id: int
    mode: str
    threshold: int | None = None


class QueryStats(_Link, frozen=True, tag="stats"):
    query_id: int


class Reconcile(_Link, frozen=True, tag="reconcile"):
    """Which requests does the engine hold? (the front's reconciliation of its open
    requests, daemon/reconcile.py; answered `Holding`)."""

    query_id: int


class ForgetFigures(_Link, frozen=True, tag="forget"):
    """Zero the engine's figures (steps, tokens, drafts, speculation's measurements): sent
    once the front's own warm-up requests are done, before READY (daemon/http_warmup.py)."""


class Shutdown(_Link, frozen=True, tag="shutdown"):
    pass


ToScheduler = (
    AddRequest | AbortRequests | SetSpecMode | QueryStats | Reconcile | ForgetFigures
    | Shutdown
)


# ---- scheduler -> front ------------------------------------------------------------------


class StartupStage(_Link, frozen=True, tag="stage"):
    """Sent as the scheduler enters each start-up stage (for sd_notify STATUS). Entering
    "load" it carries its code version, where its `specd` package lies and every source
    file's digest (provenance.py), so the front refuses other code before the model loads
    and names the files that differ. A message repeating the current stage with a `detail`
    is a heartbeat of progress within it (workers/process/stage_watch.py)."""

    stage: str
    code_version: str = ""
    source_root: str = ""
    file_digests: dict[str, str] = msgspec.field(default_factory=dict)
    detail: str = ""


class Ready(_Link, frozen=True, tag="ready"):
    resolved: dict[str, Any]
    code_version: str
    modules: dict[str, str]  # module name -> file it was imported from
    packages: dict[str, str]  # distribution -> version (torch, triton, ...)
    pid: int
    warmup_s: float


class SchedulerFailed(_Link, frozen=True, tag="failed"):
    """The scheduler is about to exit because `stage` raised (load, warmup, loop, ...).
    `exit_code`: the daemon's exit code for a failure before Ready (70 a code bug, 78 bad
    configuration: `exit_codes.startup_exit_code`); a failure in the loop is always 75."""

    stage: str
    error: str
    traceback: str
    exit_code: int = 78


class TokenDelta(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """One request's share of a step (see workers.engine.RequestDelta); figures cumulative.
    `error` (with finish_reason "error"): a failed step was blamed on this request, which
    ends with it (the one-line summary of the exception; the scheduler's log has more)."""

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    logprobs: list[Logprob] = []
    error: str | None = None


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """A request's prompt log-probabilities (sampling.prompt_logprobs), tokens 1, 2, ...,
    sent once, in the step of its first output, before that step's deltas."""

    request_id: str
    logprobs: list[Logprob]


class StepOutput(_Link, frozen=True, tag="step"):
    """One engine step; sent after every step that ran, even with no deltas (a progress
    heartbeat for the front's watchdog)."""

    step: int
    deltas: list[TokenDelta] = []
    prompt_logprobs: list[PromptLogprobs] = []


class RequestRejected(_Link, frozen=True, tag="rejected"):
    """The engine refused an AddRequest (ValueError: prompt too long, bad token ids)."""

    request_id: str
    message: str


class QueryReply(_Link, frozen=True, tag="reply"):
    """Answer to SetSpecMode or QueryStats; `error` set when it failed."""

    query_id: int
    result: dict[str, Any]
    error: str | None = None


class Holding(_Link, frozen=True, tag="holding"):
    """Answer to `Reconcile`: every request the engine holds unfinished (waiting, running,
    or set aside by a failed step's isolation), and `idle_s`, the seconds since the engine
    last ran a step that moved (scheduled work or produced tokens). Sent after the output
    of every step before it, so a request the front opened before asking that is neither
    finished by that output nor listed here is lost."""

    query_id: int
    request_ids: list[str] = []
    idle_s: float = 0.0


class Stopped(_Link, frozen=True, tag="stopped"):
    pass


FromScheduler = (
    StartupStage | Ready | SchedulerFailed | StepOutput | RequestRejected | QueryReply
    | Holding | Stopped
)
