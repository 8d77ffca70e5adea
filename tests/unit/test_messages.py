"""Every message type round-trips through msgpack, and requests are validated strictly."""

from __future__ import annotations

import typing

import msgspec
import pytest

from specd.ipc import messages as m
from specd.ipc.sampling import SamplingParams

CLIENT_MESSAGES = [
    m.Generate(id=1, prompt="hello", sampling=SamplingParams(max_tokens=4, stop=("\n",))),
    m.Generate(id=2, messages=[m.ChatMessage("user", "hi")], stream=False, deadline_s=2.5),
    m.Generate(id=3, prompt_token_ids=[5, 6, 7]),
    m.Generate(id=14, prompt_token_ids=[5, 6], report_prompt=True, sampling=SamplingParams(
        min_tokens=2, prompt_logprobs=1)),
    m.Generate(id=10, prompt="x", sampling=SamplingParams(
        repetition_penalty=1.2, frequency_penalty=-0.5, presence_penalty=2.0,
        logit_bias={0: -100.0, 7: 2.5})),
    m.Abort(id=4, target=1),
    m.StatusQuery(id=5),
    m.StatsQuery(id=6),
    m.SetSpec(id=7, mode="auto", threshold=8),
    m.Drain(id=8, timeout_s=3.0),
    m.Stop(id=9),
    m.Tokenize(id=11, prompt="def f():"),
    m.Tokenize(id=12, messages=[m.ChatMessage("user", "hi")],
               chat_template_kwargs={"add_generation_prompt": False}),
    m.Generate(id=13, messages=[
        m.ChatMessage("assistant", None, reasoning_content="call it", tool_calls=[
            {"id": "functions.f:0", "type": "function",
             "function": {"name": "f", "arguments": "{}"}}]),
        m.ChatMessage("tool", "42", tool_call_id="functions.f:0"),
        m.ChatMessage("assistant", "It is 42.", reasoning="read it")],
        chat_template_kwargs={"thinking": False}),
]
SERVER_MESSAGES = [
    m.Delta(id=1, text="hé", token_ids=[3, 4]),
    m.Delta(id=2, text="x", token_ids=[5], logprobs=[m.Logprob(-0.5, [5, 6], [-0.5, -1.5])]),
    m.Delta(id=1),
    m.Prompt(id=1, num_tokens=3, token_ids=[7, 8, 9],
             logprobs=[m.Logprob(-1.5, [8], [-1.5]), m.Logprob(-0.25, [3], [-0.125])]),
    m.Final(id=1, finish_reason="stop", num_prompt_tokens=3, num_output_tokens=2,
            num_drafted=6, num_accepted=4, acceptance_length=2.5, stop_string="\n"),
    m.Error(id=None, code="bad_frame", message="frame too large"),
    m.Error(id=3, code="overloaded", message="queue full"),
    m.StatusReply(id=5, state="ready", protocol=1, version="0.1.0", uptime_s=1.5, model="fx",
                  num_open_requests=0, num_connections=1, resolved={"num_kv_blocks": 4},
                  engine={}, provenance={"code_version": "ab"}, config={}),
    m.StatusReply(id=6, state="stalled", protocol=1, version="0.1.0", uptime_s=1.5,
                  model="fx", num_open_requests=1, num_connections=1, resolved={},
                  engine={}, provenance={}, config={},
                  problems={"requests_lost": "1 since start; last: request r1"},
                  fallbacks={"http_handler": "1 since start; last: KeyError"}),
    m.StatsReply(id=6, stats={"num_steps": 3}),
    m.Ack(id=7, message="ok"),
    m.Tokens(id=11, token_ids=[1, 2, 3]),
]
TO_SCHEDULER = [
    m.AddRequest("r1", [1, 2], SamplingParams(temperature=0.7, seed=3)),
    m.AddRequest("r2", [1], SamplingParams(repetition_penalty=0.8, logit_bias={3: 1.0})),
    m.AbortRequests(["r1", "r2"]),
    m.SetSpecMode(query_id=1, mode="off"),
    m.QueryStats(query_id=2),
    m.Reconcile(query_id=4),
    m.ForgetFigures(),
    m.Shutdown(),
]
FROM_SCHEDULER = [
    m.StartupStage("load"),
    m.Ready(resolved={"max_model_len": 512}, code_version="abc", modules={"specd": "/x"},
            packages={"torch": "2"}, pid=7, warmup_s=0.5),
    m.SchedulerFailed(stage="load", error="ValueError: no", traceback="Traceback ..."),
    m.StepOutput(step=3, deltas=[m.TokenDelta("r1", [9], "length", 2, 1, 0, 5, 3)]),
    m.StepOutput(step=5, deltas=[m.TokenDelta("r2", finish_reason="error",
                                              error="ValueError: no")]),
    m.StepOutput(step=4),
    m.StepOutput(step=6, deltas=[m.TokenDelta("r3", [4])], prompt_logprobs=[
        m.PromptLogprobs("r3", [m.Logprob(-2.0, [1, 2], [-0.5, -1.0])])]),
    m.RequestRejected("r1", "prompt too long"),
    m.QueryReply(query_id=2, result={"num_steps": 1}),
    m.QueryReply(query_id=3, result={}, error="bad mode"),
    m.Holding(query_id=4, request_ids=["r1", "r3"], idle_s=2.5),
    m.Stopped(),
]


def _members(union: typing.Any) -> set[type]:
    return set(typing.get_args(union))


@pytest.mark.parametrize("union, samples", [
    (m.ClientMessage, CLIENT_MESSAGES), (m.ServerMessage, SERVER_MESSAGES),
    (m.ToScheduler, TO_SCHEDULER), (m.FromScheduler, FROM_SCHEDULER),
])
def test_every_message_type_round_trips(union: typing.Any, samples: list[typing.Any]) -> None:
    assert {type(s) for s in samples} == _members(union), "a sample per union member"
    decoder = msgspec.msgpack.Decoder(union)
    for sample in samples:
        assert decoder.decode(msgspec.msgpack.encode(sample)) == sample


def test_per_token_messages_are_compact_arrays() -> None:
    # A delta is [tag, id, text, ids, logprobs]: no field names on the wire.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(m.Delta(7, "a", [1]))) == [
        "delta", 7, "a", [1], []]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(m.TokenDelta("r", [2]))) == [
        "r", [2], None, 0, 0, 0, 0, 0, [], None]
    # Missing trailing fields decode to their defaults (fields can be appended later).
    decoder = msgspec.msgpack.Decoder(m.ServerMessage)
    assert decoder.decode(msgspec.msgpack.encode(["delta", 7])) == m.Delta(7)


def _decode_client(obj: typing.Any) -> m.ClientMessage:
    return msgspec.msgpack.Decoder(m.ClientMessage).decode(msgspec.msgpack.encode(obj))


@pytest.mark.parametrize("bad, fragment", [
    ({"type": "generate", "id": 1, "prompt": "x", "bogus": 1}, "unknown field `bogus`"),
    ({"type": "generate", "id": "1", "prompt": "x"}, "Expected `int`, got `str` - at `$.id`"),
    ({"type": "generate", "id": -1, "prompt": "x"}, "at `$.id`"),
    ({"type": "generate", "id": 1}, "exactly one of prompt"),
    ({"type": "generate", "id": 1, "prompt": "x", "prompt_token_ids": [1]}, "exactly one"),
    ({"type": "generate", "id": 1, "prompt_token_ids": []}, "must not be empty"),
    ({"type": "generate", "id": 1, "prompt_token_ids": [-3]}, "prompt_token_ids[0]"),
    ({"type": "generate", "id": 1, "prompt": "x", "sampling": {"top_p": 0}}, "top_p"),
    ({"type": "generate", "id": 1, "prompt": "x", "sampling": {"temperature": float("nan")}},
     "temperature"),
    ({"type": "generate", "id": 1, "prompt": "x", "deadline_s": 0}, "deadline_s"),
    *[({"type": "generate", "id": 1, "prompt": "x", "sampling": sampling}, fragment)
      for sampling, fragment in [
          ({"repetition_penalty": 0.0}, "repetition_penalty must be finite and > 0"),
          ({"repetition_penalty": -1.0}, "repetition_penalty"),
          ({"repetition_penalty": float("inf")}, "repetition_penalty"),
          ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2]"),
          ({"presence_penalty": -2.01}, "presence_penalty must be in [-2, 2]"),
          ({"presence_penalty": float("nan")}, "presence_penalty"),
          ({"logit_bias": {5: 100.5}}, "logit_bias values must be in [-100, 100]"),
          ({"logit_bias": {5: float("nan")}}, "logit_bias values"),
          ({"logit_bias": {-1: 1.0}}, "logit_bias token ids must be in [0, 2**31 - 1]"),
          ({"logit_bias": {2**31: 1.0}}, "logit_bias token ids"),
          ({"logit_bias": {"5": 1.0}}, "Expected `int`, got `str`"),
          ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, "at most 1024 entries"),
      ]],
    ({"type": "generate", "id": 1, "messages": [
        {"role": "assistant", "content": "x", "reasoning_content": ["not", "text"]}]},
     "at `$.messages[0].reasoning_content`"),
    ({"type": "spec", "id": 1, "mode": "sometimes"}, "$.mode"),
    ({"type": "launch", "id": 1}, "Invalid value 'launch'"),
    ([1, 2, 3], "Expected `object`"),
])
def test_bad_requests_are_rejected_with_the_field_named(bad: typing.Any, fragment: str) -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        _decode_client(bad)
    assert fragment in str(info.value)
