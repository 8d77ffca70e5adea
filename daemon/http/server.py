"""The HTTP API's routes, on aiohttp in the front's event loop.

    POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events)
    GET  /v1/models, /v1/models/{id}, /get_model_info and /get_server_info (SGLang's),
         /metrics, /health

A generate request is the socket's: its body becomes a `messages.Generate` (`params`),
which `RequestFlow.admit` opens with an `HttpPeer` in place of a connection; the peer's
frames become the answer (`responses`). An error before any output (admission, the
prompt's tokens, the engine's refusal) is an HTTP status with OpenAI's error object; one
after the stream began is an `error` event before `[DONE]`. A handler that raises answers
500 (or that event) with the exception's type and message, and counts as a degraded part
of the front (`fallback http_handler` in status). The warm-up's requests
(daemon/http_warmup.py) carry the front's token and are admitted before READY. A client
that disconnects aborts its request in the scheduler, as closing a socket connection does
(aiohttp cancels the handler when its connection is lost). `/metrics` asks the front for the same
stats reply `specctl stats` gets. Every endpoint but `/health` needs a Bearer key when
the daemon has `--api-key-file`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import msgspec
from aiohttp import web

from specd import __version__
from specd.daemon.config import DaemonConfig
from specd.daemon.control import Control
from specd.daemon.front_status import FrontStatus
from specd.daemon.health_watch import HealthWatch
from specd.daemon.http import params
from specd.daemon.http.choices import Choices
from specd.daemon.http.errors import HttpError
from specd.daemon.http.listener import HttpListener
from specd.daemon.http.metrics import CONTENT_TYPE, Metrics
from specd.daemon.http.peer import HttpPeer
from specd.daemon.http.responses import DONE, Answer, ParserFactory, sse
from specd.daemon.http_warmup import WARMUP_HEADER
from specd.daemon.incidents import Incidents
from specd.daemon.lifecycle import State
from specd.daemon.parsers.reasoning import prompt_opens_reasoning
from specd.daemon.parsers.registry import (
    AnswerParser,
    reasoning_parser_for,
    tool_call_parser_for,
)
from specd.daemon.prompts import RequestError
from specd.daemon.request_flow import RequestFlow
from specd.ipc import messages as m
from specd.ipc.sampling import MAX_INT64
from specd.logs import log_event, one_line

if TYPE_CHECKING:
    from specd.daemon.server import Connection

log = logging.getLogger("specd.http")

SHUTDOWN_TIMEOUT_S = 2.0  # handlers left when the front exits have this long to finish
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
STREAMING = "specd_streaming"  # set on a request once its response headers may be sent
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(body: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, headers=headers,
                        content_type="application/json")


def error_response(error: HttpError) -> web.Response:
    return json_response(error.body(), error.status, error.headers)


class HttpServer:
    """The API on `listener`'s socket; `start`, then `close` when the front exits.

    Generate requests go through `requests` (the socket's request flow), /metrics asks
    `control` for the stats and renders them with `metrics`; /health and /v1/models read
    the front's `status` and `health`. Refusals are counted in the front's `counters`; each
    HTTP request is a client with an id from `new_connection_id()` (shared with the
    socket's connections)."""

    def __init__(self, config: DaemonConfig, listener: HttpListener, status: FrontStatus,
                 counters: Counter[str], metrics: Metrics, requests: RequestFlow,
                 control: Control, health: HealthWatch, fallbacks: Incidents, *,
                 new_connection_id: Callable[[], int], warmup_token: str) -> None:
        self.config = config
        # A handler that raised is a degraded part of the front (status shows it).
        self.fallbacks = fallbacks
        # The warm-up's requests carry it (http_warmup.py): admitted before READY.
        self.warmup_token = warmup_token
        self.listener = listener
        self.status = status
        self.counters = counters
        self.metrics_registry = metrics
        self.requests = requests
        self.control = control
        self.health_watch = health
        self.new_connection_id = new_connection_id
        self.model = config.engine.model_path.name  # the name Ready reports too
        self.model_dir = str(config.engine.model_path.resolve())
        sources = [t.source for t in requests.tokenizer.chat_templates.templates.values()]
        self.tool_call_parser = tool_call_parser_for(config.tool_call_parser, sources)
        self.reasoning_parser = reasoning_parser_for(config.reasoning_parser, sources)
        app = web.Application(client_max_size=config.max_frame_bytes,
                              middlewares=[self._guard])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id:.+}", self.model_card),
            web.get("/get_model_info", self.model_info),
            web.get("/model_info", self.model_info),
            web.get("/get_server_info", self.server_info),
            web.get("/server_info", self.server_info),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=SHUTDOWN_TIMEOUT_S)

    async def start(self) -> None:
        await self._runner.setup()
        site = web.SockSite(self._runner, self.listener.sock,
                            backlog=self.config.max_connections)
        await site.start()
        host, port = self.listener.address
        log_event(log, logging.INFO, "http_listening", f"HTTP API on {host}:{port}",
                  host=host, port=port, api_keys=len(self.listener.api_keys))
        if not self.listener.api_keys and host not in LOOPBACK_HOSTS:
            log_event(log, logging.WARNING, "http_open", f"the HTTP API on {host}:{port} "
                      "has no API key (--api-key-file): anyone who can reach it may use it")

    async def close(self) -> None:
        await self._runner.cleanup()

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The API key, and every error as OpenAI's error object."""
        if request.path != "/health" and not self.listener.is_authorized(
                request.headers.get("Authorization")):
            return self._refuse(HttpError(401, "a valid API key is required (Authorization: "
                                          "Bearer KEY)", "invalid_api_key"))
        try:
            return await handler(request)
        except HttpError as exc:
            return self._refuse(exc)
        except web.HTTPException as exc:  # aiohttp's own: 404, 405, 413 (body too large)
            code = "request_too_large" if exc.status == 413 else None
            return self._refuse(HttpError(exc.status, exc.text or exc.reason, code))
        except Exception as exc:  # noqa: BLE001 - a bug: logged, answered 500 with its name
            error = self._internal_error(request, exc)
            if request.get(STREAMING):
                raise  # the stream began: aiohttp ends the response
            return self._refuse(error)

    def _internal_error(self, request: web.Request, exc: Exception) -> HttpError:
        """A handler's exception (call from its except block): one record with the
        traceback, a fallback-class incident (status shows it, doctor fails), and the 500
        that answers it with the exception's type and message, nothing more."""
        log.exception("internal error answering %s", request.path,
                      extra={"event": "internal_error"})
        what = one_line(f"{type(exc).__name__}: {exc}")
        self.fallbacks.record("http_handler", f"{request.method} {request.path}: {what}")
        return HttpError(500, f"internal error: {what}", "internal_error")

    def _refuse(self, error: HttpError) -> web.Response:
        """The error's answer, counted as `error_<code>` (unless the flow counted it)."""
        if error.code is not None and not error.is_counted:
            self.counters[f"error_{error.code}"] += 1
        return error_response(error)

    # ---- generate ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = params.decode_body(await request.read(), params.CompletionRequest)
        self._check_model(req.model)
        generate, options = params.completion_to_generate(req, self._max_model_len())
        echo = ""
        if options.echo:
            echo = (generate.prompt if generate.prompt is not None
                    else self.requests.tokenizer.decode(generate.prompt_token_ids or []))
        answer = Answer(options, self.model, self.requests.tokenizer, echo_text=echo)
        return await self._generate(request, generate, answer)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = params.decode_body(await request.read(), params.ChatCompletionRequest)
        self._check_model(req.model)
        generate, options = params.chat_to_generate(req, self._max_model_len(),
                                                     self.tool_call_parser)
        answer = Answer(options, self.model, self.requests.tokenizer,
                        self._parser_factory(generate, options))
        return await self._generate(request, generate, answer)

    def _parser_factory(self, generate: m.Generate, options: params.Options
                        ) -> ParserFactory | None:
        """What reads each choice's answer: the reasoning parser (starting inside the
        reasoning when the rendered prompt opened it) and, when the request uses tools,
        the tool-call parser; None when neither applies."""
        tools = self.tool_call_parser if options.parse_tools else None
        reasoning = self.reasoning_parser if options.parse_reasoning else None
        if tools is None and reasoning is None:
            return None
        in_reasoning = False
        if reasoning is not None:
            try:
                prompt = self.requests.prompts.render(generate)
            except RequestError as exc:
                raise HttpError(400, str(exc), exc.code) from exc
            in_reasoning = prompt_opens_reasoning(prompt.text)
        return lambda: AnswerParser.build(reasoning, in_reasoning, tools)

    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise HttpError(404, f"model {model!r} is not served here; this daemon serves "
                            f"{self.model!r}", "model_not_found", "model")

    def _max_model_len(self) -> int:
        ready = self.status.ready
        return MAX_INT64 if ready is None else int(ready.resolved["max_model_len"])

    async def _generate(self, request: web.Request, generate: m.Generate, answer: Answer
                        ) -> web.StreamResponse:
        """Admit the choices through the request flow, then answer from the peer's frames;
        every choice still open is aborted if the handler leaves before it ended
        (disconnect, cancellation, an error)."""
        peer = HttpPeer(self.new_connection_id(), self.counters)
        choices = Choices(self.requests, peer,
                          params.choices(generate, answer.options.num_choices),
                          warmup=request.headers.get(WARMUP_HEADER) == self.warmup_token)
        try:
            choices.start()
            frames = await peer.receive()
            if not answer.options.stream:
                while True:
                    choices.on_frames(frames)
                    for frame in frames:
                        if isinstance(frame, m.Error):
                            raise _error_of(frame)
                        assert isinstance(frame, m.Prompt | m.Delta | m.Final), frame
                        answer.add(frame)
                    if answer.is_done:
                        return json_response(answer.whole())
                    frames = await peer.receive()
            # The headers go with the first output: until then an error (the engine's
            # refusal of a token id) is an HTTP status. A prompt frame is no output.
            while all(isinstance(f, m.Prompt) for f in frames):
                frames += await peer.receive()
            first = next(f for f in frames if not isinstance(f, m.Prompt))
            if isinstance(first, m.Error):
                raise _error_of(first)
            return await self._stream(request, peer, answer, frames, choices)
        finally:
            self.requests.on_connection_closed(peer, "HTTP client gone")

    async def _stream(self, request: web.Request, peer: HttpPeer, answer: Answer,
                      frames: list[m.ServerMessage], choices: Choices) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        request[STREAMING] = True
        await response.prepare(request)
        try:
            while True:
                choices.on_frames(frames)
                events, is_done = _events(answer, frames)
                if events:
                    await response.write(events)
                if is_done:
                    break
                frames = await peer.receive()
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left mid-stream: _generate's finally aborts the request
        except Exception as exc:  # noqa: BLE001 - a bug mid-stream: an error event ends it
            error = self._internal_error(request, exc)
            self.counters["error_internal_error"] += 1
            await response.write(sse(error.body()) + DONE)
            await response.write_eof()
        return response

    # ---- the rest --------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        return json_response({"object": "list", "data": [self._card()]})

    async def model_card(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/models/{id}: the served model's card, or 404 model_not_found."""
        self._check_model(request.match_info["model_id"])
        return json_response(self._card())

    async def model_info(self, request: web.Request) -> web.StreamResponse:
        """GET /get_model_info (or /model_info), SGLang's: what sglang-router reads to
        register a worker. `model_path` is the name requests give as `model`,
        `tokenizer_path` the model's directory (its tokenizer files)."""
        return json_response({"model_path": self.model, "tokenizer_path": self.model_dir,
                              "is_generation": True, "preferred_sampling_params": None,
                              "weight_version": "default", "has_image_understanding": False,
                              "has_audio_understanding": False})

    async def server_info(self, request: web.Request) -> web.StreamResponse:
        """GET /get_server_info (or /server_info), SGLang's: the served name and the limits
        routers read."""
        ready = self.status.ready
        resolved = {} if ready is None else ready.resolved
        return json_response({
            "model_path": self.model, "served_model_name": self.model,
            "tokenizer_path": self.model_dir, "version": __version__,
            "context_length": resolved.get("max_model_len"),
            "max_total_num_tokens": resolved.get("kv_cache_tokens"),
            "page_size": resolved.get("block_size"),
            "max_running_requests": self.config.engine.max_num_seqs})

    def _card(self) -> dict[str, Any]:
        ready = self.status.ready
        card: dict[str, Any] = {"id": self.model, "object": "model", "owned_by": "specd",
                                "created": int(time.time() - (time.monotonic()
                                                              - self.status.started))}
        if ready is not None:
            card["max_model_len"] = int(ready.resolved["max_model_len"])
        return card

    async def health(self, request: web.Request) -> web.StreamResponse:
        state = self.health_watch.reported_state  # `unresponsive`: the scheduler owes an answer
        return json_response({"status": state}, 200 if state == State.READY.value else 503)

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        peer = HttpPeer(self.new_connection_id(), self.counters)
        # The stats query `specctl stats` sends, answered to this peer: Control reads only
        # send, reject and connection_id of a querying connection.
        self.control.handle(cast("Connection", peer), m.StatsQuery(0))
        reply = (await peer.receive())[0]
        if not isinstance(reply, m.StatsReply):
            raise _error_of(reply) if isinstance(reply, m.Error) else HttpError(
                500, f"unexpected reply {type(reply).__name__}", "internal_error")
        ready = self.status.ready
        body = self.metrics_registry.render(reply.stats, self.status.state.value, self.model,
                                            None if ready is None else ready.resolved)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _error_of(frame: m.Error) -> HttpError:
    return HttpError.from_specd(frame.code, frame.message)


def _events(answer: Answer, frames: list[m.ServerMessage]) -> tuple[bytes, bool]:
    """The stream's bytes for `frames`, and whether the request ended with them (every
    choice ended, or one failed)."""
    events = []
    for frame in frames:
        if isinstance(frame, m.Prompt):
            events.append(answer.prompt_event(frame))
        elif isinstance(frame, m.Delta):
            events.append(answer.delta_event(frame))
        elif isinstance(frame, m.Final):
            events.append(answer.final_events(frame))
            if answer.is_done:
                return b"".join(events), True
        elif isinstance(frame, m.Error):
            events.append(sse(_error_of(frame).body()) + DONE)
            return b"".join(events), True
    return b"".join(events), False
