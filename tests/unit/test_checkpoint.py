"""One way of reading a checkpoint's files (workers/models/checkpoint.py) and one loader
(workers/models/loader.py) for the target in one process, for every tensor-parallel rank and
for the draft head: one process is a world of size 1, whose slice of a tensor is the whole
tensor; a broken file is refused naming it whoever reads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specd.workers.config import FIXTURE_DIR, FIXTURE_DRAFT_DIR, FIXTURE_MOE_DIR
from specd.workers.models import checkpoint
from specd.workers.models.checkpoint import WHOLE, SafetensorsFile, TensorSlice
from specd.workers.models.config import MissingFileError, ModelConfig
from specd.workers.models.layers import dense_linear
from specd.workers.models.loader import load_model, read_full_tensor
from specd.workers.parallel.context import SINGLE_RANK, ParallelContext
from specd.workers.plan.deployment import PlanOptions, make_plan
from specd.workers.spec.draft_model import load_draft_head
from specd.workers.spec.head_files import read_head_tensors

CPU = torch.device("cpu")


def _copy(src: Path, dst: Path) -> Path:
    """`src`'s config.json and model.safetensors in `dst`."""
    dst.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    return dst


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _shard(src: Path, dst: Path) -> Path:
    """`src`'s checkpoint in `dst` as two shards named by an index; returns the second."""
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(dst / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst / "model-00002-of-00002.safetensors"


def _read_by(reader: str, tmp_path: Path) -> None:
    """Read the copy in tmp_path/m (the MoE target) or tmp_path/h (the head) as `reader`."""
    if reader == "head":
        load_draft_head(tmp_path / "h")
        return
    cfg = ModelConfig.from_dir(tmp_path / "m")
    if reader == "embedding":  # rank 0's copy of the whole embedding for the head
        read_full_tensor(cfg, "model.embed_tokens.weight", CPU, torch.float32)
    else:
        par = SINGLE_RANK if reader == "target" else ParallelContext(1, 2, reader == "ep-rank")
        load_model(cfg, CPU, torch.float32, dense_linear, par)


@pytest.mark.parametrize("reader", ["target", "rank", "ep-rank", "embedding", "head"])
def test_a_truncated_file_is_refused_naming_its_path_whoever_reads_it(
        tmp_path: Path, reader: str) -> None:
    path = _copy(FIXTURE_DRAFT_DIR if reader == "head" else FIXTURE_MOE_DIR,
                 tmp_path / ("h" if reader == "head" else "m")) / "model.safetensors"
    _truncate(path)
    with pytest.raises(ValueError, match=rf"{path}: unreadable safetensors file, truncated "
                                         r"or corrupt"):
        _read_by(reader, tmp_path)


@pytest.mark.parametrize("reader", ["target", "rank", "head"])
def test_a_shard_the_index_names_but_that_is_absent_is_one_error_for_all(
        tmp_path: Path, reader: str) -> None:
    """MissingFileError: a FileNotFoundError (the engine's start-up) and a ValueError (a
    usage error for `specctl plan`), naming the index and the shard's path."""
    src = FIXTURE_DRAFT_DIR if reader == "head" else FIXTURE_MOE_DIR
    shard = _shard(src, tmp_path / ("h" if reader == "head" else "m"))
    shard.unlink()
    with pytest.raises(MissingFileError, match=rf"model.safetensors.index.json: shard "
                                               rf"{shard.name} not found \({shard}: "):
        _read_by(reader, tmp_path)


@pytest.mark.parametrize("reader", ["target", "head"])
def test_a_shard_lacking_a_tensor_its_index_lists_is_named(tmp_path: Path,
                                                           reader: str) -> None:
    src = FIXTURE_DRAFT_DIR if reader == "head" else FIXTURE_MOE_DIR
    shard = _shard(src, tmp_path / ("h" if reader == "head" else "m"))
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    save_file({n: t for n, t in tensors.items() if n != dropped}, str(shard))
    with pytest.raises(ValueError, match=rf"{shard}: lacks tensors \['{dropped}'\] that "
                                         r"model.safetensors.index.json places in it"):
        _read_by(reader, tmp_path)


def test_a_missing_config_json_is_one_error_for_target_head_and_plan(tmp_path: Path) -> None:
    head = tmp_path / "head"
    shutil.copytree(FIXTURE_DRAFT_DIR, head)
    (head / "config.json").unlink()
    for read in (lambda: ModelConfig.from_dir(tmp_path),
                 lambda: load_draft_head(head),
                 lambda: make_plan(FIXTURE_DIR, head, PlanOptions(gpu_memory_bytes=2**30))):
        with pytest.raises(MissingFileError, match=r"config.json: not found \(a .* needs it\)"):
            read()


def test_an_index_names_only_files_beside_it(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "../x.safetensors"}}))
    with pytest.raises(ValueError, match=rf"{index}: shard '../x.safetensors' of "
                                         r"model.norm.weight is not a file name"):
        checkpoint.read_weight_map(index)
    index.write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match="weight_map must map tensor names to shard files"):
        checkpoint.read_weight_map(index)


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, TensorSlice]]:
    """Every (tensor, slice) read through the one reader from now on."""
    calls: list[tuple[str, TensorSlice]] = []
    read = SafetensorsFile.read

    def spy(self: SafetensorsFile, name: str, part: TensorSlice = WHOLE) -> torch.Tensor:
        calls.append((name, part))
        return read(self, name, part)

    monkeypatch.setattr(SafetensorsFile, "read", spy)
    return calls


def test_size_one_and_a_rank_of_two_read_the_same_bytes_of_a_replicated_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig.from_dir(FIXTURE_MOE_DIR)
    file = load_file(FIXTURE_MOE_DIR / "model.safetensors")
    calls = _reads(monkeypatch)
    whole = dict(load_model(cfg, CPU, torch.float32).named_parameters())
    assert calls and all(part == WHOLE for _, part in calls)  # size 1: every tensor whole
    rank = dict(load_model(cfg, CPU, torch.float32, dense_linear,
                           ParallelContext(1, 2)).named_parameters())
    for name in ("model.norm.weight", "model.layers.1.input_layernorm.weight",
                 "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                 "model.layers.1.mlp.gate.weight"):
        assert torch.equal(rank[name], whole[name]), name
        assert torch.equal(whole[name], file[name].float()), name
    # The same tensor, sliced on the rank, is half the size-1 one.
    q = "model.layers.1.self_attn.q_b_proj.weight"
    assert torch.equal(rank[q], whole[q][whole[q].shape[0] // 2:])


def test_a_rank_reads_only_its_slices_and_never_another_ranks_experts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Expert-parallel rank 1 of 2 (experts 4..7 of 8): no read of experts 0..3, every
    column- or row-parallel tensor read as a slice."""
    cfg = ModelConfig.from_dir(FIXTURE_MOE_DIR)
    calls = _reads(monkeypatch)
    load_model(cfg, CPU, torch.float32, dense_linear, ParallelContext(1, 2, True))
    read = {name: part for name, part in calls}
    experts = {int(name.split(".experts.")[1].split(".")[0]) for name in read
               if ".experts." in name}
    assert experts == {4, 5, 6, 7}
    for name in ("model.layers.1.self_attn.q_b_proj.weight", "model.layers.1.self_attn.o_proj"
                 ".weight", "model.embed_tokens.weight", "lm_head.weight",
                 "model.layers.1.mlp.shared_experts.down_proj.weight"):
        assert read[name].dim is not None and read[name].length, name
    assert read["model.layers.1.mlp.experts.5.down_proj.weight"] == WHOLE


def test_expert_parallel_names_the_missing_expert_as_the_checkpoint_numbers_it(
        tmp_path: Path) -> None:
    """Rank 1 numbers its experts 4..7 from 0: the error names expert 6's checkpoint tensor
    and the local parameter shard it fills."""
    tensors = load_file(FIXTURE_MOE_DIR / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.6.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(FIXTURE_MOE_DIR / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"checkpoint lacks tensor 'model\.layers\.1\.mlp\."
                                         r"experts\.6\.down_proj\.weight' for model\.layers\.1"
                                         r"\.mlp\.experts\.w2 \(shard 2\) \(rank 1 of 2\)"):
        load_model(ModelConfig.from_dir(tmp_path), CPU, torch.float32, dense_linear,
                   ParallelContext(1, 2, expert_parallel=True))


def test_a_wrong_shape_names_file_tensor_and_rank(tmp_path: Path) -> None:
    tensors = load_file(FIXTURE_MOE_DIR / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(tensors["model.norm.weight"].numel() + 1)
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(FIXTURE_MOE_DIR / "config.json", tmp_path / "config.json")
    cfg = ModelConfig.from_dir(tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'model.safetensors'}: tensor "
                                         r"'model.norm.weight' has shape \[\d+\], expected "
                                         r"\[\d+\] \(rank 1 of 2\)"):
        load_model(cfg, CPU, torch.float32, dense_linear, ParallelContext(1, 2))


def test_every_load_logs_its_progress_per_file_size_one_included(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    _shard(FIXTURE_MOE_DIR, tmp_path / "m")
    caplog.set_level("INFO", logger="specd.loader")
    load_model(ModelConfig.from_dir(tmp_path / "m"), CPU, torch.float32)
    records = [r.__dict__ for r in caplog.records
               if getattr(r, "event", "") == "rank_load_progress"]
    assert [(r["rank"], r["files_done"], r["files"]) for r in records] == [(0, 1, 2), (0, 2, 2)]
    file_bytes = sum(t.numel() * t.element_size()
                     for t in load_file(FIXTURE_MOE_DIR / "model.safetensors").values())
    assert sum(r["bytes_read"] for r in records) == file_bytes
    assert all(r["peak_rss_bytes"] > 0 for r in records)


def test_the_head_reads_its_safetensors_through_the_one_reader(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _reads(monkeypatch)
    tensors, path = read_head_tensors(FIXTURE_DRAFT_DIR)
    assert path == FIXTURE_DRAFT_DIR / "model.safetensors"
    assert sorted(name for name, _ in calls) == sorted(tensors)
    stored = load_file(path)
    assert all(torch.equal(tensors[n], stored[n]) for n in stored)
