"""Speculation that does not pay is a named event: a draft head that loads but cannot
belong to the target (here the fixture's head with its draft vocabulary's rows shuffled,
as a head trained for another tokenizer would be) drafts tokens the target rejects; the
engine logs one `spec_acceptance_low` record with the figures, status shows the problem and
doctor fails on it. The intact head raises nothing."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specd.daemon.ctl.common import EXIT_DOCTOR_PROBLEM
from specd.ipc.sampling import SamplingParams
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR, EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.spec.acceptance_watch import FLOOR
from tests.integration.daemon_harness import Daemon

HEAD_DIR = FIXTURE_DIR / "eagle3"


def foreign_head(tmp_path: Path) -> Path:
    """The fixture's head with the rows of its lm_head shuffled: every tensor finite and
    of the right shape, its drafts another vocabulary's."""
    head = tmp_path / "foreign-head"
    shutil.copytree(HEAD_DIR, head)
    tensors = load_file(HEAD_DIR / "model.safetensors")
    rows = torch.randperm(tensors["lm_head.weight"].shape[0],
                          generator=torch.Generator().manual_seed(0))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][rows].contiguous()
    save_file(tensors, head / "model.safetensors")
    return head


def _serve(core: EngineCore, num_requests: int = 8, max_tokens: int = 40) -> None:
    tokenizer = Tokenizer.from_dir(FIXTURE_DIR)
    prompts = [json.loads(line)["prompt"]
               for line in (FIXTURE_DIR / "heldout_prompts.jsonl").read_text().splitlines()]
    for i, prompt in enumerate(prompts[:num_requests]):
        core.add_request(f"r{i}", tokenizer.encode(prompt, True)[:64],
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while core.has_unfinished():
        core.step()


@pytest.mark.slow  # two engines warmed up, a window of verify passes (~40 s on two cores)
def test_a_head_of_another_vocabulary_is_named_once_and_the_intact_one_is_not(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specd.spec")
    core = EngineCore(EngineConfig(dtype="float32", spec_mode="on",
                                   draft_model=str(foreign_head(tmp_path))))
    core.warmup()
    _serve(core)
    stats = core.stats()
    (problem,) = stats.problems.values()
    assert problem.startswith("the draft head's drafts are rarely accepted: ")
    (record,) = [r for r in caplog.records if getattr(r, "event", "") == "spec_acceptance_low"]
    assert vars(record)["acceptance"] < 0.1 and vars(record)["num_verify_passes"] >= 256
    caplog.clear()

    # The intact head on the same requests accepts far above the floor (about 0.6).
    intact = EngineCore(EngineConfig(dtype="float32", spec_mode="on"))
    intact.warmup()
    _serve(intact)
    figures = intact.worker.figures
    depth = intact.acceptance.depth
    assert figures.num_accepted / (figures.num_verify_passes * depth) > 3 * FLOOR
    assert intact.stats().problems == {}
    assert not [r for r in caplog.records if getattr(r, "event", "").startswith("spec_acc")]


@pytest.mark.slow  # a daemon start and a window of verify passes (~30 s on two cores)
def test_the_operator_sees_a_head_that_drafts_nothing_useful(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, "--draft-model", str(foreign_head(tmp_path)), "--spec-mode",
                    "on").wait_ready()
    try:
        def generate(i: int) -> int:
            with daemon.client(timeout=600) as client:
                return client.generate(f"def main_{i}():\n", max_tokens=40,
                                       ignore_eos=True).num_output_tokens

        with ThreadPoolExecutor(8) as pool:  # one batch: 8 verify passes a step
            assert list(pool.map(generate, range(8))) == [40] * 8

        def specctl(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "specd.daemon.ctl", "--socket",
                                   str(daemon.socket_path), *args],
                                  capture_output=True, text=True, timeout=60)

        lines = specctl("status").stdout.splitlines()
        assert any(x.startswith("problem      spec_acceptance_low: the draft head's drafts "
                                "are rarely accepted") for x in lines), lines
        doctor = specctl("doctor")
        assert doctor.returncode == EXIT_DOCTOR_PROBLEM
        assert "FAIL  problems: spec_acceptance_low" in doctor.stdout
        (record,) = daemon.events("spec_acceptance_low")
        assert record["level"] == "warning" and record["acceptance"] < 0.1
    finally:
        daemon.stop()
