"""HTTP-only paths, as the operator and the client see them: the daemon's warm-up sends
every HTTP path through the real request flow before READY, so a fault on one
(`stream_options.include_usage`) fails the start (exit 70, one `http_warmup_failed`
record naming the path and the exception) instead of a generic 500 at the first client
that takes it; a handler that raises after READY answers with the exception's type and
message, and is a fallback in `specctl status` that `specctl doctor` fails on. A clean
start leaves nothing of the warm-up in the figures.

The faults are planted in the front process only (a sitecustomize on PYTHONPATH)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from specd.daemon.ctl.common import EXIT_DOCTOR_PROBLEM
from specd.exit_codes import EXIT_SOFTWARE
from tests.integration.daemon_harness import Daemon


def plant_in_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patch: str) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "if 'specd.daemon.main' in sys.orig_argv:\n"
        + textwrap.indent(textwrap.dedent(patch), "    "))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _base(daemon: Daemon) -> str:
    (listening,) = daemon.events("http_listening")
    return f"http://{listening['host']}:{listening['port']}"


def test_a_fault_on_the_usage_path_fails_the_start_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plant_in_front(tmp_path, monkeypatch, """
        import specd.daemon.http.responses as responses

        final_events = responses.Answer.final_events

        def planted_usage(self, final):
            if self.options.include_usage:  # the stream_options.include_usage path only
                raise KeyError("planted")
            return final_events(self, final)

        responses.Answer.final_events = planted_usage
    """)
    daemon = Daemon(tmp_path, "--speculative-algorithm", "none", "--http", "127.0.0.1:0")
    try:
        assert daemon.wait(240) == EXIT_SOFTWARE
        assert not daemon.events("ready")  # never READY
        (record,) = daemon.events("http_warmup_failed")
        assert record["msg"].startswith("HTTP warm-up failed: POST /v1/completions "
                                        "(completions streamed with usage): an error event: "
                                        "internal error: KeyError: 'planted'")
        assert record["exit_code"] == EXIT_SOFTWARE
        tracebacks = [r for r in daemon.events("internal_error") if "traceback" in r]
        assert tracebacks and "planted_usage" in tracebacks[0]["traceback"]
    finally:
        daemon.stop()


def test_a_handler_that_raises_after_ready_answers_its_exception_and_is_a_fallback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plant_in_front(tmp_path, monkeypatch, """
        import specd.daemon.http.params as params

        convert = params.completion_to_generate

        def planted(req, *args):
            if req.prompt == "boom":
                raise KeyError("planted")
            return convert(req, *args)

        params.completion_to_generate = planted
    """)
    daemon = Daemon(tmp_path, "--speculative-algorithm", "none", "--http",
                    "127.0.0.1:0").wait_ready()
    try:
        (ready,) = daemon.events("ready")
        assert ready["http_warmup_s"] > 0
        with daemon.client() as client:  # the warm-up's requests left no figures behind
            stats = client.stats()
        assert stats["engine"]["num_generated_tokens"] == 0
        assert not {k for k in stats["front"] if k.startswith(("finished_", "error_"))}

        status, body = _post(_base(daemon) + "/v1/completions",
                             {"model": "fixture", "prompt": "boom", "max_tokens": 2})
        assert status == 500
        assert body["error"] == {"message": "internal error: KeyError: 'planted'",
                                 "type": "server_error", "param": None,
                                 "code": "internal_error"}

        def specctl(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "specd.daemon.ctl", "--socket",
                                   str(daemon.socket_path), *args],
                                  capture_output=True, text=True, timeout=60)

        lines = specctl("status").stdout.splitlines()
        assert ("fallback     http_handler: 1 since start; last: POST /v1/completions: "
                "KeyError: 'planted'") in lines
        doctor = specctl("doctor")
        assert doctor.returncode == EXIT_DOCTOR_PROBLEM
        assert "FAIL  fallbacks: degraded: http_handler: 1 since start" in doctor.stdout
    finally:
        daemon.stop()
