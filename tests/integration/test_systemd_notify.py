"""What systemd sees of a real specd: the sd_notify sequence, the watchdog, exit codes.

Each test starts the real daemon (front + scheduler processes) on a tiny random Llama that
uses the fixture's tokenizer (loads in seconds on a CPU), with `$NOTIFY_SOCKET` pointing at
a datagram socket owned by the test, which records every message as systemd would receive
it. Failures are real: the scheduler is SIGKILLed, SIGSTOPped (a hang; a slow load), the
model path is wrong. No systemd needs to run; `systemd-socket-activate` (Debian package
systemd) starts the daemon on the first connection in the last test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specd.ipc import messages as m
from specd.ipc.framing import FrameCodec, recv_body
from specd.ipc.sampling import SamplingParams
from specd.workers.config import FIXTURE_DIR

SPECD = shutil.which("specd")
pytestmark = pytest.mark.skipif(SPECD is None, reason="the specd entry point is not installed")

EXTEND = "EXTEND_TIMEOUT_USEC=60000000"  # lifecycle.STARTUP_EXTEND_S
START_S = 120.0  # generous: 2 shared cores; a start takes about 7 s when idle
PROMPT = [17, 42, 99, 7, 512, 3, 1000, 64]


def make_tiny_llama(out: Path) -> Path:
    """A 2-layer random Llama with the fixture tokenizer's 4096-token vocabulary."""
    out.mkdir()
    hidden, inter, layers, heads, kv_heads, vocab = 64, 128, 2, 4, 2, 4096
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 0,
        "eos_token_id": 0, "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        }
    save_file(tensors, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE_DIR / name, out / name)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


class NotifyRecorder:
    """systemd's side of $NOTIFY_SOCKET: a datagram socket; a thread records each message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.records: list[tuple[float, str]] = []  # (time.monotonic(), message)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            with self._changed:
                self.records.append((time.monotonic(), data.decode()))
                self._changed.notify_all()

    @property
    def messages(self) -> list[str]:
        with self._changed:
            return [msg for _, msg in self.records]

    def wait_for(self, pattern: str, timeout: float,
                 sender: subprocess.Popen[bytes] | None = None) -> float:
        """The arrival time of the first message fully matching `pattern`; gives up early
        when `sender` has exited without sending it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for at, msg in self.records:
                    if re.fullmatch(pattern, msg):
                        return at
                left = deadline - time.monotonic()
                exited = sender is not None and sender.poll() is not None
                if left <= 0 or exited:
                    raise AssertionError(f"no {pattern!r} within {timeout} s (sender exited: "
                                         f"{exited}): {[msg for _, msg in self.records]}")
                self._changed.wait(min(left, 0.5))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


class Daemon:
    """A running `specd` with a notify recorder; killed (with its scheduler) on close."""

    def __init__(self, tmp: Path, args: list[str], watchdog_usec: int | None = None,
                 launcher: list[str] | None = None, extra_env: dict[str, str] | None = None
                 ) -> None:
        self.socket_path = tmp / "specd.sock"
        self.log_path = tmp / "specd.log"
        self.recorder = NotifyRecorder(tmp / "notify")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "WATCHDOG_"))}
        env["NOTIFY_SOCKET"] = str(self.recorder.path)
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        env |= extra_env or {}
        command = [str(SPECD), "--socket", str(self.socket_path), *args]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen((launcher or []) + command, env=env, stderr=log,
                                            stdout=log, stdin=subprocess.DEVNULL)

    def wait_ready(self) -> float:
        return self.recorder.wait_for("READY=1", START_S, self.process)

    def scheduler_pid(self) -> int:
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        pids = children.read_text().split()
        assert len(pids) == 1, f"expected one scheduler process, found {pids}"
        return int(pids[0])

    def wait_exit(self, timeout: float = 60.0) -> int:
        return self.process.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # the scheduler follows (PR_SET_PDEATHSIG)
            self.process.wait()
        self.recorder.close()


class Client:
    """A blocking client speaking the framed protocol."""

    def __init__(self, path: Path) -> None:
        self.codec: FrameCodec[m.ServerMessage] = FrameCodec(m.ServerMessage)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(START_S)
        self.sock.connect(str(path))

    def send(self, message: m.ClientMessage) -> None:
        self.sock.sendall(self.codec.encode(message))

    def recv(self) -> m.ServerMessage:
        return self.codec.decode(recv_body(self.sock, self.codec.max_frame_bytes))

    def generate(self, request_id: int, max_tokens: int) -> None:
        self.send(m.Generate(id=request_id, prompt_token_ids=PROMPT, stream=True,
                             sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.close()


def start(daemons: list[Daemon], tmp: Path, model_dir: Path, *args: str,
          watchdog_usec: int | None = None, launcher: list[str] | None = None) -> Daemon:
    daemon = Daemon(tmp, ["--model", str(model_dir), "--speculative-algorithm", "none", *args],
                    watchdog_usec, launcher)
    daemons.append(daemon)
    return daemon


def startup_messages(messages: list[str]) -> list[str]:
    """Messages up to READY=1, without the periodic `(N s)` progress pairs of a slow stage."""
    end = messages.index("READY=1") + 1
    kept: list[str] = []
    for msg in messages[:end]:
        if re.fullmatch(r"STATUS=starting: .* \(\d+ s\)", msg):
            continue
        if msg == EXTEND and kept and kept[-1] == EXTEND:
            continue  # the extension that came with a skipped progress status
        kept.append(msg)
    return kept


EXPECTED_STARTUP = [
    "STATUS=starting: tokenizer", EXTEND,
    "STATUS=starting: model configuration", EXTEND,
    "STATUS=starting: socket", EXTEND,
    "STATUS=starting: scheduler: spawn", EXTEND,
    "STATUS=starting: scheduler: import", EXTEND,
    "STATUS=starting: scheduler: load", EXTEND,
    "STATUS=starting: scheduler: warmup", EXTEND,
    "STATUS=serving: model model",
    "READY=1",
]


def test_start_requests_and_sigterm_drain(daemons: list[Daemon], tmp_path: Path,
                                          model_dir: Path) -> None:
    daemon = start(daemons, tmp_path, model_dir, "--drain-timeout-s", "60",
                   watchdog_usec=1_000_000)
    ready_at = daemon.wait_ready()
    assert startup_messages(daemon.recorder.messages) == EXPECTED_STARTUP
    first_ping_at = daemon.recorder.wait_for("WATCHDOG=1", 5, daemon.process)  # idle is healthy

    client = Client(daemon.socket_path)
    client.generate(1, max_tokens=300)
    assert isinstance(client.recv(), m.Delta)
    daemon.process.send_signal(signal.SIGTERM)
    stopping_at = daemon.recorder.wait_for("STOPPING=1", 10)
    # New work is refused while the drain runs.
    late = Client(daemon.socket_path)
    late.generate(7, max_tokens=4)
    refused = late.recv()
    assert isinstance(refused, m.Error) and refused.code == "shutting_down", refused
    # The request in flight runs to completion.
    reply = client.recv()
    while isinstance(reply, m.Delta):
        reply = client.recv()
    assert isinstance(reply, m.Final), reply
    assert (reply.finish_reason, reply.num_output_tokens) == ("length", 300)
    assert daemon.wait_exit() == 0

    after_ready = [msg for at, msg in daemon.recorder.records if at > ready_at]
    drain = after_ready.index("STOPPING=1")
    assert after_ready[drain:drain + 3] == [
        "STOPPING=1", "STATUS=draining: 1 requests in flight", "EXTEND_TIMEOUT_USEC=120000000"]
    pings = [at for at, msg in daemon.recorder.records if msg == "WATCHDOG=1"]
    assert all(at > ready_at for at in pings)  # the watchdog is armed by READY
    assert ready_at < first_ping_at < stopping_at
    assert daemon.recorder.messages.count("READY=1") == 1
    assert daemon.recorder.messages.count("STOPPING=1") == 1
    assert not any(msg.startswith("STATUS=FAILED") for msg in daemon.recorder.messages)
    assert stopping_at > ready_at
    client.close()
    late.close()


def test_scheduler_killed_mid_stream_exits_75(daemons: list[Daemon], tmp_path: Path,
                                              model_dir: Path) -> None:
    daemon = start(daemons, tmp_path, model_dir, watchdog_usec=1_000_000)
    daemon.wait_ready()
    scheduler = daemon.scheduler_pid()
    client = Client(daemon.socket_path)
    client.generate(1, max_tokens=400)
    assert isinstance(client.recv(), m.Delta)
    killed_at = time.monotonic()
    os.kill(scheduler, signal.SIGKILL)
    reply = client.recv()
    while isinstance(reply, m.Delta):
        reply = client.recv()
    assert isinstance(reply, m.Error) and reply.code == "scheduler_unavailable", reply
    assert time.monotonic() - killed_at < 1.5
    assert "killed by SIGKILL" in reply.message
    assert daemon.wait_exit() == 75
    failed = [msg for msg in daemon.recorder.messages if msg.startswith("STATUS=FAILED")]
    assert failed == [f"STATUS=FAILED: {reply.message}"]
    assert "STOPPING=1" not in daemon.recorder.messages
    client.close()


@pytest.mark.slow  # 5-15 s: in the second tier, to keep the README's command under 10 min
def test_watchdog_pings_stop_while_the_scheduler_hangs(daemons: list[Daemon], tmp_path: Path,
                                                       model_dir: Path) -> None:
    hang_timeout = 3.0
    daemon = start(daemons, tmp_path, model_dir, "--hang-timeout-s", str(hang_timeout),
                   watchdog_usec=400_000)  # a ping every 0.2 s while healthy
    daemon.wait_ready()
    daemon.recorder.wait_for("WATCHDOG=1", 5, daemon.process)
    scheduler = daemon.scheduler_pid()
    client = Client(daemon.socket_path)
    client.generate(1, max_tokens=400)
    assert isinstance(client.recv(), m.Delta)
    os.kill(scheduler, signal.SIGSTOP)  # a hang: alive, but no progress
    stopped_at = time.monotonic()
    reply = client.recv()
    while isinstance(reply, m.Delta):
        reply = client.recv()
    assert isinstance(reply, m.Error) and reply.code == "scheduler_unavailable", reply
    assert "scheduler hung" in reply.message
    assert daemon.wait_exit() == 75
    failed_at = daemon.recorder.wait_for(r"STATUS=FAILED: scheduler hung.*", 1)
    pings = [at for at, msg in daemon.recorder.records if msg == "WATCHDOG=1"]
    # Healthy: pinged right up to the stop; hung: silent from the hang timeout on, although
    # the front's event loop kept running (it went on to detect the hang and fail).
    assert any(stopped_at - 1.0 < at < stopped_at for at in pings)
    slack = 0.5  # step outputs already in flight when the scheduler was stopped
    assert all(at < stopped_at + hang_timeout + slack for at in pings)
    assert failed_at > stopped_at + hang_timeout - slack
    # Between detecting the hang and failing (stack dump wait) the loop runs, but is silent.
    assert not any(failed_at - 0.4 < at for at in pings)
    client.close()


def test_an_idle_scheduler_that_stops_answering_shows_in_status_until_it_answers(
        daemons: list[Daemon], tmp_path: Path, model_dir: Path) -> None:
    daemon = start(daemons, tmp_path, model_dir, "--hang-timeout-s", "60")
    daemon.wait_ready()
    scheduler = daemon.scheduler_pid()
    os.kill(scheduler, signal.SIGSTOP)
    stopped = (rf"STATUS=unresponsive: the scheduler did not answer; process {scheduler} is "
               r"stopped \(state T: .*\)")
    daemon.recorder.wait_for(stopped, 5, daemon.process)
    os.kill(scheduler, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not daemon.recorder.messages[-1].startswith("STATUS=serving: "):
        assert time.monotonic() < deadline, daemon.recorder.messages[-4:]
        time.sleep(0.1)
    assert daemon.process.poll() is None  # answered again within the hang timeout


def test_bad_model_path_exits_78_without_ready(daemons: list[Daemon], tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, ["--model", str(tmp_path / "no-such-model")])
    daemons.append(daemon)
    assert daemon.wait_exit() == 78
    messages = daemon.recorder.messages
    assert messages[:2] == ["STATUS=starting: tokenizer", EXTEND]
    assert re.fullmatch(r"STATUS=FAILED: cannot load the tokenizer: .*no-such-model.*",
                        messages[-1])
    assert "READY=1" not in messages


def test_socket_served_by_a_live_daemon_exits_78(daemons: list[Daemon], tmp_path: Path,
                                                  model_dir: Path) -> None:
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(tmp_path / "specd.sock"))
    live.listen()
    daemon = start(daemons, tmp_path, model_dir)
    assert daemon.wait_exit() == 78
    assert re.fullmatch(r"STATUS=FAILED: cannot listen on .*another process answers.*",
                        daemon.recorder.messages[-1])
    assert (tmp_path / "specd.sock").exists()  # the other daemon's socket is left alone
    live.close()


def test_model_that_cannot_load_exits_78(daemons: list[Daemon], tmp_path: Path,
                                         model_dir: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    daemon = start(daemons, tmp_path, broken)
    assert daemon.wait_exit(START_S) == 78
    messages = daemon.recorder.messages
    assert "STATUS=starting: scheduler: load" in messages
    assert re.fullmatch(r"STATUS=FAILED: scheduler failed in stage load: .*", messages[-1])
    assert "READY=1" not in messages


@pytest.mark.parametrize("case", ["under_a_file", "too_long_for_a_socket"])
def test_link_that_cannot_be_made_exits_78(daemons: list[Daemon], tmp_path: Path,
                                           model_dir: Path, case: str) -> None:
    # The front's link directory lives in $RUNTIME_DIRECTORY: one that cannot be created
    # (OSError), or so deep that the ZeroMQ socket paths exceed sun_path (ZMQError), is the
    # host's configuration: exit 78 (no restart), not a traceback and exit 1.
    (tmp_path / "file").write_text("")
    runtime = {"under_a_file": tmp_path / "file" / "specd-engine",
               "too_long_for_a_socket": tmp_path / ("d" * 100)}[case]
    daemon = Daemon(tmp_path, ["--model", str(model_dir), "--speculative-algorithm", "none",
                               "--log-format", "json"],
                    extra_env={"RUNTIME_DIRECTORY": str(runtime)})
    daemons.append(daemon)
    assert daemon.wait_exit(START_S) == 78
    messages = daemon.recorder.messages
    assert re.fullmatch(r"STATUS=FAILED: cannot start the scheduler \(link directory under "
                        + re.escape(str(runtime)) + r"\): .+", messages[-1])
    assert "READY=1" not in messages
    records = [json.loads(line) for line in daemon.log().splitlines()]
    errors = [r for r in records if r.get("event") == "config_error"]
    assert len(errors) == 1 and errors[0]["exit_code"] == 78
    assert "Traceback (most recent call last)" in errors[0]["traceback"]
    assert records[-1]["event"] == "exit" and records[-1]["exit_code"] == 78


@pytest.mark.slow
def test_slow_load_keeps_extending_the_start_timeout(daemons: list[Daemon], tmp_path: Path,
                                                     model_dir: Path) -> None:
    daemon = start(daemons, tmp_path, model_dir)
    daemon.recorder.wait_for("STATUS=starting: scheduler: import", START_S)
    scheduler = daemon.scheduler_pid()
    os.kill(scheduler, signal.SIGSTOP)  # the load stalls: slower than any real disk
    progress = r"STATUS=starting: scheduler: (import|load) \((\d+) s\)"
    at = daemon.recorder.wait_for(progress, 40)  # the front reports every 20 s
    os.kill(scheduler, signal.SIGCONT)
    daemon.wait_ready()
    messages = daemon.recorder.messages
    index = next(i for i, msg in enumerate(messages) if re.fullmatch(progress, msg))
    assert messages[index + 1] == EXTEND  # the start timeout is pushed out again
    assert at < daemon.recorder.wait_for("READY=1", 0)
    assert startup_messages(daemon.recorder.messages) == EXPECTED_STARTUP


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None,
                    reason="systemd-socket-activate not installed (Debian package: systemd)")
def test_socket_activation_starts_the_daemon_on_first_connection(
        daemons: list[Daemon], tmp_path: Path, model_dir: Path) -> None:
    listen = tmp_path / "activated.sock"
    recorder_path = tmp_path / "notify"
    # systemd-socket-activate passes on only the variables named with -E.
    launcher = ["systemd-socket-activate", "-l", str(listen), "--fdname", "specd",
                "-E", f"NOTIFY_SOCKET={recorder_path}"]
    daemon = start(daemons, tmp_path, model_dir, launcher=launcher)
    time.sleep(1.0)
    assert daemon.recorder.messages == []  # nothing runs until a client connects
    client = Client(listen)  # the connection starts specd (exec'd in the launcher's pid)
    client.send(m.StatusQuery(id=1))
    status = client.recv()
    assert isinstance(status, m.StatusReply), status
    daemon.wait_ready()
    client.generate(2, max_tokens=5)
    reply = client.recv()
    while isinstance(reply, m.Delta):
        reply = client.recv()
    assert isinstance(reply, m.Final) and reply.num_output_tokens == 5, reply
    assert "using socket-activated listener fd 3 (specd)" in daemon.log()
    assert not daemon.socket_path.exists()  # --socket is ignored under activation
    daemon.process.send_signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    assert listen.exists()  # the listening socket belongs to the launcher, not to specd
    client.close()


def test_link_directory_goes_to_the_service_runtime_directory(
        daemons: list[Daemon], tmp_path: Path, model_dir: Path) -> None:
    # systemd sets $RUNTIME_DIRECTORY (RuntimeDirectory=specd-engine), the one directory
    # under /run the service may write; the socket's directory is the socket unit's.
    # A short directory in /tmp, like /run/specd-engine: the link's ZeroMQ socket paths
    # must fit sun_path (107 bytes), which pytest's deep tmp_path would not leave room for.
    with tempfile.TemporaryDirectory(prefix="specd-engine-") as name:
        runtime = Path(name)
        daemon = Daemon(tmp_path, ["--model", str(model_dir), "--speculative-algorithm",
                                   "none"], extra_env={"RUNTIME_DIRECTORY": f"{runtime}:/unused"})
        daemons.append(daemon)
        daemon.wait_ready()  # the scheduler came up over the link in that directory
        assert [p.name.startswith("link-") for p in runtime.iterdir()] == [True]
        assert not list(tmp_path.glob("link-*"))  # not next to the socket
        daemon.close()  # before the directory goes
