"""The daemon's configuration: safe defaults, and the exit-code contract for a command line
or model directory the daemon cannot use (78, one line naming the problem; never click's
usage status 2, which systemd's Restart=on-failure would retry forever)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specd.daemon.config import DaemonConfig
from specd.daemon.main import build_config
from specd.exit_codes import EXIT_CONFIG
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR


def run_specd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specd.daemon.main", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, named", [
    (["--max-conections", "5"], "No such option '--max-conections'"),
    (["--max-connections", "five"], "'five' is not a valid integer"),
    (["--idle-timeout-s", "soon"], "'soon' is not float or none"),
    (["--extra", "key=value"], "No such option '--extra'"),
    (["--max-connections", "0"], "max_connections must be >= 1"),
    (["stray"], "unexpected extra argument (stray)"),
    (["--nnodes", "2", "--tensor-parallel-size", "2"], "nnodes > 1 needs dist_init_addr"),
    (["--nnodes", "2", "--tensor-parallel-size", "3", "--dist-init-addr", "10.0.0.1:29500"],
     "tensor_parallel_size 3 must be a multiple of nnodes 2"),
    (["--dist-init-addr", "10.0.0.1"], "dist_init_addr must be HOST:PORT, got '10.0.0.1'"),
    (["--nnodes", "2", "--node-rank", "1", "--tensor-parallel-size", "2", "--dist-init-addr",
      "10.0.0.1:29500"], "specd is node 0; node 1 runs `specd-worker --nnodes 2 --node-rank 1"),
])
def test_an_unusable_command_line_exits_78_with_one_line(args: list[str], named: str) -> None:
    result = run_specd(*args)
    assert result.returncode == EXIT_CONFIG
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], result.stderr
    assert lines[0].startswith("specd: invalid configuration: ")


def broken_model(tmp_path: Path, tokenizer_json: bytes) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(FIXTURE_DIR / "tokenizer_config.json", model)
    (model / "tokenizer.json").write_bytes(tokenizer_json)
    return model


@pytest.mark.parametrize("tokenizer_json, problem", [
    ((FIXTURE_DIR / "tokenizer.json").read_bytes()[:5000], "not valid JSON"),
    (b'{"version": "1.0", "model": {"type": "Nope"}}', "not a tokenizer"),
    (b'\xff\xfe{}', "not UTF-8"),
], ids=["truncated", "unknown-model", "not-utf8"])
def test_a_corrupt_tokenizer_exits_78_naming_the_file(
        tmp_path: Path, tokenizer_json: bytes, problem: str) -> None:
    model = broken_model(tmp_path, tokenizer_json)
    with pytest.raises(ValueError, match=problem) as raised:
        Tokenizer.from_dir(model)
    assert str(model / "tokenizer.json") in str(raised.value)
    result = run_specd("--model", str(model), "--socket", str(tmp_path / "s.sock"))
    assert result.returncode == EXIT_CONFIG
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "config_error" in lines[0], result.stderr
    assert str(model / "tokenizer.json") in lines[0] and problem in lines[0]


def test_safe_defaults() -> None:
    config = DaemonConfig()
    assert config.idle_timeout_s is not None and config.idle_timeout_s > 0
    assert config.write_buffer_bytes <= 2**20
    assert config.operator_uids == {0, os.geteuid()}
    assert DaemonConfig(operator_uid=4242).operator_uids == {0, 4242}


def test_none_turns_an_optional_limit_off() -> None:
    assert build_config({"idle_timeout_s": "none"}).idle_timeout_s is None
    assert build_config({"idle_timeout_s": 2.5}).idle_timeout_s == 2.5


def test_invalid_values_name_the_option() -> None:
    with pytest.raises(ValueError, match="operator_uid"):
        DaemonConfig(operator_uid=-1)
    with pytest.raises(ValueError, match="idle_timeout_s"):
        DaemonConfig(idle_timeout_s=0)
