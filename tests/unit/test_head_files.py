"""A draft head's weights are read from each published file layout, and a broken or unsafe
layout is refused naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specd.workers.spec.head_files import WEIGHT_FILES, read_head_tensors

TENSORS = {"fc.weight": torch.arange(6.0).view(2, 3), "norm.weight": torch.ones(2),
           "d2t": torch.tensor([0, 1, 2], dtype=torch.int32)}


def _shards(root: Path, ext: str, weight_map: dict[str, str]) -> Path:
    """TENSORS split into the shards `weight_map` names, plus the index."""
    root.mkdir(exist_ok=True)
    for shard in set(weight_map.values()):
        part = {n: t for n, t in TENSORS.items() if weight_map.get(n) == shard}
        if ext == "safetensors":
            save_file(part, str(root / shard))
        else:
            torch.save(part, root / shard)
    prefix = "model" if ext == "safetensors" else "pytorch_model"
    index = root / f"{prefix}.{ext}.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def _assert_equal(read: dict[str, torch.Tensor]) -> None:
    assert set(read) == set(TENSORS)
    for name, tensor in TENSORS.items():
        assert torch.equal(read[name], tensor) and read[name].dtype == tensor.dtype


@pytest.mark.parametrize("ext", ["safetensors", "bin"])
def test_single_and_sharded_files_read_the_same_tensors(tmp_path: Path, ext: str) -> None:
    single = tmp_path / "single"
    single.mkdir()
    if ext == "safetensors":
        save_file(TENSORS, str(single / "model.safetensors"))
    else:
        torch.save(TENSORS, single / "pytorch_model.bin")
    read, path = read_head_tensors(single)
    _assert_equal(read)
    assert path.parent == single

    shard = {"fc.weight": f"a.{ext}", "norm.weight": f"b.{ext}", "d2t": f"b.{ext}"}
    index = _shards(tmp_path / "sharded", ext, shard)
    read, path = read_head_tensors(tmp_path / "sharded")
    _assert_equal(read)
    assert path == index


def test_safetensors_wins_when_a_release_ships_both(tmp_path: Path) -> None:
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    torch.save({"other": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    read, path = read_head_tensors(tmp_path)
    assert path.name == "model.safetensors" and "fc.weight" in read


class _NotATensor:
    pass


def test_a_pickle_weights_only_refuses_is_refused_naming_the_file(tmp_path: Path) -> None:
    torch.save({"fc.weight": torch.ones(1), "payload": _NotATensor()},
               tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: cannot be read with "
                                         r"torch\.load\(weights_only=True\)") as info:
        read_head_tensors(tmp_path)
    assert "\n" not in str(info.value)


def test_a_pickle_that_is_not_a_state_dict_is_refused(tmp_path: Path) -> None:
    torch.save([torch.ones(1)], tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="not a state dict of named tensors"):
        read_head_tensors(tmp_path)


def test_broken_indexes_are_refused_naming_the_file(tmp_path: Path) -> None:
    _shards(tmp_path / "a", "safetensors",
            {"fc.weight": "a.safetensors", "norm.weight": "a.safetensors",
             "d2t": "a.safetensors"})
    (tmp_path / "a" / "a.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard .*a.safetensors not found"):
        read_head_tensors(tmp_path / "a")

    _shards(tmp_path / "b", "safetensors", {"fc.weight": "a.safetensors"})
    index = tmp_path / "b" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"fc.weight": "a.safetensors",
                                                "lm_head.weight": "a.safetensors"}}))
    with pytest.raises(ValueError, match=r"a.safetensors: lacks tensors \['lm_head.weight'\]"):
        read_head_tensors(tmp_path / "b")

    index.write_text(json.dumps({"weight_map": {"fc.weight": "../a.safetensors"}}))
    with pytest.raises(ValueError, match="is not a file name"):
        read_head_tensors(tmp_path / "b")

    index.write_text("{")
    with pytest.raises(ValueError, match="not an index with a weight_map"):
        read_head_tensors(tmp_path / "b")


def test_no_weights_names_the_layouts_looked_for(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        read_head_tensors(tmp_path)
    assert all(name in str(info.value) for name in WEIGHT_FILES)


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_truncated_weights_file_is_refused_naming_the_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name.endswith(".safetensors"):
        save_file(TENSORS, str(path))
    else:
        torch.save(TENSORS, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{path}: unreadable.*truncated or corrupt"):
        read_head_tensors(tmp_path)
