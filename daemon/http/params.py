"""OpenAI request bodies -> the socket's `Generate`, validated by the socket's own schema.

A body is decoded into `CompletionRequest` or `ChatCompletionRequest` (the fields OpenAI's
API defines that specd serves, `frequency_penalty`, `presence_penalty` and `logit_bias`
included, plus the extra body fields vLLM and SGLang also take: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, specd's `speculative` and, for chat,
`chat_template_kwargs`). `logit_bias` keys are token ids written as decimal strings (JSON
object keys), as in OpenAI's API.
Like OpenAI's API, an unknown field is refused by name, and so is a field specd does not
implement when it asks for something (`n` other than 1, `echo`, `suffix`, `best_of`,
a `response_format` other than text, a `tool_choice` other than auto). The request is then
built as the socket's map (`{"prompt": ..., "sampling": {...}}`) and converted with
`msgspec.convert` into `messages.Generate`, which checks it exactly as a socket frame is
checked (bounds, token ids, `SamplingParams.__post_init__`); its errors are translated back
to the HTTP field names.

Defaults are OpenAI's where they differ from the socket's: temperature 1, completions
`max_tokens` 16, chat without a limit (the engine stops at the model's maximum length).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from specd.daemon.http.errors import HttpError
from specd.ipc import messages as m

OPENAI_TEMPERATURE = 1.0
COMPLETIONS_MAX_TOKENS = 16
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool | None = None


class _Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the operator's logs; no effect
    # specd's extra body fields (the SDK's `extra_body`)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    speculative: bool | None = None
    stop_token_ids: list[int] | None = None


class CompletionRequest(_Request, frozen=True):
    """POST /v1/completions. `prompt`: a string, token ids, or a one-element list of
    either (one prompt per request)."""

    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Request, frozen=True):
    """POST /v1/chat/completions. `messages` are checked by the socket's `ChatMessage`."""

    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None  # no effect: tool calls are the model's text
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True)
class Options:
    """What shapes the answer, beside the `Generate` that goes to the flow.

    num_top_logprobs: alternatives shown per token (None: no logprobs at all; the flow is
        asked for at least one, since the chosen token's own log-probability comes with it).
    """

    is_chat: bool
    stream: bool
    include_usage: bool
    num_top_logprobs: int | None


RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)


def decode_body(body: bytes, kind: type[RequestT]) -> RequestT:
    """The request struct of `body` (JSON). Raises HttpError 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise _bad_request(str(exc), {}) from exc
    except msgspec.DecodeError as exc:
        raise HttpError(400, f"the body is not valid JSON: {exc}", "bad_request") from exc


def completion_to_generate(req: CompletionRequest) -> tuple[m.Generate, Options]:
    """The socket request of a completions body. Raises HttpError 400."""
    _refuse_unsupported(req)
    if req.echo:
        raise HttpError(400, "echo is not supported", "bad_request", "echo")
    if req.suffix is not None:
        raise HttpError(400, "suffix is not supported", "bad_request", "suffix")
    if req.best_of not in (None, 1):
        raise HttpError(400, "best_of must be 1", "bad_request", "best_of")
    prompt = _single_prompt(req.prompt)
    fields = {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt}
    max_tokens = COMPLETIONS_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    sampling = _sampling(req, max_tokens, req.logprobs)
    options = Options(False, bool(req.stream), _include_usage(req), req.logprobs)
    return _convert(fields, sampling, req, {"logprobs": "logprobs"}), options


def chat_to_generate(req: ChatCompletionRequest, max_model_len: int
                     ) -> tuple[m.Generate, Options]:
    """The socket request of a chat body (`max_model_len`: the limit when none is given).
    Raises HttpError 400."""
    _refuse_unsupported(req)
    if req.tool_choice not in (None, "auto"):
        raise HttpError(400, "tool_choice must be auto: specd renders the tools into the "
                        "prompt and returns the model's text", "bad_request", "tool_choice")
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise HttpError(400, "response_format must be {\"type\": \"text\"}", "bad_request",
                        "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise HttpError(400, "top_logprobs needs logprobs: true", "bad_request",
                        "top_logprobs")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = next((n for n in (req.max_completion_tokens, req.max_tokens)
                       if n is not None), max_model_len)
    fields: dict[str, Any] = {"messages": req.messages}
    if req.tools is not None:
        fields["tools"] = req.tools
    if req.chat_template_kwargs is not None:
        fields["chat_template_kwargs"] = req.chat_template_kwargs
    names = {"logprobs": "top_logprobs",
             "max_tokens": "max_tokens" if req.max_completion_tokens is None
             else "max_completion_tokens"}
    options = Options(True, bool(req.stream), _include_usage(req), num_top)
    return _convert(fields, _sampling(req, max_tokens, num_top), req, names), options


def _refuse_unsupported(req: _Request) -> None:
    if req.n not in (None, 1):
        raise HttpError(400, f"n must be 1: specd returns one choice per request (got "
                        f"{req.n}); send several requests instead", "bad_request", "n")
    if req.stream_options is not None and not req.stream:
        raise HttpError(400, "stream_options needs stream: true", "bad_request",
                        "stream_options")


def _include_usage(req: _Request) -> bool:
    return bool(req.stream_options is not None and req.stream_options.include_usage)


def _single_prompt(prompt: str | list[Any]) -> str | list[Any]:
    """A string or a list of token ids, from any of the prompt forms OpenAI accepts."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
    if not prompt or not all(type(t) is int for t in prompt):
        raise HttpError(400, "prompt must be a string or a non-empty list of token ids (one "
                        "prompt per request)", "bad_request", "prompt")
    return prompt


def _sampling(req: _Request, max_tokens: int, num_top_logprobs: int | None
              ) -> dict[str, Any]:
    """The socket's `sampling` map (fields left out take SamplingParams' defaults)."""
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    given = {
        "temperature": OPENAI_TEMPERATURE if req.temperature is None else req.temperature,
        "max_tokens": max_tokens,
        "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p, "seed": req.seed,
        "stop": stop, "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "speculative": req.speculative,
        "logprobs": None if num_top_logprobs is None else max(1, num_top_logprobs),
        "repetition_penalty": req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "logit_bias": None if req.logit_bias is None else _token_keys(req.logit_bias),
    }
    return {key: value for key, value in given.items() if value is not None}


def _token_keys(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys, i.e. strings) with int keys;
    the bounds are SamplingParams' to check. HttpError 400 for a key that is no id."""
    # At most 19 digits: int() of a longer string costs time and may raise; such an id is
    # out of SamplingParams' bound anyway.
    bad = [key for key in logit_bias
           if not key.isascii() or not key.isdigit() or len(key) > 19]
    if bad:
        raise HttpError(400, f"logit_bias keys must be token ids (decimal integers), got "
                        f"{bad[:5]}", "bad_request", "logit_bias")
    return {int(key): value for key, value in logit_bias.items()}


def _convert(fields: dict[str, Any], sampling: dict[str, Any], req: _Request,
             names: dict[str, str]) -> m.Generate:
    """`msgspec.convert` into Generate: the socket's validation, errors renamed."""
    raw = {"id": 0, **fields, "sampling": sampling, "stream": bool(req.stream)}
    try:
        return msgspec.convert(raw, m.Generate)
    except msgspec.ValidationError as exc:
        raise _bad_request(str(exc), names) from exc


def _bad_request(message: str, names: dict[str, str]) -> HttpError:
    """400 for a msgspec validation message, `param` the HTTP field it names (`names`:
    socket sampling field -> HTTP field, where they differ)."""
    param: str | None = None
    match = _PATH.search(message)
    if match is not None:
        path = match.group(1)
        message = message[:match.start()]
        if path == "sampling":  # SamplingParams.__post_init__ names the field first
            path = message.split(" ", 1)[0]
        elif path.startswith("sampling."):
            path = path.removeprefix("sampling.")
        elif path.startswith("prompt_token_ids"):
            path = "prompt"
        param = names.get(path, path) or None
        message = f"{param}: {message}" if param and not message.startswith(param) else message
    else:
        field = re.search(r"field `([^`]+)`", message)
        param = field.group(1) if field else None
    return HttpError(400, message, "bad_request", param)
