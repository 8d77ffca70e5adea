"""OpenAI request bodies -> the socket's Generate (daemon/http/params.py): the mapping of
every parameter, OpenAI's defaults, and refusals that name the field at fault."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from specd.daemon.http import params
from specd.daemon.http.errors import HttpError
from specd.ipc import messages as m
from specd.ipc.sampling import SamplingParams
from specd.ipc.structured import (
    Choice,
    Grammar,
    JsonObject,
    JsonSchema,
    Regex,
    StructuredOutput,
    ToolCall,
    ToolSpec,
)

MAX_MODEL_LEN = 2048


def completion(**body: Any) -> tuple[m.Generate, params.Options]:
    raw = json.dumps({"model": "fixture", "prompt": "def f():", **body}).encode()
    return params.completion_to_generate(params.decode_body(raw, params.CompletionRequest),
                                         MAX_MODEL_LEN)


def chat(**body: Any) -> tuple[m.Generate, params.Options]:
    raw = json.dumps({"model": "fixture", "messages": [{"role": "user", "content": "hi"}],
                      **body}).encode()
    request = params.decode_body(raw, params.ChatCompletionRequest)
    return params.chat_to_generate(request, MAX_MODEL_LEN)


def refusal(build: Any, **body: Any) -> HttpError:
    with pytest.raises(HttpError) as raised:
        build(**body)
    assert raised.value.status == 400 and raised.value.code == "bad_request"
    return raised.value


def test_completion_parameters_map_onto_sampling_params() -> None:
    generate, options = completion(
        max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="\n\n", logprobs=2,
        top_k=5, min_p=0.1, ignore_eos=True, speculative=False, stop_token_ids=[4],
        stream=True, stream_options={"include_usage": True}, n=1, user="u1")
    assert generate.prompt == "def f():" and generate.stream
    assert generate.sampling == SamplingParams(
        temperature=0.5, top_k=5, top_p=0.9, min_p=0.1, seed=3, max_tokens=7,
        stop_token_ids=(4,), ignore_eos=True, logprobs=2, stop=("\n\n",), speculative=False)
    assert options == params.Options(False, True, True, 2)


def test_penalties_and_logit_bias_map_onto_sampling_params() -> None:
    for build in (completion, chat):
        generate, _ = build(frequency_penalty=0.5, presence_penalty=-2, repetition_penalty=1.2,
                            logit_bias={"5": 1.5, "0": -100})
        sampling = generate.sampling
        assert (sampling.frequency_penalty, sampling.presence_penalty,
                sampling.repetition_penalty) == (0.5, -2.0, 1.2)
        assert sampling.logit_bias == {5: 1.5, 0: -100.0}


def test_openai_defaults() -> None:
    generate, options = completion()
    assert generate.sampling == SamplingParams(temperature=1.0, max_tokens=16)
    assert not generate.stream and options == params.Options(False, False, False, None)
    generate, options = chat()
    assert generate.sampling == SamplingParams(temperature=1.0, max_tokens=MAX_MODEL_LEN)
    assert options.is_chat and options.num_top_logprobs is None


@pytest.mark.parametrize("prompt, fields", [
    ("x", {"prompt": "x"}),
    (["x"], {"prompt": "x"}),
    ([5, 6], {"prompt_token_ids": [5, 6]}),
    ([[5, 6]], {"prompt_token_ids": [5, 6]}),
])
def test_prompt_forms(prompt: Any, fields: dict[str, Any]) -> None:
    generate, _ = completion(prompt=prompt)
    assert {k: getattr(generate, k) for k in fields} == fields


@pytest.mark.parametrize("prompt", [[], ["a", "b"], [[1], [2]], [1, "a"], [True]])
def test_one_prompt_per_request(prompt: Any) -> None:
    assert refusal(completion, prompt=prompt).param == "prompt"


def test_chat_fields() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    generate, options = chat(max_tokens=9, max_completion_tokens=5, logprobs=True,
                             top_logprobs=3, tools=tools, tool_choice="auto",
                             chat_template_kwargs={"enable_thinking": False},
                             response_format={"type": "text"}, parallel_tool_calls=False)
    assert generate.messages == [m.ChatMessage("user", "hi")]
    assert generate.tools == tools and generate.chat_template_kwargs == {
        "enable_thinking": False}
    assert generate.sampling.max_tokens == 5 and generate.sampling.logprobs == 3
    assert options.num_top_logprobs == 3
    # logprobs without alternatives still asks the flow for one (the chosen token's own
    # log-probability comes with it); none are shown.
    generate, options = chat(logprobs=True)
    assert generate.sampling.logprobs == 1 and options.num_top_logprobs == 0


@pytest.mark.parametrize("build, body, param", [
    (completion, {"n": 0}, "n"),
    (chat, {"n": 129}, "n"),
    (completion, {"temperature": 2.5}, "temperature"),
    (completion, {"max_tokens": 10**9}, "max_tokens"),
    (chat, {"max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    (chat, {"messages": []}, "messages"),
    (chat, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (completion, {"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    (completion, {"min_tokens": -1}, "min_tokens"),
    (completion, {"skip_special_tokens": False}, "skip_special_tokens"),
    (chat, {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    (chat, {"regex": "[a-z]+", "guided_regex": "a"}, "regex"),  # two constraints: the second named
    (chat, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (chat, {"continue_final_message": True}, "continue_final_message"),
    (completion, {"frobnicate": 1}, "frobnicate"),
    (completion, {"max_tokens": "10"}, "max_tokens"),
    (completion, {"max_tokens": 0}, "max_tokens"),
    (chat, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (completion, {"temperature": -1}, "temperature"),
    (completion, {"top_p": 0}, "top_p"),
    (completion, {"logprobs": 21}, "logprobs"),
    (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (chat, {"top_logprobs": 2}, "top_logprobs"),
    (completion, {"prompt": [1, -2]}, "prompt"),
    (completion, {"stop": [""]}, "stop"),
    (completion, {"seed": 2**64}, "seed"),
    (completion, {"suffix": "x"}, "suffix"),
    (completion, {"best_of": 2}, "best_of"),
    (completion, {"presence_penalty": 2.5}, "presence_penalty"),
    (chat, {"frequency_penalty": -2.01}, "frequency_penalty"),
    (completion, {"repetition_penalty": 0}, "repetition_penalty"),
    (chat, {"repetition_penalty": -1.0}, "repetition_penalty"),
    (completion, {"logit_bias": {"5": 100.5}}, "logit_bias"),
    (completion, {"logit_bias": {"x": 1.0}}, "logit_bias"),
    (completion, {"logit_bias": {"-3": 1.0}}, "logit_bias"),
    (completion, {"logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),
    (completion, {"logit_bias": {str(2**31): 1.0}}, "logit_bias"),
    (completion, {"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    (completion, {"stream_options": {"include_usage": True}}, "stream_options"),
    (chat, {"tool_choice": "required"}, "tool_choice"),  # no tools, no tool-call format
    (chat, {"response_format": {"type": "structural_tag"}}, "response_format"),
    (chat, {"response_format": {"type": "json_schema"}}, "response_format"),
    (completion, {"guided_json": "[1]"}, "guided_json"),
    (completion, {"guided_json": "{"}, "guided_json"),
    (completion, {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    (chat, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    (completion, {"structured_outputs": {"grammar": ""}}, "structured_outputs"),
    (completion, {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    (completion, {"guided_choice": []}, "guided_choice"),
    (chat, {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0]"),
    (chat, {"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
    (chat, {"messages": [{"role": "user", "content": "x"}] * (m.MAX_MESSAGES + 1)},
     "messages"),
])
def test_refusals_name_the_field(build: Any, body: dict[str, Any], param: str | None) -> None:
    error = refusal(build, **body)
    assert error.param == param, error.message
    if param is not None:
        assert param.split("[")[0] in error.message


def test_model_is_required_and_bodies_must_be_json_objects() -> None:
    with pytest.raises(HttpError) as raised:
        params.decode_body(b'{"prompt": "x"}', params.CompletionRequest)
    assert raised.value.param == "model"
    for body in (b"{", b"[]", b"\xff"):
        with pytest.raises(HttpError) as raised:
            params.decode_body(body, params.CompletionRequest)
        assert raised.value.status == 400


def test_the_generate_passes_the_sockets_own_decoder() -> None:
    # What the HTTP adapter builds is a request the socket would have accepted as is.
    generate, _ = chat(max_tokens=4, stop=["a"], top_k=2, seed=-1)
    frame = msgspec.msgpack.encode(generate)
    assert msgspec.msgpack.decode(frame, type=m.ClientMessage) == generate


def test_choices_echo_and_the_fields_specd_implements() -> None:
    generate, options = completion(n=3, seed=-1, echo=True, logprobs=1, min_tokens=2,
                                   include_stop_str_in_output=True, max_tokens=4)
    assert options.num_choices == 3 and options.echo and options.include_stop_str
    assert generate.sampling.prompt_logprobs == 1 and generate.sampling.min_tokens == 2
    choices = params.choices(generate, options.num_choices)
    assert [c.id for c in choices] == [0, 1, 2]
    assert all(c.stream and c.report_prompt for c in choices)
    # Each choice its own seed: seed + i, modulo 2**64 (-1 seeds as 2**64 - 1).
    assert [c.sampling.seed for c in choices] == [-1, 0, 1]
    assert completion(echo=True)[0].sampling.prompt_logprobs is None  # no logprobs asked
    _, options = completion(no_stop_trim=True)
    assert options.include_stop_str


def test_router_defaults_are_accepted() -> None:
    defaults = {name: value for name, value in params.ROUTER_DEFAULTS.items()}
    for build in (completion, chat):
        generate, _ = build(**defaults, no_stop_trim=False, include_stop_str_in_output=False)
        assert generate.sampling.temperature == 1.0


def test_stream_options_and_tool_choice() -> None:
    _, options = chat(stream=True, stream_options={"include_usage": True,
                                                   "continuous_usage_stats": True})
    assert options.include_usage and options.continuous_usage
    _, options = chat(stream=True, stream_options={"continuous_usage_stats": True})
    assert not options.continuous_usage  # as vLLM: only with include_usage
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    generate, options = chat(tools=tools)
    assert generate.tools == tools and options.parse_tools
    # tool_choice none: the tools are not rendered and the answer is not parsed.
    generate, options = chat(tools=tools, tool_choice="none")
    assert generate.tools is None and not options.parse_tools
    assert not chat()[1].parse_tools
    generate, _ = chat(add_generation_prompt=False)
    assert generate.chat_template_kwargs == {"add_generation_prompt": False}


# The bodies sglang-router 0.3 and vllm-router 0.1 forward for a plain request (captured
# from the routers): their own fields added at their defaults.
ROUTER_BODIES = [
    ("chat", {"stream": False, "max_tokens": 8, "logprobs": False, "no_stop_trim": False,
              "ignore_eos": False, "continue_final_message": False,
              "skip_special_tokens": True, "separate_reasoning": True,
              "stream_reasoning": True, "return_hidden_states": False,
              "include_reasoning": True}),
    ("completion", {"max_tokens": 8, "stream": False, "echo": False, "no_stop_trim": False,
                    "ignore_eos": False, "skip_special_tokens": True,
                    "return_hidden_states": False}),
]


@pytest.mark.parametrize("kind, body", ROUTER_BODIES, ids=["chat", "completion"])
def test_the_routers_bodies_are_served(kind: str, body: dict[str, Any]) -> None:
    generate, options = (chat if kind == "chat" else completion)(**body)
    assert generate.sampling.max_tokens == 8 and not generate.sampling.ignore_eos
    assert not options.include_stop_str and not options.echo


def test_reasoning_switches() -> None:
    _, options = chat()
    assert options.parse_reasoning and options.include_reasoning
    assert not chat(separate_reasoning=False)[1].parse_reasoning
    assert not chat(include_reasoning=False)[1].include_reasoning

# --- structured output ------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "get", "description": "d",
                                            "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "noop"}}]


def chat_with(tool_call_format: str | None, **body: Any) -> tuple[m.Generate, params.Options]:
    raw = json.dumps({"model": "fixture", "messages": [{"role": "user", "content": "hi"}],
                      **body}).encode()
    request = params.decode_body(raw, params.ChatCompletionRequest)
    return params.chat_to_generate(request, MAX_MODEL_LEN, tool_call_format)


def test_response_format_and_vllms_fields_become_the_constraint() -> None:
    json_schema = {"type": "json_schema",
                   "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    cases: list[tuple[Any, dict[str, Any], StructuredOutput]] = [
        (chat, {"response_format": {"type": "json_object"}}, JsonObject()),
        (chat, {"response_format": json_schema}, JsonSchema(SCHEMA)),
        (completion, {"response_format": json_schema}, JsonSchema(SCHEMA)),
        (completion, {"guided_json": SCHEMA}, JsonSchema(SCHEMA)),
        (completion, {"guided_json": json.dumps(SCHEMA)}, JsonSchema(SCHEMA)),
        (chat, {"guided_regex": "[a-z]+"}, Regex("[a-z]+")),
        (chat, {"guided_choice": ["yes", "no"]}, Choice(["yes", "no"])),
        (completion, {"guided_grammar": 'root ::= "x"'}, Grammar('root ::= "x"')),
        (completion, {"structured_outputs": {"json": SCHEMA}}, JsonSchema(SCHEMA)),
        (completion, {"structured_outputs": {"regex": "a+"}}, Regex("a+")),
        (completion, {"structured_outputs": {"choice": ["a"]}}, Choice(["a"])),
        (completion, {"structured_outputs": {"grammar": "start: \"a\""}},
         Grammar("start: \"a\"")),
        (completion, {"structured_outputs": {"json_object": True}}, JsonObject()),
        (completion, {"regex": "a+"}, Regex("a+")),  # SGLang's fields
        (chat, {"ebnf": 'root ::= "x"'}, Grammar('root ::= "x"')),
        (completion, {"json_schema": json.dumps(SCHEMA)}, JsonSchema(SCHEMA)),
        (chat, {"response_format": json_schema,
                "structured_outputs": {"disable_any_whitespace": True}},
         JsonSchema(SCHEMA, any_whitespace=False)),
    ]
    for build, body, constraint in cases:
        generate, _ = build(**body)
        assert generate.sampling.structured == constraint, body
        frame = msgspec.msgpack.encode(generate)  # what the socket would take as it is
        assert msgspec.msgpack.decode(frame, type=m.ClientMessage) == generate
    generate, _ = chat(response_format={"type": "text"})
    assert generate.sampling.structured is None


def test_tool_choice_required_or_named_is_a_tool_call_constraint() -> None:
    generate, _ = chat_with("hermes", tools=TOOLS, tool_choice="required")
    assert generate.sampling.structured == ToolCall(
        "hermes", [ToolSpec("get", SCHEMA), ToolSpec("noop")])
    assert generate.tools == TOOLS  # the template still renders them
    generate, _ = chat_with("kimi_k2", tools=TOOLS, parallel_tool_calls=False,
                            tool_choice={"type": "function", "function": {"name": "get"}})
    assert generate.sampling.structured == ToolCall(
        "kimi_k2", [ToolSpec("get", SCHEMA), ToolSpec("noop")], function="get",
        parallel=False)
    generate, _ = chat_with("hermes", tools=TOOLS, tool_choice="auto")
    assert generate.sampling.structured is None


@pytest.mark.parametrize("fmt, body", [
    (None, {"tools": TOOLS, "tool_choice": "required"}),  # the daemon has no tool-call format
    ("hermes", {"tool_choice": "required"}),  # no tools
    ("hermes", {"tools": TOOLS, "tool_choice": {"type": "function",
                                                "function": {"name": "other"}}}),
    ("hermes", {"tools": TOOLS, "tool_choice": {"type": "function"}}),
    ("hermes", {"tools": [{"type": "function", "function": {"name": "a b"}}],
                "tool_choice": "required"}),
    ("nope", {"tools": TOOLS, "tool_choice": "required"}),
    ("hermes", {"tools": TOOLS, "tool_choice": "required",
                "response_format": {"type": "json_object"}}),
])
def test_tool_choice_refusals_name_it(fmt: str | None, body: dict[str, Any]) -> None:
    with pytest.raises(HttpError) as raised:
        chat_with(fmt, **body)
    assert raised.value.status == 400 and raised.value.param == "tool_choice", raised.value
