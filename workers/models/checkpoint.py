"""A checkpoint's weight files, read one way for the target model (in one process and on every
tensor-parallel rank) and for the draft head.

* `read_weight_map(index)`: the one parser of a sharded checkpoint's index
  (`model.safetensors.index.json`, `pytorch_model.bin.index.json`): its `weight_map` as
  shard file -> tensor names; `index_shards` adds each shard's path, which must exist.
* `checkpoint_files(model_dir)`: the target's safetensors files, single or sharded.
* `open_safetensors(path)`: one safetensors file as a memory map; `SafetensorsFile.read(name,
  part)` reads a tensor whole or the slice `part` names (`get_slice`: only that slice's bytes
  are read, never the whole tensor). `read_safetensors` reads every tensor of a file whole.

Every error is a ValueError naming the file; a file that is absent raises `MissingFileError`,
which is also a FileNotFoundError.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from specd.workers.models.config import MissingFileError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSlice:
    """How a rank reads one checkpoint tensor: dim None = whole; else `length` elements from
    `start` along `dim`. zeros: the rank holds zeros of the tensor's shape (a row-parallel
    bias off rank 0); skip: the tensor is not this rank's (another rank's expert)."""

    dim: int | None = None
    start: int = 0
    length: int = 0
    zeros: bool = False
    skip: bool = False


WHOLE = TensorSlice()


def read_weight_map(index: Path) -> dict[str, list[str]]:
    """Shard file name -> the tensor names `index`'s weight_map places in it. ValueError naming
    the index when it does not parse, has no weight_map, or names a shard that is not a plain
    file name (an index cannot point outside its folder)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not an index with a weight_map ({e})") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: weight_map must map tensor names to shard files")
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ValueError(f"{index}: shard {shard!r} of {name} is not a file name")
        by_shard.setdefault(shard, []).append(name)
    return by_shard


def index_shards(index: Path) -> list[tuple[Path, list[str]]]:
    """(shard path, its tensor names) for every shard `index` names, in file-name order;
    MissingFileError naming a shard that is not beside the index."""
    shards = []
    for shard, names in sorted(read_weight_map(index).items()):
        path = index.parent / shard
        if not path.is_file():
            raise MissingFileError(f"{index}: shard {shard} not found ({path}: checkpoint file "
                                   "not found)")
        shards.append((path, names))
    return shards


def checkpoint_files(model_dir: Path) -> list[tuple[Path, list[str] | None]]:
    """(file, tensor names its index places in it, None for a single file) of the target's
    safetensors checkpoint in `model_dir`; ValueError when there is none."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        return list(index_shards(index))
    single = model_dir / SAFETENSORS_FILE
    if not single.is_file():
        raise ValueError(f"{model_dir}: no {SAFETENSORS_FILE} and no {SAFETENSORS_INDEX}")
    return [(single, None)]


def require_listed(path: Path, listed: Iterable[str], present: Iterable[str],
                   index_name: str) -> None:
    """ValueError naming `path` unless it holds every tensor its index lists in it."""
    missing = sorted(set(listed) - set(present))
    if missing:
        raise ValueError(f"{path}: lacks tensors {missing} that {index_name} places in it")


class SafetensorsFile:
    """One safetensors file open as a memory map (`open_safetensors`): the header's names and
    shapes, and any tensor read whole or as one slice."""

    def __init__(self, path: Path, handle: Any) -> None:
        self.path = path
        self._handle = handle  # safetensors' (untyped) safe_open handle

    def names(self) -> list[str]:
        """The file's tensor names, sorted."""
        return sorted(self._handle.keys())

    def shape(self, name: str) -> list[int]:
        shape: list[int] = self._handle.get_slice(name).get_shape()
        return shape

    def dtype(self, name: str) -> str:
        """The header's dtype name of tensor `name` ("BF16", "I32", ...)."""
        return str(self._handle.get_slice(name).get_dtype())

    def read(self, name: str, part: TensorSlice = WHOLE) -> torch.Tensor:
        """Tensor `name`, or the slice `part` names (zeros of its shape for `part.zeros`):
        only that slice is read from the file."""
        view = self._handle.get_slice(name)
        if part.zeros:
            return torch.zeros(view.get_shape(), dtype=_TORCH_DTYPES[view.get_dtype()])
        if part.dim is None:
            tensor: torch.Tensor = view[:]
            return tensor
        end = part.start + part.length
        sliced: torch.Tensor = view[part.start:end] if part.dim == 0 else view[:, part.start:end]
        return sliced


@contextmanager
def open_safetensors(path: Path) -> Iterator[SafetensorsFile]:
    """`path` open for reading; a file that cannot be read, at open (a truncated or corrupt
    header, data that do not cover it) or while reading in the block, raises ValueError naming
    it."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            yield SafetensorsFile(path, handle)
    except SafetensorError as e:
        raise ValueError(f"{path}: unreadable safetensors file, truncated or corrupt ({e})") from e


def read_safetensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of safetensors file `path`, whole, on `device`."""
    with open_safetensors(path) as f:
        return {name: f.read(name).to(device) for name in f.names()}


_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I32": torch.int32, "I64": torch.int64, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}
