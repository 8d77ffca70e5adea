"""The HTTP API's warm-up: every handler path, once, through the real request flow, before
the daemon reports READY (`warm_up_http`, run by the front when Ready arrived and HTTP is
on).

The scheduler's warm-up (workers/engine/warmup.py) runs every decode path; the HTTP layer
has paths of its own (a body's conversion, streamed and whole answers, the usage chunk of
`stream_options.include_usage`, error objects) that a scheduler never sees. A real client
(aiohttp) sends each case below to the daemon's own port, with an API key when it has
keys: the request goes through the middleware, the handlers, the request flow and the
scheduler and back. Only these requests are admitted before READY: they carry a header
with a token of this process (`WARMUP_HEADER`). Each answer is checked (status, shape, a
usage chunk exactly when asked, `[DONE]` last); the first that is wrong raises
`HttpWarmUpFailed` naming the case and what came back (a handler's exception answers 500
with its type and message), and the daemon exits 70 instead of serving a path that fails.
No torch is imported here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

WARMUP_HEADER = "X-Specd-Warmup"
TIMEOUT_S = 120.0  # the whole warm-up: a handful of two-token requests
PROMPT = "Hello"
MESSAGES = [{"role": "user", "content": "Hello"}]


class HttpWarmUpFailed(Exception):
    """A warm-up case was answered wrongly: the case and the answer."""


@dataclass(frozen=True)
class Case:
    """One request (`body`: JSON, None for a GET) and the answer it must get: `status`,
    and a body `check` passes. `opens`: the requests it opens in the request flow (its
    choices; each counts against --max-pending-requests)."""

    name: str
    method: str
    path: str
    body: dict[str, Any] | None
    status: int
    check: Callable[[bytes], str | None]  # what is wrong with the body, or None
    opens: int = 1


def cases(model: str, has_chat_template: bool, too_long: int, max_open: int) -> list[Case]:
    """Every case: completions and chat, whole and streamed with usage on and off (in every
    chunk too), several choices (two, or `max_open` when the daemon holds fewer open
    requests), log-probabilities and echo, the refusals (a body that does not decode, an
    unknown model, a prompt the request flow refuses), and the other endpoints.
    `too_long`: a prompt length (tokens) past the model's maximum. A model without a chat
    template answers chat with its 400."""
    gen = {"model": model, "max_tokens": 2}
    choices = min(2, max_open)
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    chat = {**gen, "messages": MESSAGES}
    chat_status, chat_whole, chat_stream = (200, _whole("message"), _streamed) \
        if has_chat_template else (400, _error, _error_of_stream)
    return [
        Case("completions", "POST", "/v1/completions", {**gen, "prompt": PROMPT}, 200,
             _whole("text")),
        Case("completions streamed", "POST", "/v1/completions",
             {**gen, "prompt": PROMPT, "stream": True}, 200, _streamed(False)),
        Case("completions streamed with usage", "POST", "/v1/completions",
             {**gen, "prompt": PROMPT, **usage}, 200, _streamed(True)),
        Case("completions, several choices with log-probabilities and echo", "POST",
             "/v1/completions", {**gen, "prompt": PROMPT, "n": choices, "logprobs": 2,
                                 "echo": True}, 200, _whole("text", num_choices=choices),
             opens=choices),
        Case("chat", "POST", "/v1/chat/completions", chat, chat_status, chat_whole),
        Case("chat streamed", "POST", "/v1/chat/completions", {**chat, "stream": True},
             chat_status, chat_stream(False)),
        Case("chat streamed with usage", "POST", "/v1/chat/completions", {**chat, **usage},
             chat_status, chat_stream(True)),
        Case("chat streamed with log-probabilities and usage in every chunk", "POST",
             "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2,
                                      "stream": True, "stream_options": {
                                          "include_usage": True,
                                          "continuous_usage_stats": True}},
             chat_status, chat_stream(True)),
        Case("a body that does not decode", "POST", "/v1/completions",
             {"model": model, "prompt": PROMPT, "no_such_field": 1}, 400, _error),
        Case("an unknown model", "POST", "/v1/chat/completions",
             {**chat, "model": model + "-not-served"}, 404, _error),
        Case("a prompt too long", "POST", "/v1/completions",
             {**gen, "prompt": [1] * too_long}, 400, _error),
        Case("a prompt too long, streamed", "POST", "/v1/completions",
             {**gen, "prompt": [1] * too_long, "stream": True}, 400, _error),
        Case("models", "GET", "/v1/models", None, 200, _models),
        Case("the model's card", "GET", f"/v1/models/{model}", None, 200, _object),
        Case("SGLang's model info", "GET", "/get_model_info", None, 200, _object),
        Case("SGLang's server info", "GET", "/get_server_info", None, 200, _object),
        Case("metrics", "GET", "/metrics", None, 200, _metrics),
        Case("health", "GET", "/health", None, 503, _health_starting),
    ]


async def warm_up_http(host: str, port: int, api_key: bytes | None, token: str,
                       all_cases: list[Case], max_open: int) -> None:
    """Send every case to http://host:port, never more open requests at a time than
    `max_open` (the daemon's --max-pending-requests; a case opens `Case.opens`);
    HttpWarmUpFailed for the first answered wrong, in order."""
    headers = {WARMUP_HEADER: token}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key.decode()}"
    base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    async with aiohttp.ClientSession(headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session:
        # Together: the engine runs the generates as one batch; a case of several requests
        # alone after them (a shared count could admit part of it and be refused the rest).
        slots = asyncio.Semaphore(max_open)
        singles = [case for case in all_cases if case.opens == 1]
        answered = dict(zip((id(case) for case in singles), await asyncio.gather(
            *(_send(session, base, case, slots) for case in singles)), strict=True))
        for case in all_cases:
            if case.opens > 1:
                answered[id(case)] = await _send(session, base, case, slots)
        answers = [answered[id(case)] for case in all_cases]
    for case, (status, body) in zip(all_cases, answers, strict=True):
        problem = (f"status {status}, expected {case.status}" if status != case.status
                   else case.check(body))
        if problem is not None:
            raise HttpWarmUpFailed(f"{case.method} {case.path} ({case.name}): {problem}; "
                                   f"answered {body[:300].decode(errors='replace')}")


async def _send(session: aiohttp.ClientSession, base: str, case: Case,
                slots: asyncio.Semaphore) -> tuple[int, bytes]:
    """(status, body); (0, what went wrong) when no whole answer came."""
    try:
        async with slots, session.request(case.method, base + case.path,
                                          json=case.body) as reply:
            return reply.status, await reply.read()
    except aiohttp.ClientError as exc:
        return 0, f"no whole answer: {exc!r}".encode()


def local_host(host: str) -> str:
    """Where to reach a listener bound to `host` from this host (any address: loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _whole(field: str, num_choices: int = 1) -> Callable[[bytes], str | None]:
    def check(body: bytes) -> str | None:
        answer = _json(body)
        if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
            return "no choices"
        if len(answer["choices"]) != num_choices:
            return f"{len(answer['choices'])} choices, not {num_choices}"
        if not all(field in c for c in answer["choices"]) or "usage" not in answer:
            return f"no {field} or no usage"
        return None
    return check


def _events(body: bytes) -> list[str]:
    return [line.removeprefix("data: ") for line in body.decode().splitlines()
            if line.startswith("data: ")]


def _streamed(with_usage: bool) -> Callable[[bytes], str | None]:
    def check(body: bytes) -> str | None:
        events = _events(body)
        if not events or events[-1] != "[DONE]":
            return "the stream does not end with [DONE]"
        chunks = [_json(e.encode()) for e in events[:-1]]
        if not chunks or not all(isinstance(c, dict) for c in chunks):
            return "a chunk that is not a JSON object"
        errors = [c["error"] for c in chunks if "error" in c]
        if errors:
            return f"an error event: {errors[0].get('message')}"
        has_usage = any(c.get("usage") for c in chunks)
        return None if has_usage == with_usage else (
            "no usage chunk" if with_usage else "a usage chunk nobody asked for")
    return check


def _error_of_stream(with_usage: bool) -> Callable[[bytes], str | None]:
    return _error


def _error(body: bytes) -> str | None:
    answer = _json(body)
    if not isinstance(answer, dict) or not isinstance(answer.get("error"), dict):
        return "no error object"
    return None if answer["error"].get("message") else "an error without a message"


def _models(body: bytes) -> str | None:
    answer = _json(body)
    return None if isinstance(answer, dict) and answer.get("data") else "no model listed"


def _object(body: bytes) -> str | None:
    return None if isinstance(_json(body), dict) and _json(body) else "no JSON object"


def _metrics(body: bytes) -> str | None:
    return None if b"specd_" in body else "no specd metric"


def _health_starting(body: bytes) -> str | None:
    return None if _json(body) == {"status": "starting"} else "not starting"
