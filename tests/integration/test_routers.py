"""sglang-router and vllm-router (their PyPI wheels), unmodified, route to two specd
replicas: each router starts against the replicas' HTTP APIs (its discovery and health
checks answered), forwards the official `openai` SDK's requests, streamed and not, chat and
completions, with the fields it adds to every body, and both replicas serve some of them.
Skipped for a router whose wheel is not installed (.ci/run installs both)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.daemon_harness import Daemon

pytestmark = pytest.mark.slow

MODEL = "fixture"
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    daemons = [Daemon(tmp_path_factory.mktemp(f"replica{i}"), "--model", MODEL,
                      "--dtype", "float32", "--no-spec-auto-measure", "--http", "127.0.0.1:0")
               for i in range(2)]
    try:
        urls = []
        for daemon in daemons:
            record = daemon.wait_ready().events("http_listening")[0]
            urls.append(f"http://{record['host']}:{record['port']}")
        yield urls
    finally:
        for daemon in daemons:
            daemon.stop()


def served(url: str) -> float:
    """Requests a replica finished (its /metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specd_requests_total{"))


def wait_until_routing(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the router did not answer in {START_TIMEOUT_S} s: "
                         + log.read_text()[-3000:])


ROUTERS = {
    "sglang-router": ["launch", "--policy", "round_robin"],
    "vllm-router": ["--policy", "round_robin"],
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_router_routes_to_both_replicas(router: str, replicas: list[str],
                                        tmp_path: Path) -> None:
    binary = shutil.which(router)
    if binary is None:
        pytest.skip(f"{router} is not installed (pip install {router})")
    port = free_port()
    log = tmp_path / f"{router}.log"
    command = [binary, *ROUTERS[router], "--worker-urls", *replicas, "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-port", str(free_port())]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_routing(url, process, log)
        before = [served(r) for r in replicas]
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=2, timeout=120)
        messages: list[Any] = [{"role": "user", "content": "Sort a list"}]
        for _ in range(2):
            chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                               temperature=0)
            assert chat.choices[0].message.content and chat.usage is not None
            chunks = list(api.chat.completions.create(model=MODEL, messages=messages,
                                                      max_tokens=6, temperature=0,
                                                      stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks
                           if c.choices) == chat.choices[0].message.content
            text = api.completions.create(model=MODEL, prompt="def fib(n):\n", max_tokens=6,
                                          temperature=0)
            assert text.choices[0].finish_reason in ("length", "stop")
        after = [served(r) for r in replicas]
        assert sum(a - b for a, b in zip(after, before, strict=True)) == 6
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    finally:
        process.terminate()
        process.wait(30)
