"""The real daemon (front + scheduler processes) on the fixture model, driven through the
client library, raw sockets and the CLI. One daemon serves every test in this file."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from specd.client import AsyncClient
from specd.daemon.memory import resident_bytes
from specd.ipc import errors
from specd.ipc import messages as m
from specd.ipc.sampling import SamplingParams
from tests.integration.daemon_harness import Daemon, model_under_test

PROMPTS = ["def fib(n):\n", "import os\nimport sys\n", "class Point:\n    def __init__(",
           "# Sort a list\n", "for i in range(10):\n", "x = [", "return ", "if __name__"]
NEW_TOKENS = 12


NOBODY = 65534


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("daemon")
    # The socket where user nobody can reach it (see as_a_non_operator).
    socket_dir = Path(tempfile.mkdtemp(prefix="specd-test-"))
    socket_dir.chmod(0o755)
    # float32: the daemon batches requests as they arrive, the in-process engine all at
    # once; in bfloat16 a batch of another shape may round a near-tie the other way. No
    # measured auto: its mode choices follow timings, and a seeded sampled request draws
    # its randomness differently in a speculative step. The operator is another user.
    d = Daemon(tmp, "--dtype", "float32", "--no-spec-auto-measure",
               "--max-pending-requests", "8", "--frame-timeout-s", "1",
               "--write-buffer-bytes", "262144", "--socket-mode", "666",
               "--operator-uid", str(os.geteuid() + 1),
               socket_path=socket_dir / "specd.sock").wait_ready()
    yield d
    d.stop()
    shutil.rmtree(socket_dir)


@pytest.fixture(scope="module")
def engine() -> object:
    import specd

    return specd.Engine(model=model_under_test(), dtype="float32", spec_auto_measure=False)


def test_front_never_imports_torch() -> None:
    code = ("import sys, specd.daemon.main, specd.daemon.front, specd.daemon.ctl.cli, "
            "specd.client; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_concurrent_streams_match_the_in_process_engine(daemon: Daemon, engine: object) -> None:
    greedy = SamplingParams(max_tokens=NEW_TOKENS)
    seeded = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=7)
    params = [greedy] * (len(PROMPTS) - 1) + [seeded]
    expected = engine.generate(PROMPTS, params)  # type: ignore[attr-defined]

    async def run() -> list[tuple[str, list[int], str]]:
        shared = AsyncClient(daemon.socket_path)
        await shared.open()

        async def one(i: int) -> tuple[str, list[int], str]:
            own = i % 2 == 1  # half share one connection, half have their own
            client = AsyncClient(daemon.socket_path) if own else shared
            if own:
                await client.open()
            texts, ids = [], []
            async for delta in client.stream(PROMPTS[i], sampling=params[i]):
                texts.append(delta.text)
                ids.extend(delta.token_ids)
            if own:
                await client.close()
            return "".join(texts), ids, ""

        try:
            return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        finally:
            await shared.close()

    results = asyncio.run(run())
    for i, ((text, ids, _), want) in enumerate(zip(results, expected, strict=True)):
        assert ids == want.token_ids, f"request {i}"
        assert text == want.text


def test_generate_with_chat_messages_and_token_ids(daemon: Daemon, engine: object) -> None:
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    messages = [{"role": "user", "content": "Write a loop"}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    want = engine.generate([prompt_ids], SamplingParams(max_tokens=8))[0]  # type: ignore
    with daemon.client() as client:
        by_messages = client.generate(messages=messages, max_tokens=8)
        by_ids = client.generate(prompt_token_ids=prompt_ids, max_tokens=8)
    for result in (by_messages, by_ids):
        assert result.token_ids == want.token_ids
        assert result.text == want.text
        assert result.num_prompt_tokens == len(prompt_ids)
        assert result.finish_reason == want.finish_reason


def test_stop_string_is_cut_exactly(daemon: Daemon) -> None:
    with daemon.client() as client:
        full = client.generate(PROMPTS[0], max_tokens=24, ignore_eos=True).text
        stop = full[6:9]
        assert len(stop) == 3 and stop not in full[:6 + 2]
        cut = client.generate(PROMPTS[0], max_tokens=24, ignore_eos=True, stop=(stop,))
        streamed = "".join(d.text for d in client.stream(PROMPTS[0], max_tokens=24,
                                                         ignore_eos=True, stop=(stop,)))
    index = full.index(stop)
    assert cut.text == streamed == full[:index]
    assert cut.finish_reason == "stop" and cut.stop_string == stop


# ---- bad input ---------------------------------------------------------------------------


def _raw(daemon: Daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(daemon.socket_path))
    return sock


def _frame(obj: object) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(body)) + body


def _read_reply(sock: socket.socket) -> m.ServerMessage | None:
    """The next frame, or None when the daemon closed the connection."""
    from specd.ipc.framing import ConnectionClosed, recv_body

    try:
        body = recv_body(sock, 2**20)
    except ConnectionClosed:
        return None
    return msgspec.msgpack.decode(body, type=m.ServerMessage)


def _assert_serves(daemon: Daemon) -> None:
    with daemon.client(timeout=30) as client:
        assert client.generate(prompt_token_ids=[5, 6, 7], max_tokens=2).num_output_tokens == 2


@pytest.mark.parametrize("payload, closes", [
    (b"\x00\x00\x00\x04\xc1\xc1\xc1\xc1", False),  # garbage msgpack inside a valid frame
    (b"\xff\xff\xff\xff", True),  # length over the cap
    (b"\x00\x00\x00\x00", True),  # zero length
    (struct.pack(">I", 10) + b"abc", True),  # truncated frame, then EOF
])
def test_garbage_and_bad_frames(daemon: Daemon, payload: bytes, closes: bool) -> None:
    with _raw(daemon) as sock:
        sock.sendall(payload)
        if closes and payload.startswith(struct.pack(">I", 10)):
            sock.shutdown(socket.SHUT_WR)
        reply = _read_reply(sock)
        assert isinstance(reply, m.Error)
        assert reply.code == ("bad_frame" if closes else "bad_request")
        if closes:
            assert _read_reply(sock) is None
    _assert_serves(daemon)


@pytest.mark.parametrize("request_obj, fragment", [
    ({"type": "generate", "id": 3, "prompt": 12}, "Expected `str | null`, got `int`"),
    ({"type": "generate", "id": 3, "prompt": "x", "colour": "red"}, "unknown field `colour`"),
    ({"type": "generate", "id": 3, "prompt": "x", "sampling": {"top_p": 1.5}}, "top_p"),
    ({"type": "generate", "id": 3, "prompt": "x", "sampling": {"max_tokens": 0}}, "max_tokens"),
    ({"type": "generate", "id": 3, "prompt": "x", "sampling": {"temperature": "hot"}},
     "Expected `float`"),
    ({"type": "teleport", "id": 3}, "Invalid value 'teleport'"),
])
def test_invalid_requests_get_bad_request_and_keep_the_connection(
        daemon: Daemon, request_obj: dict[str, object], fragment: str) -> None:
    with _raw(daemon) as sock:
        sock.sendall(_frame(request_obj))
        reply = _read_reply(sock)
        assert isinstance(reply, m.Error) and reply.code == "bad_request"
        assert reply.id == 3 and fragment in reply.message
        sock.sendall(_frame({"type": "status", "id": 4}))
        status = _read_reply(sock)
        assert isinstance(status, m.StatusReply) and status.id == 4


def test_prompt_longer_than_the_model_allows(daemon: Daemon) -> None:
    with daemon.client() as client:
        max_model_len = int(client.status().resolved["max_model_len"])
        with pytest.raises(errors.PromptTooLong, match="at most"):
            client.generate(prompt_token_ids=[5] * max_model_len, max_tokens=1)
    _assert_serves(daemon)


def test_half_a_frame_then_silence_times_out(daemon: Daemon) -> None:
    with _raw(daemon) as sock:
        sock.sendall(_frame({"type": "status", "id": 1})[:6])
        started = time.monotonic()
        reply = _read_reply(sock)
        assert isinstance(reply, m.Error) and reply.code == "bad_frame"
        assert "not complete within 1 s" in reply.message
        assert time.monotonic() - started < 5
        assert _read_reply(sock) is None
    _assert_serves(daemon)


def test_a_client_that_stops_reading_is_cut_off_and_costs_nobody(daemon: Daemon) -> None:
    with _raw(daemon) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        for i in range(400):  # ~10 KB status replies that are never read
            sock.sendall(_frame({"type": "status", "id": i}))
        deadline = time.monotonic() + 10
        while not daemon.events("slow_reader") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert daemon.events("slow_reader")
        _assert_serves(daemon)
    assert _front_counters(daemon)["error_slow_reader"] >= 1


def _front_counters(daemon: Daemon) -> dict[str, int]:
    with daemon.client() as client:
        return client.stats()["front"]


def _deeply_nested_generate(depth: int) -> bytes:
    """A generate map whose first value nests `depth` arrays, before its `type` tag."""
    deep = b"\x91" * depth + b"\xc0"
    body = (b"\x83" + msgspec.msgpack.encode("prompt") + deep + msgspec.msgpack.encode("id")
            + b"\x01" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("generate"))
    return struct.pack(">I", len(body)) + body


def test_a_deeply_nested_frame_is_a_bad_request_on_a_connection_that_lives_on(
        daemon: Daemon) -> None:
    with _raw(daemon) as sock:
        sock.sendall(_deeply_nested_generate(50_000))
        reply = _read_reply(sock)
        assert isinstance(reply, m.Error) and reply.code == "bad_request"
        assert "nested too deeply" in reply.message
        sock.sendall(_frame({"type": "status", "id": 4}))
        assert isinstance(_read_reply(sock), m.StatusReply)
    assert not daemon.events("internal_error")


def test_every_rejected_frame_is_counted_in_stats(daemon: Daemon) -> None:
    before = _front_counters(daemon)
    bad = [_frame({"type": "generate", "id": 1, "prompt": 12}), _frame({"type": "x", "id": 1}),
           b"\x00\x00\x00\x02\xc1\xc1", _deeply_nested_generate(3_000)] * 25
    with _raw(daemon) as sock:
        sock.sendall(b"".join(bad))
        for _ in bad:
            reply = _read_reply(sock)
            assert isinstance(reply, m.Error) and reply.code == "bad_request"
        sock.sendall(_frame({"type": "abort", "id": 2, "target": 77}))
        assert isinstance(_read_reply(sock), m.Error)
        sock.sendall(b"\x00\x00\x00\x00")
        assert isinstance(_read_reply(sock), m.Error) and _read_reply(sock) is None
    after = _front_counters(daemon)
    for code, count in (("bad_request", len(bad)), ("not_found", 1), ("bad_frame", 1)):
        key = f"error_{code}"
        assert after.get(key, 0) - before.get(key, 0) == count, key


def test_a_huge_prompt_is_refused_without_tokenizing_and_keeps_no_memory(
        daemon: Daemon) -> None:
    prompt = (PROMPTS[0] * 400_000)[:3_900_000]
    with daemon.client() as client:
        client.generate(prompt=PROMPTS[0], max_tokens=1)  # the front's buffers at their size
        before = resident_bytes(daemon.process.pid)
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(errors.PromptTooLong, match="without tokenizing"):
                client.generate(prompt, max_tokens=1)
            assert time.monotonic() - started < 2.0  # tokenizing it took seconds
    # Tokenizing 3.9 MB took the front from 46 MB to 428 MB, for good.
    assert resident_bytes(daemon.process.pid) - before < 64 * 2**20
    _assert_serves(daemon)


def test_a_long_prompt_is_tokenized_off_the_event_loop(daemon: Daemon) -> None:
    with daemon.client() as client:
        max_model_len = int(client.status().resolved["max_model_len"])
    prompt = (PROMPTS[1] * 20_000)[:max_model_len * 60]  # under the byte bound, too many tokens
    with _raw(daemon) as sock:
        sock.sendall(_frame({"type": "generate", "id": 1, "prompt": prompt})
                     + _frame({"type": "abort", "id": 2, "target": 99}))
        # The abort, read after the generate, is answered while the prompt is tokenized.
        first, second = _read_reply(sock), _read_reply(sock)
        assert isinstance(first, m.Error) and (first.id, first.code) == (2, "not_found")
        assert isinstance(second, m.Error) and (second.id, second.code) == (1, "prompt_too_long")
        assert "tokens" in second.message


def as_a_non_operator(action: Callable[[], Any]) -> Any:
    """`action()`'s result, run by a user who is not an operator: as root (always an
    operator), in a child process that dropped to user nobody; otherwise here (the test
    daemon's operator is another uid)."""
    if os.geteuid() != 0:
        return action()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the result or the traceback, then leave at once
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            outcome = {"result": action()}
        except BaseException:  # noqa: BLE001 - handed to the parent, which fails the test
            outcome = {"error": traceback.format_exc()}
        os.write(write_end, json.dumps(outcome).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        outcome = json.loads(pipe.read() or b'{"error": "the child died"}')
    os.waitpid(pid, 0)
    assert "error" not in outcome, outcome["error"]
    return outcome["result"]


def test_control_requests_need_an_operator(daemon: Daemon) -> None:
    def try_control() -> list[list[Any]]:
        with _raw(daemon) as sock:
            replies = []
            for request in ({"type": "drain", "id": 1}, {"type": "stop", "id": 2},
                            {"type": "spec", "id": 3, "mode": "off"}, {"type": "status", "id": 4}):
                sock.sendall(_frame(request))
                reply = _read_reply(sock)
                assert reply is not None
                replies.append([type(reply).__name__, reply.id,
                                getattr(reply, "code", None), getattr(reply, "message", "")])
            return replies

    before = _front_counters(daemon).get("error_forbidden", 0)
    replies = as_a_non_operator(try_control)
    assert [r[:3] for r in replies] == [["Error", 1, "forbidden"], ["Error", 2, "forbidden"],
                                        ["Error", 3, "forbidden"], ["StatusReply", 4, None]]
    assert "for an operator" in replies[0][3]
    assert _front_counters(daemon)["error_forbidden"] - before == 3
    _assert_serves(daemon)  # still ready: nothing drained or stopped


def _engine_stats(daemon: Daemon) -> dict[str, int]:
    with daemon.client() as client:
        return client.stats()["engine"]


def test_disconnect_mid_stream_aborts_in_the_scheduler_and_frees_kv(daemon: Daemon) -> None:
    with _raw(daemon) as sock:
        sock.sendall(_frame({"type": "generate", "id": 1, "prompt": PROMPTS[1],
                             "sampling": {"max_tokens": 2000, "ignore_eos": True}}))
        assert isinstance(_read_reply(sock), m.Delta)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        stats = _engine_stats(daemon)
        if stats["num_running"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]:
            break
        time.sleep(0.05)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert daemon.events("client_gone")


def test_leaving_a_stream_early_aborts_the_request(daemon: Daemon) -> None:
    async def run() -> str:
        async with AsyncClient(daemon.socket_path) as client:
            stream = client.stream(PROMPTS[2], max_tokens=2000, ignore_eos=True)
            async for _ in stream:
                break
            await stream.aclose()
            result = await client.generate(PROMPTS[0], max_tokens=3)  # the connection lives on
            return result.finish_reason

    assert asyncio.run(run()) == "length"
    stats = _engine_stats(daemon)
    assert stats["num_running"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_full_queue_answers_overloaded_at_once(daemon: Daemon) -> None:
    async def run() -> list[BaseException | object]:
        async with AsyncClient(daemon.socket_path) as client:
            tasks = [asyncio.create_task(client.generate(
                PROMPTS[i % len(PROMPTS)], max_tokens=300, ignore_eos=True, deadline_s=3))
                for i in range(11)]
            done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            return list(done)

    started = time.monotonic()
    outcomes = asyncio.run(run())
    overloaded = [o for o in outcomes if isinstance(o, errors.Overloaded)]
    assert len(overloaded) == 3  # eight slots
    assert time.monotonic() - started < 10
    _assert_serves(daemon)


def test_deadline_ends_a_request(daemon: Daemon) -> None:
    with daemon.client() as client, pytest.raises(errors.DeadlineExceeded):
        client.generate(PROMPTS[0], max_tokens=2000, ignore_eos=True, deadline_s=0.3)


def test_status_reports_provenance_of_both_processes(daemon: Daemon) -> None:
    with daemon.client() as client:
        status = client.status()
    front, scheduler = status.provenance["front"], status.provenance["scheduler"]
    assert front["code_version"] == scheduler["code_version"]
    assert "specd.workers.engine.core" in scheduler["modules"]
    assert "specd.workers.engine.core" not in front["modules"]
    assert "torch" in scheduler["packages"]


def test_specd_help_documents_every_option() -> None:
    import dataclasses

    from specd.daemon.config import DaemonConfig
    from specd.daemon.main import DAEMON_HELP, ENGINE_HELP
    from specd.workers.config import EngineConfig

    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    daemon_fields = {f.name for f in dataclasses.fields(DaemonConfig)} - {"engine"}
    assert engine_fields <= set(ENGINE_HELP), "add help for new EngineConfig fields"
    assert daemon_fields <= set(DAEMON_HELP), "add help for new DaemonConfig fields"
    out = subprocess.run([sys.executable, "-m", "specd.daemon.main", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for name in engine_fields | daemon_fields - {"socket_path"}:
        assert "--" + name.replace("_", "-") in out
    assert "--socket " in out
    assert "--extra " not in out  # read by nothing, so not an option


def _specctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specd.daemon.ctl", "--socket",
                           str(daemon.socket_path), *args], capture_output=True, text=True,
                          timeout=60)


def test_specctl_generate_status_and_exit_codes(daemon: Daemon, tmp_path: Path) -> None:
    out = _specctl(daemon, "generate", PROMPTS[0], "--max-tokens", "4", "--json")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[-1]["type"] == "result" and lines[-1]["num_output_tokens"] == 4
    assert "".join(x["text"] for x in lines[:-1]) == lines[-1]["text"]
    status = _specctl(daemon, "status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "ready"
    assert "state        ready" in _specctl(daemon, "status").stdout
    assert _specctl(daemon, "spec", "sometimes").returncode == 2
    unreachable = subprocess.run([sys.executable, "-m", "specd.daemon.ctl", "--socket",
                                  str(tmp_path / "none.sock"), "status"],
                                 capture_output=True, text=True, timeout=60)
    assert unreachable.returncode == 3 and "unreachable" in unreachable.stderr
