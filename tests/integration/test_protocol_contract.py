"""docs/protocol.md against the real daemon: each case the document states is planted and
what the client sees is checked (stop strings and token counts, partial output on an
error, ids, connection limits, closes with requests open, idle time, drain and stop).
One daemon serves the module; the last test stops it."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from specd.ipc import errors
from specd.ipc import messages as m
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR
from tests.integration.daemon_harness import Daemon, model_under_test

PROMPT = "def fib(n):\n"
IDLE_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 4
REPLY_DECODER = msgspec.msgpack.Decoder(m.ServerMessage)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("protocol")
    d = Daemon(tmp, "--dtype", "float32", "--no-spec-auto-measure",
               "--idle-timeout-s", str(IDLE_TIMEOUT_S),
               "--max-connections", str(MAX_CONNECTIONS)).wait_ready()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(Path(model_under_test() or FIXTURE_DIR))


class Raw:
    """A client written from the document alone: frames of msgpack maps out, arrays in."""

    def __init__(self, daemon: Daemon) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(daemon.socket_path))

    def send(self, *requests: dict[str, Any]) -> None:
        """All `requests` in one write (the daemon reads them back to back)."""
        data = b""
        for request in requests:
            body = msgspec.msgpack.encode(request)
            data += struct.pack(">I", len(body)) + body
        self.sock.sendall(data)

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def receive(self) -> m.ServerMessage | None:
        """The next reply, or None when the daemon closed the connection."""
        header = self._read(4)
        if header is None:
            return None
        body = self._read(struct.unpack(">I", header)[0])
        assert body is not None, "EOF inside a frame"
        return REPLY_DECODER.decode(body)

    def until_end(self, client_id: int) -> list[m.ServerMessage]:
        """Replies up to the final or error of request `client_id` (others included)."""
        replies: list[m.ServerMessage] = []
        while True:
            reply = self.receive()
            assert reply is not None, f"closed before request {client_id} ended: {replies}"
            replies.append(reply)
            if isinstance(reply, (m.Final, m.Error)) and reply.id == client_id:
                return replies

    def close(self) -> None:
        self.sock.close()

    def _read(self, num_bytes: int) -> bytes | None:
        data = b""
        while len(data) < num_bytes:
            chunk = self.sock.recv(num_bytes - len(data))
            if not chunk:
                return None
            data += chunk
        return data


def generate(client_id: int, **options: Any) -> dict[str, Any]:
    sampling = {"max_tokens": options.pop("max_tokens", 16), "ignore_eos": True,
                **options.pop("sampling", {})}
    return {"type": "generate", "id": client_id, "prompt": PROMPT, "sampling": sampling,
            **options}


# ---- output ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_token_ids_and_counts_with_the_text(
        daemon: Daemon, tokenizer: Tokenizer, stream: bool) -> None:
    with daemon.client() as client:
        full = client.generate(PROMPT, max_tokens=32, ignore_eos=True)
        # A stop string that first occurs inside the output, not on its first token.
        text = full.text
        stop = next(text[i:i + 4] for i in range(8, len(text) - 4)
                    if text.find(text[i:i + 4]) == i)
        if stream:
            s = client.stream(PROMPT, max_tokens=32, ignore_eos=True, logprobs=2, stop=(stop,))
            deltas = list(s)
            result = s.result
            assert result is not None
            assert "".join(d.text for d in deltas) == result.text
        else:
            result = client.generate(PROMPT, max_tokens=32, ignore_eos=True, logprobs=2,
                                     stop=(stop,))
    cut = full.text.index(stop)
    assert result.text == full.text[:cut] and result.stop_string == stop
    assert result.finish_reason == "stop"
    # The ids end with the token that completed the stop string: decoded, they hold it;
    # one token fewer does not.
    ids = result.token_ids
    assert ids == full.token_ids[:len(ids)]
    assert tokenizer.decode(ids).startswith(result.text + stop)
    assert stop not in tokenizer.decode(ids[:-1])
    assert result.num_output_tokens == len(ids) == len(result.logprobs)
    assert len(ids) < len(full.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_deadline_exceeded_keeps_the_partial_output(
        daemon: Daemon, tokenizer: Tokenizer, stream: bool) -> None:
    with daemon.client() as client:
        started = time.monotonic()
        full = client.generate(PROMPT, max_tokens=16, ignore_eos=True)
        # Twice what 16 tokens took: tokens by then, however loaded the machine, and far
        # from the model's 2048 (the request's end).
        deadline_s = 2 * (time.monotonic() - started)
        options: dict[str, Any] = {"max_tokens": 100_000, "ignore_eos": True,
                                   "deadline_s": deadline_s}
        with pytest.raises(errors.DeadlineExceeded) as caught:
            if stream:
                list(client.stream(PROMPT, **options))
            else:
                client.generate(PROMPT, **options)
    partial = caught.value.partial
    assert partial is not None and partial.token_ids
    assert len(partial.token_ids) < 2048
    # Greedy: the same tokens as a request that ran to the end, and all their text.
    shared = min(len(partial.token_ids), len(full.token_ids))
    assert partial.token_ids[:shared] == full.token_ids[:shared]
    assert partial.text == tokenizer.decode(partial.token_ids)


def test_logprobs_are_the_raw_distribution_whatever_the_sampling(daemon: Daemon) -> None:
    with daemon.client() as client:
        greedy = client.generate(PROMPT, max_tokens=1, logprobs=3)
        hot = client.generate(PROMPT, max_tokens=1, logprobs=3, temperature=5.0, top_k=2,
                              seed=1, logit_bias={greedy.token_ids[0]: -50.0})
        none = client.generate(PROMPT, max_tokens=1)
    first, other = greedy.logprobs[0], hot.logprobs[0]
    # Before temperature, filters and bias: the same top ids and values for the first
    # token, and the sampled token's own log-probability read from that distribution.
    assert other.top_ids == first.top_ids
    assert other.top_logprobs == pytest.approx(first.top_logprobs, abs=1e-5)
    assert first.logprob == pytest.approx(first.top_logprobs[0], abs=1e-6)
    assert none.logprobs == []  # logprobs 0: none at all


def test_a_request_aborted_before_its_first_token_has_no_acceptance_figure(
        daemon: Daemon) -> None:
    raw = Raw(daemon)
    try:
        raw.send(generate(1, max_tokens=64), {"type": "abort", "id": 2, "target": 1})
        final, ack = raw.receive(), raw.receive()
    finally:
        raw.close()
    assert isinstance(final, m.Final) and final.finish_reason == "abort"
    assert final.num_output_tokens == 0 and final.token_ids == []
    assert final.acceptance_length == 0.0
    assert isinstance(ack, m.Ack) and ack.id == 2


# ---- tokenize, status ---------------------------------------------------------------------


def test_tokenize_gives_the_prompt_ids_a_generate_has(daemon: Daemon,
                                                      tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Write a loop"}]
    with daemon.client() as client:
        by_prompt = client.tokenize(PROMPT)
        by_messages = client.tokenize(messages=messages)
        by_text = client.generate(PROMPT, max_tokens=4)
        by_ids = client.generate(prompt_token_ids=by_prompt, max_tokens=4)
        by_chat = client.generate(messages=messages, max_tokens=1)
    assert by_prompt == tokenizer.encode(PROMPT)  # the tokenizer's own rule for BOS
    assert by_messages == tokenizer.encode(tokenizer.apply_chat_template(messages),
                                           add_special_tokens=False)
    assert by_text.num_prompt_tokens == len(by_prompt)
    assert by_chat.num_prompt_tokens == len(by_messages)
    assert by_ids.token_ids == by_text.token_ids


def test_a_tokenize_with_a_bad_template_variable_is_a_bad_request(daemon: Daemon) -> None:
    raw = Raw(daemon)
    try:
        raw.send({"type": "tokenize", "id": 5, "prompt": "x", "tools": []})
        reply = raw.receive()
    finally:
        raw.close()
    assert isinstance(reply, m.Error) and (reply.id, reply.code) == (5, "bad_request")


def test_status_shows_the_vocabulary_and_the_live_speculation_threshold(
        daemon: Daemon) -> None:
    model = Path(model_under_test() or FIXTURE_DIR)
    vocab_size = msgspec.json.decode((model / "config.json").read_bytes())["vocab_size"]
    with daemon.client() as client:
        before = client.status()
        configured = before.config["engine"]["spec_disable_batch_threshold"]
        assert before.engine["vocab_size"] == vocab_size
        assert before.engine["spec_threshold"] == configured
        client.set_spec("auto", configured + 5)
        try:
            after = client.status().engine
            assert after["spec_threshold"] == configured + 5
            assert client.stats()["engine"]["spec_threshold"] == configured + 5
        finally:
            client.set_spec(before.engine["spec_mode"], configured)
    assert after["spec_resume_at"] == (configured + 5) * 3 // 4  # the default resume mark


# ---- ids -------------------------------------------------------------------------------


def test_any_request_with_the_id_of_a_generate_in_flight_is_a_duplicate(
        daemon: Daemon) -> None:
    raw = Raw(daemon)
    try:
        raw.send(generate(16, max_tokens=12), {"type": "abort", "id": 16, "target": 16},
                 {"type": "status", "id": 16}, generate(16))
        replies = raw.until_end(16)
        while not (isinstance(replies[-1], m.Final) and replies[-1].id == 16):
            replies += raw.until_end(16)
    finally:
        raw.close()
    refusals = [r for r in replies if isinstance(r, m.Error)]
    assert [(r.id, r.code) for r in refusals] == [(16, "duplicate_id")] * 3
    final = replies[-1]
    assert isinstance(final, m.Final) and final.finish_reason == "length"
    assert final.num_output_tokens == 12
    assert not [r for r in replies if isinstance(r, (m.Ack, m.StatusReply))]


@pytest.mark.parametrize(("request_id", "echoed"), [
    (-1, None), (2**63, None), (2**64 - 1, None), ("7", None), (None, None), (7, 7)])
def test_an_invalid_request_echoes_only_an_id_it_could_carry(
        daemon: Daemon, request_id: object, echoed: int | None) -> None:
    raw = Raw(daemon)
    try:
        raw.send({"type": "generate", "id": request_id, "prompt": "x", "stream": "yes"})
        reply = raw.receive()
        raw.send({"type": "status", "id": 8})  # the connection lives on
        status = raw.receive()
    finally:
        raw.close()
    assert isinstance(reply, m.Error) and reply.code == "bad_request"
    assert reply.id == echoed
    assert isinstance(status, m.StatusReply) and status.id == 8


# ---- connections -----------------------------------------------------------------------


def test_a_bad_frame_ends_each_open_generate_with_its_own_error_then_closes(
        daemon: Daemon) -> None:
    raw = Raw(daemon)
    try:
        raw.send(generate(1, max_tokens=100_000), generate(2, max_tokens=100_000))
        first = raw.receive()
        assert isinstance(first, m.Delta)
        raw.send_bytes(struct.pack(">I", 0))  # a zero length: the stream is out of sync
        replies = []
        while (reply := raw.receive()) is not None:
            replies.append(reply)
    finally:
        raw.close()
    errors_seen = [(r.id, r.code) for r in replies if isinstance(r, m.Error)]
    assert errors_seen[0] == (None, "bad_frame")
    assert sorted(errors_seen[1:]) == [(1, "bad_frame"), (2, "bad_frame")]
    assert not [r for r in replies if isinstance(r, m.Final)]


def test_too_many_connections_are_refused_overloaded_and_closed(daemon: Daemon) -> None:
    time.sleep(0.3)  # the connections of earlier tests are gone from the daemon's count
    held = [Raw(daemon) for _ in range(MAX_CONNECTIONS)]
    try:
        for raw in held:  # each is admitted (the front answers it) before the next one
            raw.send({"type": "tokenize", "id": 1, "prompt": "x"})
            assert isinstance(raw.receive(), m.Tokens)
        extra = Raw(daemon)
        reply = extra.receive()
        assert isinstance(reply, m.Error) and (reply.id, reply.code) == (None, "overloaded")
        assert extra.receive() is None
        extra.close()
    finally:
        for raw in held:
            raw.close()
        time.sleep(0.5)  # the daemon sees them close before the next test connects


def test_the_idle_timeout_never_cuts_a_client_waiting_on_its_request(daemon: Daemon) -> None:
    raw = Raw(daemon)
    try:
        started = time.monotonic()
        # Not streamed: nothing moves on the connection until the request ends (its
        # deadline, 2.5 idle timeouts later; the fixture's 2048 tokens take longer).
        raw.send(generate(1, max_tokens=100_000, deadline_s=2.5 * IDLE_TIMEOUT_S,
                          stream=False))
        replies = raw.until_end(1)
        waited = time.monotonic() - started
        assert waited >= 2.5 * IDLE_TIMEOUT_S
        assert [type(r) for r in replies[:-1]] in ([], [m.Delta])  # the partial output
        end = replies[-1]
        assert isinstance(end, m.Error) and (end.id, end.code) == (1, "deadline_exceeded")
        # With nothing open, the same connection is closed after the idle timeout.
        reply = raw.receive()
        assert isinstance(reply, m.Error) and reply.id is None and "idle" in reply.message
        assert raw.receive() is None
    finally:
        raw.close()


# ---- last: drain and stop (the daemon exits) --------------------------------------------


def test_during_a_drain_new_connections_take_operator_commands_and_stop_ends_it_at_once(
        daemon: Daemon) -> None:
    streaming = Raw(daemon)
    streaming.send(generate(1, max_tokens=100_000))
    assert isinstance(streaming.receive(), m.Delta)
    operator = Raw(daemon)  # now: it must not sit idle for the idle timeout
    operator.send({"type": "drain", "id": 1, "timeout_s": 600})
    assert isinstance(operator.receive(), m.Ack)
    with pytest.raises(errors.ShuttingDown), daemon.client() as client:
        client.generate("x", max_tokens=2)
    # A connection made during the drain: generates are refused, operator commands are not.
    late = Raw(daemon)
    late.send(generate(1, max_tokens=2))
    reply = late.receive()
    assert isinstance(reply, m.Error) and (reply.id, reply.code) == (1, "shutting_down")
    late.send({"type": "status", "id": 2})
    status = late.receive()
    assert isinstance(status, m.StatusReply) and status.state == "draining"
    late.send({"type": "drain", "id": 3, "timeout_s": 600})  # a second drain: accepted
    assert isinstance(late.receive(), m.Ack)
    stopped_at = time.monotonic()
    late.send({"type": "stop", "id": 4})
    assert isinstance(late.receive(), m.Ack)
    replies = streaming.until_end(1)
    assert time.monotonic() - stopped_at < 5.0, "a stop does not wait for the drain"
    assert isinstance(replies[-1], m.Error) and replies[-1].code == "drained"
    assert daemon.wait() == 0
