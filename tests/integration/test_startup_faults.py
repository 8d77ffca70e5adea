"""Start-up faults planted in the real daemon and what the operator sees: the cause on the
first screen (one line or one log record) and the exit code of the contract (78 bad
configuration, 70 a code bug in building or warming up the engine).

Faults inside the scheduler process are planted from outside the product: a
`sitecustomize.py` on PYTHONPATH (which the front passes on to its child) patches specd in
the scheduler process only (`python -m specd.workers.process.scheduler_process` in its argv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from specd.daemon.ctl.common import EXIT_DOCTOR_PROBLEM
from specd.exit_codes import EXIT_CONFIG, EXIT_SOFTWARE
from specd.workers.config import FIXTURE_DIR
from tests.integration.daemon_harness import Daemon
from tests.unit.test_tokenizer_misfits import foreign_model


def plant_in_scheduler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patch: str) -> None:
    """Run `patch` (Python source) at start-up of every scheduler process spawned from now."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "if 'specd.workers.process.scheduler_process' in sys.orig_argv:\n"
        + textwrap.indent(textwrap.dedent(patch), "    "))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))


def specctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specd.daemon.ctl", "--socket",
                           str(daemon.socket_path), *args],
                          capture_output=True, text=True, timeout=60)


def run_specd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "specd.daemon.main", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("option", ["--model", "--draft-model"])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_model_option_is_a_configuration_error_naming_it(
        option: str, value: str, tmp_path: Path) -> None:
    result = run_specd("--socket", str(tmp_path / "s.sock"), option, value)
    assert result.returncode == EXIT_CONFIG
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("specd: invalid configuration:") and f"({option} " in line
    assert not (tmp_path / "s.sock").exists()


def test_a_tokenizer_larger_than_the_models_vocabulary_exits_78_naming_both_sizes(
        tmp_path: Path) -> None:
    model = tmp_path / "misfit"
    model.mkdir()
    for path in FIXTURE_DIR.iterdir():
        if path.is_file() and path.name != "config.json":
            (model / path.name).symlink_to(path)
    config = json.loads((FIXTURE_DIR / "config.json").read_text())
    tokenizer_size = config["vocab_size"]  # the fixture's tokenizer has exactly this many
    config["vocab_size"] = tokenizer_size - 96
    (model / "config.json").write_text(json.dumps(config))
    daemon = Daemon(tmp_path, "--model", str(model))
    try:
        assert daemon.wait(60) == EXIT_CONFIG
        (record,) = daemon.events("config_error")
        assert f"{tokenizer_size} tokens" in record["msg"]
        assert f"{tokenizer_size - 96} rows" in record["msg"]
        assert not daemon.events("scheduler_spawned")  # named before any weight is read
    finally:
        daemon.stop()


def test_a_code_bug_in_warm_up_exits_70_not_78(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    plant_in_scheduler(tmp_path, monkeypatch, """
        import specd.workers.engine.core as engine

        def warmup(self):
            return self.planted_attribute  # the incident's shape: never assigned

        engine.EngineCore.warmup = warmup
    """)
    daemon = Daemon(tmp_path)
    try:
        assert daemon.wait(240) == EXIT_SOFTWARE
        (record,) = daemon.events("scheduler_failed")
        assert "stage warmup" in record["msg"] and "AttributeError" in record["msg"]
        assert "planted_attribute" in record["scheduler_traceback"]
        assert record["exit_code"] == EXIT_SOFTWARE
    finally:
        daemon.stop()


def test_a_configuration_error_while_loading_stays_78(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    plant_in_scheduler(tmp_path, monkeypatch, """
        import specd.workers.engine.core as engine

        def init(self, config):
            raise ValueError("kv_cache_memory_bytes leaves no KV block (planted)")

        engine.EngineCore.__init__ = init
    """)
    daemon = Daemon(tmp_path)
    try:
        assert daemon.wait(240) == EXIT_CONFIG
        (record,) = daemon.events("scheduler_failed")
        assert "stage load" in record["msg"] and "planted" in record["msg"]
    finally:
        daemon.stop()


def test_a_code_bug_in_the_front_exits_70_with_its_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""\
        import sys
        if "specd.daemon.main" in sys.orig_argv:
            import specd.daemon.front as front

            def init(self, *args, **kwargs):
                return self.planted_attribute

            front.Front.__init__ = init
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    daemon = Daemon(tmp_path)
    try:
        assert daemon.wait(60) == EXIT_SOFTWARE
        (record,) = daemon.events("internal_error")
        assert "AttributeError" in record["msg"] and "planted_attribute" in record["traceback"]
        assert not daemon.socket_path.exists()  # cleaned up on the way out
    finally:
        daemon.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_no_device_of_the_kind_asked_for_exits_78_naming_the_option(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, "--device", "cuda")
    try:
        assert daemon.wait(240) == EXIT_CONFIG
        (record,) = daemon.events("scheduler_failed")
        (line,) = record["msg"].splitlines()
        assert "stage load" in line and "ValueError('--device cuda: " in line
        assert "use --device cpu" in line
        assert record["exit_code"] == EXIT_CONFIG
    finally:
        daemon.stop()


def test_a_foreign_tokenizer_that_fits_is_named_in_the_log_status_and_doctor(
        tmp_path: Path) -> None:
    model = foreign_model(tmp_path, 1000, eos_token="<s>")  # 1,000 tokens, 4,096 rows
    daemon = Daemon(tmp_path, "--model", str(model), "--speculative-algorithm",
                    "none").wait_ready()
    try:
        (record,) = daemon.events("tokenizer_misfit")
        assert record["level"] == "warning"
        assert "the tokenizer has 1000 tokens for the model's 4096 embedding rows" in \
            record["msg"]
        status = specctl(daemon, "status")
        assert any(x.startswith("problem      tokenizer_misfit: 1 since start; last: the "
                                "tokenizer has 1000 tokens") for x in status.stdout.splitlines())
        doctor = specctl(daemon, "doctor")
        assert doctor.returncode == EXIT_DOCTOR_PROBLEM
        assert "FAIL  problems: tokenizer_misfit" in doctor.stdout
    finally:
        daemon.stop()
