"""Tool calls and reasoning through the HTTP API with the official `openai` SDK, over a
scripted stand-in for the engine: the front's HTTP server, its output parsers and its
responses are the daemon's own; only the request flow is replaced by one that answers each
request with a recorded model output, token by token through the front's detokenizer, as
the flow sends a model's output. (The fixture models cannot call tools; this drives the
parser path with outputs in Kimi-K2.5's and Hermes' formats.)

A tool loop with `tool_choice` auto, streamed and not: the call parsed into `tool_calls`
(the stream accumulated by the SDK's own helper), the result sent back, a final answer;
thinking in `reasoning_content` when the rendered prompt opens it, and the thinking switch
(`chat_template_kwargs.thinking: false`) honoured; `tool_choice: none` leaves the answer
alone."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import openai
import pytest

from specd.daemon.config import DaemonConfig
from specd.daemon.control import Control
from specd.daemon.detokenizer import IncrementalDetokenizer
from specd.daemon.front_status import FrontStatus
from specd.daemon.health_watch import HealthWatch
from specd.daemon.http.listener import open_http_listener
from specd.daemon.http.metrics import Metrics
from specd.daemon.http.peer import HttpPeer
from specd.daemon.http.server import HttpServer
from specd.daemon.incidents import Incidents
from specd.daemon.lifecycle import State
from specd.daemon.prompts import PromptEncoder
from specd.daemon.request_flow import RequestFlow
from specd.ipc import messages as m
from specd.tokenizer import Tokenizer
from specd.workers.config import EngineConfig
from tests.unit.test_output_parsers import ADDED, KIMI_MARKERS, NUM_BASE
from tests.unit.test_tiktoken_tokenizer import write_model

# Kimi-K2.5's way: calls in history written with its markers (from which the parsers are
# chosen), the generation prompt opening the thinking unless `thinking` is false.
TEMPLATE = (
    "{%- for message in messages -%}<|im_user|>{{ message['role'] }}<|im_middle|>"
    "{{ message['content'] or '' }}"
    "{%- if message['tool_calls'] -%}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}<|tool_call_begin|>{{ call['id'] }}"
    "<|tool_call_argument_begin|>{{ call['function']['arguments'] }}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking %}<think></think>{% else %}<think>"
    "{% endif %}{%- endif -%}")
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = ("The user wants the weather in Paris; I will call the tool.</think>Let me check."
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris ☀"}<|tool_call_end|>'
        "<|tool_calls_section_end|>")
ANSWER = "The tool says it is sunny.</think>It is sunny in Paris, 24 °C."
NO_THINKING = "Hello! How can I help?"
MODEL = "kimi-scripted"
REFUSED = "refuse this one"


def script(generate: m.Generate, prompt: str) -> str:
    """The recorded output for a request: a call, the answer after a tool result, or a
    plain answer without thinking."""
    if "<think></think>" in prompt or generate.tools is None:
        return NO_THINKING
    roles = [message.role for message in generate.messages or []]
    return ANSWER if roles and roles[-1] == "tool" else CALL


class ScriptedFlow:
    """The request flow's interface as the HTTP server uses it (admit, on_connection_closed,
    tokenizer, prompts), answering with `script`'s output one token a Delta."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prompts = PromptEncoder(tokenizer, DaemonConfig())
        self.admitted: list[m.Generate] = []

    def admit(self, peer: HttpPeer, generate: m.Generate, warmup: bool = False) -> None:
        self.admitted.append(generate)
        prompt = self.prompts.render(generate).text
        ids = self.tokenizer.encode(script(generate, prompt), add_special_tokens=False)
        num_prompt = len(self.tokenizer.encode(prompt, add_special_tokens=False))
        asyncio.get_running_loop().call_soon(self._answer, peer, generate, ids, num_prompt)

    def _answer(self, peer: HttpPeer, generate: m.Generate, ids: list[int],
                num_prompt: int) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        peer.send(m.Prompt(generate.id, num_prompt))
        messages = generate.messages or []
        if messages and messages[-1].content == REFUSED:  # as the engine refuses a token id
            peer.send(m.Error(generate.id, "bad_request", "logit_bias token ids must be in "
                              "[0, 300)"))
            return
        for token_id in ids:
            peer.send(m.Delta(generate.id, detokenizer.add([token_id]), [token_id]))
        peer.send(m.Final(generate.id, "stop", num_prompt, len(ids), detokenizer.finish()))

    def on_connection_closed(self, peer: HttpPeer, reason: str) -> None:
        """Nothing to abort: every answer is sent at once."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    added = {**ADDED, **{NUM_BASE + 20 + i: text for i, text in enumerate(KIMI_MARKERS)}}
    decoder = {str(i): {"content": text, "special": text not in ("<think>", *KIMI_MARKERS)}
               for i, text in added.items()}
    root = tmp_path_factory.mktemp("models") / MODEL
    return write_model(root, added_tokens_decoder=decoder, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[openai.OpenAI, ScriptedFlow]]:
    config = DaemonConfig(engine=EngineConfig(model=str(model_dir)), http="127.0.0.1:0",
                          tool_call_parser="auto", reasoning_parser="auto")
    listener = open_http_listener(config)
    assert listener is not None
    flow = ScriptedFlow(Tokenizer.from_dir(model_dir))
    status = FrontStatus()
    status.state = State.READY
    status.ready = m.Ready(resolved={"max_model_len": 4096}, code_version="", modules={},
                           packages={}, pid=0, warmup_s=0.0)
    loop = asyncio.new_event_loop()
    # The scripted flow stands in for RequestFlow; control and health are not reached by
    # the generate routes this test uses.
    counters: Counter[str] = Counter()
    server = HttpServer(config, listener, status, counters, Metrics(),
                        cast(RequestFlow, flow), cast(Control, None), cast(HealthWatch, None),
                        Incidents(counters), new_connection_id=iter(range(10**6)).__next__,
                        warmup_token="test")
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    host, port = listener.address
    yield openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0), flow
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


Create = Callable[[list[Any]], tuple[Any, str | None]]


def tool_loop(create: Create) -> None:
    """Ask, get the call, send the result back, get the answer."""
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    message, finish_reason = create(messages)
    assert finish_reason == "tool_calls"
    assert message.content == "Let me check."
    assert (message.model_extra or {}).get("reasoning_content") == (
        "The user wants the weather in Paris; I will call the tool.")
    (call,) = message.tool_calls
    assert call.id == "functions.get_weather:0" and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris ☀"}
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 °C"}]
    message, finish_reason = create(messages)
    assert finish_reason == "stop" and not message.tool_calls
    assert message.content == "It is sunny in Paris, 24 °C."
    assert (message.model_extra or {}).get("reasoning_content") == "The tool says it is sunny."


def test_tool_loop_whole(served: tuple[openai.OpenAI, ScriptedFlow]) -> None:
    api, flow = served

    def create(messages: list[Any]) -> tuple[Any, str | None]:
        response = api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                               tool_choice="auto")
        return response.choices[0].message, response.choices[0].finish_reason

    tool_loop(create)
    # The assistant's call went back into the prompt as the client sent it.
    sent = flow.admitted[-1].messages
    assert sent is not None and sent[1].tool_calls is not None
    assert sent[2].role == "tool" and sent[2].tool_call_id == "functions.get_weather:0"


def test_tool_loop_streamed(served: tuple[openai.OpenAI, ScriptedFlow]) -> None:
    api, _ = served

    def create(messages: list[Any]) -> tuple[Any, str | None]:
        chunks = list(api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                  stream=True))
        # As OpenAI streams a call: id, type and name first with empty arguments, then
        # argument pieces with the index alone.
        calls = [c.choices[0].delta.tool_calls[0] for c in chunks
                 if c.choices and c.choices[0].delta.tool_calls]
        if calls:
            functions = [c.function for c in calls]
            assert calls[0].id and functions[0] and functions[0].arguments == ""
            assert all(c.id is None for c in calls[1:])
            assert all(f is not None and f.name is None for f in functions[1:])
        with api.chat.completions.stream(model=MODEL, messages=messages,
                                         tools=TOOLS) as stream:
            final = stream.get_final_completion()
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content", "")
                            for c in chunks if c.choices)
        message = final.choices[0].message
        # The SDK's helper joins the extra field's pieces as the chunks carry them.
        assert (message.model_extra or {}).get("reasoning_content") == reasoning
        return message, final.choices[0].finish_reason

    tool_loop(create)


def test_thinking_switch_and_tool_choice_none(served: tuple[openai.OpenAI, ScriptedFlow]
                                              ) -> None:
    api, flow = served
    question: list[Any] = [{"role": "user", "content": "Hi"}]
    response = api.chat.completions.create(model=MODEL, messages=question, tools=TOOLS,
                                           extra_body={"chat_template_kwargs":
                                                       {"thinking": False}})
    message = response.choices[0].message
    assert message.content == NO_THINKING and not message.tool_calls
    assert "reasoning_content" not in (message.model_extra or {})
    assert response.choices[0].finish_reason == "stop" and message.refusal is None
    # tool_choice none: the tools are not rendered (the script answers plainly then).
    response = api.chat.completions.create(model=MODEL, messages=question, tools=TOOLS,
                                           tool_choice="none", extra_body={
                                               "chat_template_kwargs": {"thinking": False}})
    assert flow.admitted[-1].tools is None
    assert response.choices[0].message.content == NO_THINKING


def test_a_refusal_before_any_output_is_an_http_status(served: tuple[openai.OpenAI,
                                                                     ScriptedFlow]) -> None:
    api, _ = served
    refused: list[Any] = [{"role": "user", "content": REFUSED}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as raised:
            api.chat.completions.create(model=MODEL, messages=refused, stream=stream)
        assert raised.value.code == "bad_request"
