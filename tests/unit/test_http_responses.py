"""The flow's frames as OpenAI objects (daemon/http/responses.py), the peer that collects
them (daemon/http/peer.py) and the error object (daemon/http/errors.py)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest

from specd.daemon.http.errors import STATUS_OF_CODE, HttpError
from specd.daemon.http.params import Options
from specd.daemon.http.peer import HttpPeer
from specd.daemon.http.responses import DONE, Answer
from specd.daemon.parsers.registry import AnswerParser
from specd.ipc import messages as m
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR

TOKENIZER = Tokenizer.from_dir(FIXTURE_DIR)
IDS = TOKENIZER.encode("def add(a, b):", add_special_tokens=False)
FINAL = m.Final(0, "length", num_prompt_tokens=5, num_output_tokens=3, text="tail",
                num_cached_tokens=2, num_drafted=4, num_accepted=1, acceptance_length=1.5)


def events(data: bytes) -> list[Any]:
    """The payloads of a server-sent event stream, [DONE] as the string."""
    assert data.endswith(b"\n\n")
    out = []
    for event in data.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: ")
        payload = event[len(b"data: "):]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def test_usage_counts_cached_tokens_and_speculation() -> None:
    body = Answer(Options(False, False, False, None), "fixture", TOKENIZER).whole(FINAL)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "tail", "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
        "speculation": {"drafted_tokens": 4, "accepted_tokens": 1, "acceptance_length": 1.5}}


def test_chat_stream_chunks() -> None:
    answer = Answer(Options(True, True, True, None), "fixture", TOKENIZER)
    first = events(answer.delta_event(m.Delta(0, "Hello", [5])))
    assert first[0]["object"] == "chat.completion.chunk"
    assert first[0]["choices"] == [{"index": 0, "delta": {"role": "assistant",
                                                           "content": "Hello"},
                                    "logprobs": None, "finish_reason": None}]
    assert first[0]["usage"] is None  # include_usage: null on every chunk but the last
    assert answer.delta_event(m.Delta(0, "", [6])) == b""  # text lagging its tokens
    more = events(answer.delta_event(m.Delta(0, " world", [7])))
    assert more[0]["choices"][0]["delta"] == {"content": " world"}
    last = events(answer.final_events(FINAL))
    assert last[0]["choices"][0]["delta"] == {"content": "tail"}
    assert last[0]["choices"][0]["finish_reason"] == "length"
    assert last[1]["choices"] == [] and last[1]["usage"]["completion_tokens"] == 3
    assert last[2] == "[DONE]"
    assert {e["id"] for e in first + more + last[:2]} == {answer.id}


def test_completion_stream_without_usage() -> None:
    answer = Answer(Options(False, True, False, None), "fixture", TOKENIZER)
    chunk = events(answer.delta_event(m.Delta(0, "x", [5])))[0]
    assert "usage" not in chunk and chunk["choices"][0]["text"] == "x"
    last = answer.final_events(m.Final(0, "stop", 1, 1))
    assert last.endswith(DONE) and len(events(last)) == 2


def logprob(token_id: int) -> m.Logprob:
    return m.Logprob(-0.5, [token_id, token_id + 1, token_id + 2], [-0.5, -1.0, -2.0])


def test_completion_logprobs() -> None:
    answer = Answer(Options(False, True, False, 2), "fixture", TOKENIZER)
    tokens = [TOKENIZER.decode([t], skip_special_tokens=False) for t in IDS]
    first = events(answer.delta_event(m.Delta(0, "", IDS[:2], [logprob(IDS[0]),
                                                               logprob(IDS[1])])))
    second = events(answer.delta_event(m.Delta(0, "", IDS[2:3], [logprob(IDS[2])])))
    lp = first[0]["choices"][0]["logprobs"]
    assert lp["tokens"] == tokens[:2] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["top_logprobs"][0] == {tokens[0]: -0.5, TOKENIZER.decode([IDS[0] + 1]): -1.0}
    assert lp["text_offset"] == [0, len(tokens[0])]
    # offsets continue across chunks
    assert second[0]["choices"][0]["logprobs"]["text_offset"] == [len(tokens[0] + tokens[1])]


def test_chat_logprobs_whole() -> None:
    answer = Answer(Options(True, False, False, 1), "fixture", TOKENIZER)
    final = m.Final(0, "length", 5, 1, text="def", token_ids=IDS[:1],
                    logprobs=[logprob(IDS[0])])
    body = answer.whole(final)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "def",
                                             "refusal": None}
    content = body["choices"][0]["logprobs"]["content"]
    token = TOKENIZER.decode([IDS[0]], skip_special_tokens=False)
    assert content == [{"token": token, "logprob": -0.5, "bytes": list(token.encode()),
                        "top_logprobs": [{"token": token, "logprob": -0.5,
                                          "bytes": list(token.encode())}]}]


@pytest.mark.parametrize("code", sorted(m.ERROR_CODES))
def test_every_error_code_has_a_status(code: str) -> None:
    error = HttpError.from_specd(code, "why")
    assert error.status == STATUS_OF_CODE.get(code, 500)
    body = error.body()["error"]
    assert body["code"] == code and body["message"] == "why"
    assert ("Retry-After" in error.headers) == (error.status == 429)


def test_overloaded_is_429_and_draining_503() -> None:
    assert HttpError.from_specd("overloaded", "").status == 429
    assert HttpError.from_specd("shutting_down", "").status == 503
    assert HttpError(400, "", "bad_request", "n").body()["error"] == {
        "message": "", "type": "invalid_request_error", "param": "n", "code": "bad_request"}
    assert HttpError.from_specd("overloaded", "").is_counted  # the flow counted it


def test_peer_batches_frames_and_counts_rejections() -> None:
    counters: Counter[str] = Counter()

    async def run() -> list[list[m.ServerMessage]]:
        peer = HttpPeer(7, counters)
        waiting = asyncio.create_task(peer.receive())
        await asyncio.sleep(0)
        peer.send(m.Delta(0, "a"))
        peer.send(m.Delta(0, "b"))
        first = await waiting
        peer.reject(0, "overloaded", "full")
        return [first, await peer.receive()]

    first, second = asyncio.run(run())
    assert first == [m.Delta(0, "a"), m.Delta(0, "b")]
    assert second == [m.Error(0, "overloaded", "full")]
    assert counters == {"error_overloaded": 1}


def hermes_parser() -> AnswerParser:
    numbers = iter(range(100))
    return AnswerParser.build("deepseek_r1", False, "hermes", lambda: f"call_{next(numbers)}")


CALL_OUTPUT = ('<think>Need the weather.</think>Checking.<tool_call>\n{"name": "get_weather", '
               '"arguments": {"city": "Paris"}}\n</tool_call>')


def test_tool_calls_streamed_as_openai_sends_them() -> None:
    answer = Answer(Options(True, True, False, None, parse_tools=True), "fixture", TOKENIZER,
                    hermes_parser)
    chunks: list[Any] = []
    for piece in (CALL_OUTPUT[:30], CALL_OUTPUT[30:70], CALL_OUTPUT[70:]):
        chunks += events(answer.delta_event(m.Delta(0, piece, [1]))) if piece else []
    chunks += events(answer.final_events(m.Final(0, "stop", 4, 9)))
    assert chunks[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "reasoning_content": "Need the weather."}
    assert {"content": "Checking."} in deltas
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {"index": 0, "id": "call_0", "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert all(set(c) == {"index", "function"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_calls_whole_equal_the_streamed_ones() -> None:
    answer = Answer(Options(True, False, False, None, parse_tools=True), "fixture", TOKENIZER,
                    hermes_parser)
    answer.add(m.Delta(0, CALL_OUTPUT[:50], [1]))
    body = answer.whole(m.Final(0, "stop", 4, 9, text=CALL_OUTPUT[50:]))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant", "content": "Checking.", "refusal": None,
        "reasoning_content": "Need the weather.",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    # Cut off by the token limit, a call keeps finish_reason "length".
    answer = Answer(Options(True, False, False, None, parse_tools=True), "fixture", TOKENIZER,
                    hermes_parser)
    assert answer.whole(m.Final(0, "length", 4, 9, text=CALL_OUTPUT[:-20]))[
        "choices"][0]["finish_reason"] == "length"


def test_n_choices_share_one_stream_and_one_usage() -> None:
    answer = Answer(Options(True, True, True, None, num_choices=2, continuous_usage=True),
                    "fixture", TOKENIZER)
    assert answer.prompt_event(m.Prompt(0, 5)) == b"" == answer.prompt_event(m.Prompt(1, 5))
    first = events(answer.delta_event(m.Delta(1, "b", [7])))
    assert first[0]["choices"][0]["index"] == 1
    assert first[0]["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    zero = events(answer.final_events(m.Final(0, "stop", 5, 2, text="aa", num_cached_tokens=0)))
    assert zero[-1] != "[DONE]" and zero[0]["choices"][0]["index"] == 0
    last = events(answer.final_events(m.Final(1, "length", 5, 3, text="bb",
                                              num_cached_tokens=4)))
    assert last[-1] == "[DONE]" and last[-2]["choices"] == []
    assert last[-2]["usage"]["completion_tokens"] == 5 and last[-2]["usage"]["prompt_tokens"] == 5
    assert last[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def test_echo_puts_the_prompt_and_its_logprobs_first() -> None:
    prompt_ids = IDS[:3]
    prompt_text = TOKENIZER.decode(prompt_ids)
    answer = Answer(Options(False, False, False, 1, echo=True), "fixture", TOKENIZER,
                    echo_text=prompt_text)
    answer.add(m.Prompt(0, 3, prompt_ids, [logprob(prompt_ids[1]), logprob(prompt_ids[2])]))
    body = answer.whole(m.Final(0, "length", 3, 1, text=" x", token_ids=[IDS[3]],
                                logprobs=[logprob(IDS[3])]))
    choice = body["choices"][0]
    assert choice["text"] == prompt_text + " x"
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == [None, -0.5, -0.5, -0.5]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) == 1
    assert lp["tokens"] == [TOKENIZER.decode([t], skip_special_tokens=False)
                            for t in IDS[:4]]
    assert lp["text_offset"][0] == 0


def test_the_stop_string_stays_when_asked() -> None:
    answer = Answer(Options(False, False, False, None, include_stop_str=True), "fixture",
                    TOKENIZER)
    body = answer.whole(m.Final(0, "stop", 3, 2, text="ab", stop_string="\n\n"))
    assert body["choices"][0]["text"] == "ab\n\n"
