"""How the front decodes a client request (docs/protocol.md, "Requests"): nil for any key of
a request or of its `sampling` map means the default, as if the key were absent; an integer
is accepted where a float is expected (encoders that have one number type write 1.0 as 1);
nothing else is coerced. The `tokenize` request and its `tokens` reply."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from specd.ipc import messages as m
from specd.ipc.framing import FrameCodec
from specd.ipc.sampling import SamplingParams

FRONT = FrameCodec(m.ClientMessage, nil_is_default=True)  # as the front decodes requests
BASE: dict[str, Any] = {"type": "generate", "id": 3, "prompt": "def f():"}


def decode(request: dict[str, Any]) -> m.ClientMessage:
    return FRONT.decode(msgspec.msgpack.encode(request))


def optional_keys(struct: type[msgspec.Struct]) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(struct)
            if f.required is False and f.name != "id"]


@pytest.mark.parametrize("key", [k for k in optional_keys(m.Generate) if k != "prompt"])
def test_nil_for_an_optional_generate_key_is_its_default(key: str) -> None:
    assert decode({**BASE, key: None}) == decode(BASE)


@pytest.mark.parametrize("key", optional_keys(SamplingParams))
def test_nil_for_a_sampling_key_is_its_default(key: str) -> None:
    with_nil = decode({**BASE, "sampling": {"max_tokens": 5, key: None}})
    assert isinstance(with_nil, m.Generate)
    want = SamplingParams(max_tokens=5) if key != "max_tokens" else SamplingParams()
    assert with_nil.sampling == want


@pytest.mark.parametrize(("request_", "key"), [
    ({"type": "drain", "id": 1, "timeout_s": None}, "timeout_s"),
    ({"type": "spec", "id": 1, "mode": "auto", "threshold": None}, "threshold"),
])
def test_nil_is_the_default_for_control_requests_too(request_: dict[str, Any], key: str) -> None:
    decoded = decode(request_)
    assert getattr(decoded, key) is None  # their default
    assert decoded == decode({k: v for k, v in request_.items() if k != key})


@pytest.mark.parametrize("request_", [
    {**BASE, "id": None},  # a required key: nil is no id
    {"type": "abort", "id": 1, "target": None},
    {"type": "spec", "id": 1, "mode": None},
    {**BASE, "sampling": {"stop": [None]}},  # nil inside an array is a value, and wrong
    {**BASE, "sampling": {"logit_bias": {5: None}}},
])
def test_nil_for_a_required_key_or_inside_a_value_is_refused(request_: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(request_)


def test_nil_content_of_a_chat_message_keeps_its_meaning() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                      "tool_calls": [{"id": "c1"}]}]
    decoded = decode({"type": "generate", "id": 1, "messages": messages, "prompt": None})
    assert isinstance(decoded, m.Generate) and decoded.messages is not None
    assert decoded.messages[1].content is None


@pytest.mark.parametrize("nil_in_body", [False, True])
def test_an_integer_is_accepted_for_a_float_and_nothing_else_is_coerced(
        nil_in_body: bool) -> None:
    extra = {"seed": None} if nil_in_body else {}  # the slow path (nil present) as well
    decoded = decode({**BASE, "deadline_s": 5,
                      "sampling": {"temperature": 1, "top_p": 1, **extra}})
    assert isinstance(decoded, m.Generate)
    assert decoded.deadline_s == 5.0 and isinstance(decoded.deadline_s, float)
    assert decoded.sampling.temperature == 1.0 and isinstance(decoded.sampling.temperature,
                                                               float)
    for wrong in ({"deadline_s": "5"}, {"stream": 1}, {"sampling": {"max_tokens": 2.0}},
                  {"sampling": {"max_tokens": True}}, {"sampling": {"ignore_eos": 0}},
                  {"id": 3.0}):
        with pytest.raises(msgspec.ValidationError):
            decode({**BASE, **extra, **wrong})


def test_without_nil_is_default_a_codec_refuses_nil_for_a_non_optional_key() -> None:
    strict: FrameCodec[m.ClientMessage] = FrameCodec(m.ClientMessage)
    with pytest.raises(msgspec.ValidationError):
        strict.decode(msgspec.msgpack.encode({**BASE, "stream": None}))


def test_tokenize_takes_exactly_one_of_prompt_or_messages() -> None:
    by_prompt = decode({"type": "tokenize", "id": 4, "prompt": "x"})
    assert by_prompt == m.Tokenize(4, prompt="x")
    messages = [{"role": "user", "content": "x"}]
    by_messages = decode({"type": "tokenize", "id": 4, "messages": messages,
                          "chat_template_kwargs": {"add_generation_prompt": False}})
    assert isinstance(by_messages, m.Tokenize) and by_messages.messages is not None
    for wrong in ({"type": "tokenize", "id": 4},
                  {"type": "tokenize", "id": 4, "prompt": "x", "messages": messages},
                  {"type": "tokenize", "id": 4, "prompt": "x", "tools": []},
                  {"type": "tokenize", "id": 4, "messages": messages,
                   "chat_template_kwargs": {"messages": []}},
                  {"type": "tokenize", "id": 4, "prompt_token_ids": [1]}):
        with pytest.raises(msgspec.ValidationError):
            decode(wrong)


def test_the_tokens_reply_round_trips_as_an_array() -> None:
    codec: FrameCodec[m.ServerMessage] = FrameCodec(m.ServerMessage)
    frame = codec.encode(m.Tokens(9, [1, 2, 3]))
    assert msgspec.msgpack.decode(frame[4:]) == ["tokens", 9, [1, 2, 3]]
    assert codec.decode(frame[4:]) == m.Tokens(9, [1, 2, 3])
