"""Building the speculative engine: each construction step that can fail raises out of
`EngineCore(...)`, never at the first decode; set_spec_mode and the stats it reports."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specd.ipc.sampling import SamplingParams
from specd.workers.config import FIXTURE_DRAFT_DIR, EngineConfig
from specd.workers.engine.core import EngineCore


def _head_copy(tmp_path: Path) -> Path:
    out = tmp_path / "head"
    shutil.copytree(FIXTURE_DRAFT_DIR, out)
    return out


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_draft_dir_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        EngineCore(EngineConfig(draft_model=str(tmp_path / "nowhere")))


def test_missing_weights_raise(tmp_path: Path) -> None:
    head = _head_copy(tmp_path)
    (head / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        EngineCore(EngineConfig(draft_model=str(head)))


def test_head_of_another_hidden_size_raises(tmp_path: Path) -> None:
    head = _head_copy(tmp_path)
    _edit_config(head, target_hidden_size=512)
    with pytest.raises(ValueError, match="target_hidden_size|fc.weight"):
        EngineCore(EngineConfig(draft_model=str(head)))


def test_head_with_missing_tensor_raises(tmp_path: Path) -> None:
    head = _head_copy(tmp_path)
    tensors = load_file(str(head / "model.safetensors"))
    del tensors[next(n for n in tensors if n.endswith("lm_head.weight"))]
    save_file(tensors, str(head / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head"):
        EngineCore(EngineConfig(draft_model=str(head)))


def test_aux_layers_out_of_range_raise(tmp_path: Path) -> None:
    head = _head_copy(tmp_path)
    _edit_config(head, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 6, 40]})
    with pytest.raises(ValueError, match="out of range"):
        EngineCore(EngineConfig(draft_model=str(head)))


def test_invalid_controller_config_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    # EngineConfig validates the threshold itself; a bad mode reaching the controller (a
    # config built around validation) must still fail at construction.
    config = EngineConfig()
    object.__setattr__(config, "spec_mode", "sometimes")
    with pytest.raises(ValueError, match="spec mode"):
        EngineCore(config)


def test_no_draft_model_means_plain_engine() -> None:
    core = EngineCore(EngineConfig(speculative_algorithm=None))
    assert core.spec is None and not core.resolved.speculative
    core.set_spec_mode("off", None)
    with pytest.raises(ValueError, match="needs a draft model"):
        core.set_spec_mode("on", None)


def test_set_spec_mode_logs_one_event_and_stats_follow(caplog: pytest.LogCaptureFixture) -> None:
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(spec_mode="off"))
    assert core.resolved.speculative and not core.stats().spec_active
    with caplog.at_level(logging.INFO, logger="specd.engine"):
        core.set_spec_mode("on", 4)
    events = [r for r in caplog.records if getattr(r, "event", None) == "spec_on"]
    assert len(events) == 1 and events[0].cause == "mode_set"  # type: ignore[attr-defined]
    core.add_request("a", list(range(10, 40)), SamplingParams(max_tokens=12, ignore_eos=True))
    last = None
    while core.has_unfinished():
        for d in core.step():
            last = d
    stats = core.stats()
    assert stats.spec_mode == "on" and stats.spec_active
    assert last is not None and last.num_drafted == stats.num_drafted > 0
    assert last.num_accepted == stats.num_accepted
    assert stats.acceptance_length == pytest.approx(
        (stats.num_accepted + stats.num_verify_passes) / stats.num_verify_passes)
    assert sum(stats.accepted_at_depth) == stats.num_accepted
    with pytest.raises(ValueError, match="spec mode"):
        core.set_spec_mode("maybe", None)
