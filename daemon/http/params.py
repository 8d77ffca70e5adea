"""OpenAI request bodies -> the socket's `Generate`, validated by the socket's own schema.

A body is decoded into `CompletionRequest` or `ChatCompletionRequest` (the fields OpenAI's
API defines that specd serves, `frequency_penalty`, `presence_penalty`, `logit_bias`, `n` and
`echo` included, plus the extra body fields vLLM and SGLang also take: `top_k`, `min_p`,
`min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output` (SGLang's `no_stop_trim`), specd's `speculative` and, for chat,
`chat_template_kwargs`). `logit_bias` keys are token ids written as decimal strings (JSON
object keys), as in OpenAI's API. The fields routers and clients add with their default
values (`skip_special_tokens: true`, `spaces_between_special_tokens: true`,
`continue_final_message: false`, ...; `ROUTER_DEFAULTS`) are accepted at those values,
which are what specd does; another value is refused by name. vLLM's `include_reasoning`
and SGLang's `separate_reasoning` are served (false: the reasoning is dropped, or left in
the content).
Structured output (`SamplingParams.structured`, ipc/structured.py): `response_format`
`json_object` or `json_schema` (OpenAI's), vLLM's extra fields `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` (`json`,
`regex`, `choice`, `grammar`, `json_object`, `disable_any_whitespace`), SGLang's `regex`,
`ebnf` and `json_schema`, and for chat a `tool_choice` of `required` or a named function
(tool calls in the format of `tool_call_format`, the daemon's tool-call parser; without one
they are refused). One constraint per request: two are refused, naming the second.
Like OpenAI's API, an unknown field is refused by name, and so is a field specd does not
implement when it asks for something (`suffix`, `best_of` above 1, a `response_format`
other than text, json_object and json_schema). The request is then
built as the socket's map (`{"prompt": ..., "sampling": {...}}`) and converted with
`msgspec.convert` into `messages.Generate`, which checks it exactly as a socket frame is
checked (bounds, token ids, `SamplingParams.__post_init__`); its errors are translated back
to the HTTP field names. OpenAI's own bounds come first: `temperature` in [0, 2], `messages`
not empty, roles OpenAI's, `max_tokens` below the model's maximum length.

`n` choices (and, for completions, echo's prompt log-probabilities) are the request
flow's: `choices` makes one `Generate` per choice, each a request of its own in the flow.

Defaults are OpenAI's where they differ from the socket's: temperature 1, completions
`max_tokens` 16, chat without a limit (the engine stops at the model's maximum length).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from specd.daemon.http.errors import HttpError
from specd.ipc import messages as m
from specd.ipc.sampling import MAX_INT64

OPENAI_TEMPERATURE = 1.0
COMPLETIONS_MAX_TOKENS = 16
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


MAX_CHOICES = 128  # OpenAI's bound on n
MAX_TEMPERATURE = 2.0  # OpenAI's bound on temperature
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
TOOL_CHOICES = ("none", "auto")


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # usage (so far) in every chunk


class JsonSchemaFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`response_format.json_schema`, as OpenAI defines it (`strict` changes nothing: the
    output always satisfies the schema)."""

    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: at most one constraint, and the JSON whitespace switch
    (which also applies to a `response_format` or `guided_json` given beside it)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


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
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    no_stop_trim: bool | None = None  # SGLang's name for include_stop_str_in_output
    # Sent by routers and clients at their defaults, which are what specd does
    # (ROUTER_DEFAULTS); another value is refused.
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    return_hidden_states: bool | None = None
    stream_reasoning: bool | None = None
    lora_path: str | None = None
    session_params: dict[str, Any] | None = None
    stop_regex: str | list[str] | None = None
    # Structured output (module docstring)
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    regex: str | None = None  # SGLang's
    ebnf: str | None = None
    json_schema: str | None = None


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
    tool_choice: str | dict[str, Any] | None = None
    # With tool_choice required: whether the answer may hold several calls (default true).
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    include_reasoning: bool | None = None  # vLLM's: false drops the reasoning
    separate_reasoning: bool | None = None  # SGLang's: false leaves it in the content


@dataclass(frozen=True)
class Options:
    """What shapes the answer, beside the `Generate` that goes to the flow.

    num_top_logprobs: alternatives shown per token (None: no logprobs at all; the flow is
        asked for at least one, since the chosen token's own log-probability comes with it).
    num_choices: `n`. continuous_usage: usage so far in every chunk (with include_usage).
    echo: completions' prompt before the output (its log-probabilities too, with
        logprobs). include_stop_str: the stop string that ended a choice stays in its text.
    parse_tools: a tool-call parser reads the answer (tools given, tool_choice not none).
    parse_reasoning: the reasoning parser (if the model has one) reads the answer
        (SGLang's separate_reasoning); include_reasoning: its reasoning is answered (vLLM's
        include_reasoning; false drops it).
    """

    is_chat: bool
    stream: bool
    include_usage: bool
    num_top_logprobs: int | None
    num_choices: int = 1
    continuous_usage: bool = False
    echo: bool = False
    include_stop_str: bool = False
    parse_tools: bool = False
    parse_reasoning: bool = True
    include_reasoning: bool = True


RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)


def decode_body(body: bytes, kind: type[RequestT]) -> RequestT:
    """The request struct of `body` (JSON). Raises HttpError 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise _bad_request(str(exc), {}) from exc
    except msgspec.DecodeError as exc:
        raise HttpError(400, f"the body is not valid JSON: {exc}", "bad_request") from exc


def completion_to_generate(req: CompletionRequest, max_model_len: int = MAX_INT64
                           ) -> tuple[m.Generate, Options]:
    """The socket request of a completions body (`max_model_len`: the bound on
    `max_tokens`). Raises HttpError 400."""
    _refuse_unsupported(req, max_model_len)
    if req.suffix is not None:
        raise HttpError(400, "suffix is not supported", "bad_request", "suffix")
    if req.best_of not in (None, 1):
        raise HttpError(400, "best_of must be 1", "bad_request", "best_of")
    prompt = _single_prompt(req.prompt)
    fields = {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt}
    max_tokens = COMPLETIONS_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    sampling = _sampling(req, max_tokens, req.logprobs)
    if req.echo and req.logprobs is not None:
        sampling["prompt_logprobs"] = req.logprobs
    names = {"logprobs": "logprobs", **_add_structured(sampling, constraints(req))}
    options = _options(req, False, req.logprobs, echo=bool(req.echo))
    return _convert(fields, sampling, req, names), options


def chat_to_generate(req: ChatCompletionRequest, max_model_len: int,
                     tool_call_format: str | None = None) -> tuple[m.Generate, Options]:
    """The socket request of a chat body (`max_model_len`: the limit when none is given,
    and the bound on one that is; `tool_call_format`: the format `tool_choice` required or
    named is served in, the daemon's tool-call parser, one of ipc/structured.py's
    TOOL_CALL_FORMATS, None when it has none). Raises HttpError 400."""
    _refuse_unsupported(req, max_model_len)
    _check_messages(req.messages)
    found = constraints(req)
    tool_call = _tool_choice(req, tool_call_format)
    if tool_call is not None:
        found.append(("tool_choice", tool_call))
    if req.continue_final_message:
        raise HttpError(400, "continue_final_message is not supported", "bad_request",
                        "continue_final_message")
    if req.top_logprobs is not None and not req.logprobs:
        raise HttpError(400, "top_logprobs needs logprobs: true", "bad_request",
                        "top_logprobs")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = next((n for n in (req.max_completion_tokens, req.max_tokens)
                       if n is not None), max_model_len)
    fields: dict[str, Any] = {"messages": req.messages}
    # tool_choice none: the tools are left out of the prompt and the answer is not parsed
    # for calls (vLLM's rule), so the model answers in text.
    uses_tools = bool(req.tools) and req.tool_choice != "none"
    if req.tools is not None and req.tool_choice != "none":
        fields["tools"] = req.tools
    kwargs = dict(req.chat_template_kwargs or {})
    if req.add_generation_prompt is not None:
        kwargs["add_generation_prompt"] = req.add_generation_prompt
    if req.chat_template_kwargs is not None or kwargs:
        fields["chat_template_kwargs"] = kwargs
    names = {"logprobs": "top_logprobs",
             "max_tokens": "max_tokens" if req.max_completion_tokens is None
             else "max_completion_tokens"}
    options = dataclasses.replace(
        _options(req, True, num_top, parse_tools=uses_tools),
        parse_reasoning=req.separate_reasoning is not False,
        include_reasoning=req.include_reasoning is not False)
    sampling = _sampling(req, max_tokens, num_top)
    names.update(_add_structured(sampling, found))
    return _convert(fields, sampling, req, names), options


def constraints(req: _Request) -> list[tuple[str, dict[str, Any]]]:
    """The structured-output constraints a body asks for (as the socket's `structured`
    maps), each with the field that asked: `response_format`, the `guided_*` fields and
    `structured_outputs`, SGLang's fields. HttpError 400 for a response format specd does
    not serve and for a JSON schema that is not a JSON object."""
    found: list[tuple[str, dict[str, Any]]] = []
    if req.response_format is not None:
        constraint = _response_format(req.response_format)
        if constraint is not None:
            found.append(("response_format", constraint))
    if req.guided_json is not None:
        found.append(("guided_json", _json_schema(req.guided_json, "guided_json")))
    if req.guided_regex is not None:
        found.append(("guided_regex", {"type": "regex", "pattern": req.guided_regex}))
    if req.guided_choice is not None:
        found.append(("guided_choice", {"type": "choice", "choices": req.guided_choice}))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", {"type": "grammar", "grammar": req.guided_grammar}))
    if req.regex is not None:  # SGLang's three
        found.append(("regex", {"type": "regex", "pattern": req.regex}))
    if req.ebnf is not None:
        found.append(("ebnf", {"type": "grammar", "grammar": req.ebnf}))
    if req.json_schema is not None:
        found.append(("json_schema", _json_schema(req.json_schema, "json_schema")))
    outputs = req.structured_outputs
    if outputs is not None:
        found += _structured_outputs(outputs)
        if outputs.disable_any_whitespace:
            for _, constraint in found:
                if constraint["type"] in ("json_schema", "json_object"):
                    constraint["any_whitespace"] = False
    return found


def _response_format(fmt: ResponseFormat) -> dict[str, Any] | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise HttpError(400, "response_format: json_schema needs its json_schema object "
                            "(name, schema)", "bad_request", "response_format")
        # No schema: any JSON value, as the empty schema says.
        return {"type": "json_schema", "schema": fmt.json_schema.schema or {}}
    raise HttpError(400, f"response_format: type must be text, json_object or json_schema, "
                    f"got {fmt.type!r}", "bad_request", "response_format")


def _structured_outputs(outputs: StructuredOutputs) -> list[tuple[str, dict[str, Any]]]:
    field = "structured_outputs"
    found: list[tuple[str, dict[str, Any]]] = []
    if outputs.json is not None:
        found.append((field, _json_schema(outputs.json, f"{field}.json")))
    if outputs.regex is not None:
        found.append((field, {"type": "regex", "pattern": outputs.regex}))
    if outputs.choice is not None:
        found.append((field, {"type": "choice", "choices": outputs.choice}))
    if outputs.grammar is not None:
        found.append((field, {"type": "grammar", "grammar": outputs.grammar}))
    if outputs.json_object:
        found.append((field, {"type": "json_object"}))
    return found


def _json_schema(schema: str | dict[str, Any], field: str) -> dict[str, Any]:
    """A json_schema constraint of a schema given as an object or as its JSON text."""
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError as exc:
            raise HttpError(400, f"{field}: not valid JSON: {exc}", "bad_request",
                            field.split(".")[0]) from exc
    if not isinstance(schema, dict):
        raise HttpError(400, f"{field}: a JSON schema must be a JSON object", "bad_request",
                        field.split(".")[0])
    return {"type": "json_schema", "schema": schema}


def _tool_choice(req: ChatCompletionRequest, tool_call_format: str | None
                 ) -> dict[str, Any] | None:
    """The tool_call constraint of `tool_choice` required or a named function (None for
    none, auto or absent). HttpError 400 for another value, without tools, without a
    tool-call format, or naming a function that is not among the tools."""
    choice = req.tool_choice
    if choice is None or choice in TOOL_CHOICES:
        return None
    if choice == "required":
        function = None
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        function = choice["function"]["name"]
    else:
        raise HttpError(400, "tool_choice must be none, auto, required or {\"type\": "
                        "\"function\", \"function\": {\"name\": NAME}}", "bad_request",
                        "tool_choice")
    if not req.tools:
        raise HttpError(400, "tool_choice required or named needs tools", "bad_request",
                        "tool_choice")
    if tool_call_format is None:
        raise HttpError(400, "tool_choice required or named needs the model's tool-call "
                        "format: start specd with --tool-call-parser NAME", "bad_request",
                        "tool_choice")
    tools = [_tool_spec(t) for t in req.tools]
    if function is not None and function not in [t["name"] for t in tools]:
        raise HttpError(400, f"tool_choice names {function!r}, which is not among the tools",
                        "bad_request", "tool_choice")
    constraint: dict[str, Any] = {"type": "tool_call", "format": tool_call_format,
                                  "tools": tools}
    if function is not None:
        constraint["function"] = function
    if req.parallel_tool_calls is False:
        constraint["parallel"] = False
    return constraint


def _tool_spec(tool: Any) -> dict[str, Any]:
    """A tool's name and parameters, from OpenAI's `{"type": "function", "function":
    {"name", "description", "parameters"}}` (the rest is the template's)."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise HttpError(400, "tools: each tool must be {\"type\": \"function\", \"function\": "
                        "{\"name\": ..., \"parameters\": ...}}", "bad_request", "tools")
    spec: dict[str, Any] = {"name": function["name"]}
    if function.get("parameters") is not None:
        spec["parameters"] = function["parameters"]
    return spec


def _add_structured(sampling: dict[str, Any], found: list[tuple[str, dict[str, Any]]]
                    ) -> dict[str, str]:
    """Put the one constraint into `sampling`; the socket name -> HTTP name map for its
    errors. HttpError 400 when a body asks for two."""
    if len(found) > 1:
        raise HttpError(400, f"one structured-output constraint per request: {found[0][0]} "
                        f"and {found[1][0]} both give one", "bad_request", found[1][0])
    if not found:
        return {}
    field, constraint = found[0]
    sampling["structured"] = constraint
    return {"structured": field}


def choices(generate: m.Generate, num_choices: int) -> list[m.Generate]:
    """One generate per choice, its id the choice's index, each streamed to the HTTP
    handler (which answers streamed or whole), its prompt reported (usage so far). A
    seeded request's choice i is seeded with seed + i (modulo 2**64, a negative seed
    counted as its two's complement, as SamplingParams seeds): each choice has its own
    stream of random numbers, and the same request gives the same choices."""
    out = []
    for index in range(num_choices):
        sampling = generate.sampling
        if sampling.seed is not None and index:
            sampling = msgspec.structs.replace(sampling,
                                               seed=(sampling.seed + index) % 2**64)
        out.append(msgspec.structs.replace(generate, id=index, stream=True,
                                           sampling=sampling, report_prompt=True))
    return out


def _options(req: _Request, is_chat: bool, num_top: int | None, echo: bool = False,
             parse_tools: bool = False) -> Options:
    continuous = bool(req.stream_options is not None
                      and req.stream_options.continuous_usage_stats)
    include_usage = _include_usage(req)
    return Options(is_chat, bool(req.stream), include_usage, num_top,
                   num_choices=1 if req.n is None else req.n,
                   continuous_usage=continuous and include_usage, echo=echo,
                   include_stop_str=bool(req.include_stop_str_in_output or req.no_stop_trim),
                   parse_tools=parse_tools)


# Fields routers and clients send with these values (SGLang's and vLLM's defaults), which
# mean what specd does anyway: another value asks for something specd does not do.
ROUTER_DEFAULTS: dict[str, Any] = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "return_hidden_states": False, "stream_reasoning": True,
    "lora_path": None, "session_params": None, "stop_regex": None,
}


def _refuse_unsupported(req: _Request, max_model_len: int) -> None:
    """OpenAI's bounds specd's own checks leave out, and fields specd does not serve."""
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise HttpError(400, f"n must be in [1, {MAX_CHOICES}], got {req.n}", "bad_request",
                        "n")
    if req.stream_options is not None and not req.stream:
        raise HttpError(400, "stream_options needs stream: true", "bad_request",
                        "stream_options")
    if req.temperature is not None and not req.temperature <= MAX_TEMPERATURE:
        raise HttpError(400, f"temperature must be in [0, {MAX_TEMPERATURE:g}], got "
                        f"{req.temperature}", "bad_request", "temperature")
    limits = [("max_tokens", req.max_tokens),
              ("max_completion_tokens", getattr(req, "max_completion_tokens", None))]
    for name, value in limits:
        if value is not None and value >= max_model_len:
            raise HttpError(400, f"{name} is {value}, but this model's maximum length is "
                            f"{max_model_len} tokens, prompt included", "bad_request", name)
    if req.min_tokens is not None and req.min_tokens < 0:
        raise HttpError(400, f"min_tokens must be >= 0, got {req.min_tokens}", "bad_request",
                        "min_tokens")
    for name, default in ROUTER_DEFAULTS.items():
        value = getattr(req, name)
        if value is not None and value != default:
            raise HttpError(400, f"{name}: only {json.dumps(default)} is supported",
                            "bad_request", name)


def _check_messages(messages: list[Any]) -> None:
    """OpenAI's rules the socket leaves to the template: messages not empty, known roles."""
    if not messages:
        raise HttpError(400, "messages must not be empty", "bad_request", "messages")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role and role not in CHAT_ROLES:
            raise HttpError(400, f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got "
                            f"{role!r}", "bad_request", f"messages[{i}].role")


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
        "min_tokens": req.min_tokens,
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
        elif path.startswith("sampling.structured"):
            path = "structured"  # the HTTP field that gave the constraint (`names`)
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
