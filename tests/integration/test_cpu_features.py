"""The daemon on a CPU without the features a fast path needs: it serves through the portable
path and says so in `specctl status`. An AVX2-only CPU is simulated on any host by capping
oneDNN's instruction set (`ONEDNN_MAX_CPU_ISA`), which is what oneDNN itself then checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.daemon_harness import Daemon


def test_bfloat16_on_an_avx2_only_cpu_serves_unpacked_and_status_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    daemon = Daemon(tmp_path, "--dtype", "bfloat16").wait_ready()
    try:
        with daemon.client() as client:
            result = client.generate("def fib(n):\n", max_tokens=8)
            assert result.num_output_tokens == 8
            assert client.status().resolved["linears"].startswith(
                "nn.Linear (oneDNN's bf16 GEMM needs avx_ne_convert")
        status = subprocess.run([sys.executable, "-m", "specd.daemon.ctl", "--socket",
                                 str(daemon.socket_path), "status"], capture_output=True,
                                text=True, timeout=60, env=dict(os.environ), check=False)
        assert status.returncode == 0, status.stderr
        assert ("resolved     linears = nn.Linear (oneDNN's bf16 GEMM needs avx_ne_convert, "
                "or avx512bw, avx512vl and avx512dq, which this CPU lacks)") in status.stdout
        warnings = [r for r in daemon.records() if r.get("event") == "cpu_linears_unpacked"]
        assert len(warnings) == 1
    finally:
        daemon.stop()
