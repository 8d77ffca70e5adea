"""Reading a draft head's tensors from the file layouts heads are published in.

A head directory holds config.json and its weights in one of four layouts, looked for in
this order (the first present is read, as transformers prefers safetensors when a release
ships both):

| file | layout |
| --- | --- |
| `model.safetensors` | one safetensors file (SpecForge, Speculators, specd's trainer) |
| `model.safetensors.index.json` | safetensors shards named by the index's `weight_map` |
| `pytorch_model.bin` | one pickled state dict (the original EAGLE-3 releases) |
| `pytorch_model.bin.index.json` | pickled shards named by the index's `weight_map` |

Pickled files are read with `torch.load(weights_only=True)`: tensors and plain containers
only, never arbitrary objects, so a head file cannot run code. Names are returned as stored;
`DraftHead.load_weights` maps the published spellings onto its own.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX, BIN_FILE, BIN_INDEX)


def find_weights(root: Path) -> Path:
    """The weights file (or index) of the head in `root`; FileNotFoundError naming the four."""
    for name in WEIGHT_FILES:
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(f"draft model: no weights in {root} (expected one of "
                            f"{', '.join(WEIGHT_FILES)})")


def read_head_tensors(root: Path, device: str | torch.device = "cpu",
                      ) -> tuple[dict[str, torch.Tensor], Path]:
    """(every tensor by its stored name, the file read) for the head in `root`.

    ValueError naming the file for a truncated or corrupt weights file, an index that does
    not parse or names a shard outside
    `root` (FileNotFoundError for a shard that is absent), a shard missing a tensor its
    index lists, a pickle that `weights_only` refuses or that is not a name -> tensor dict.
    """
    path = find_weights(root)
    if path.name in (SAFETENSORS_INDEX, BIN_INDEX):
        return _read_sharded(path, device), path
    return _read_file(path, device), path


def _read_file(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    if path.name.endswith(".safetensors"):
        try:
            return load_file(str(path), device=str(device))
        except SafetensorError as e:  # the target's loader words it the same way
            raise ValueError(f"{path}: unreadable safetensors file, truncated or corrupt "
                             f"({e})") from e
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).splitlines()[0]
        raise ValueError(f"{path}: cannot be read with torch.load(weights_only=True): "
                         f"{reason}") from e
    except (RuntimeError, EOFError) as e:  # a truncated zip or pickle stream
        reason = str(e).splitlines()[0]
        raise ValueError(f"{path}: unreadable, truncated or corrupt ({reason})") from e
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{path}: not a state dict of named tensors")
    return state


def _read_sharded(index: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not an index with a weight_map ({e})") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: weight_map must map tensor names to shard files")
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        # A shard is a file beside the index: no directories, so an index cannot point
        # outside the head's folder.
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ValueError(f"{index}: shard {shard!r} of {name} is not a file name")
        by_shard.setdefault(shard, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for shard, names in sorted(by_shard.items()):
        path = index.parent / shard
        if not path.is_file():
            raise FileNotFoundError(f"{index}: shard {path} not found")
        stored = _read_file(path, device)
        missing = sorted(set(names) - set(stored))
        if missing:
            raise ValueError(f"{path}: lacks tensors {missing} that {index.name} places in it")
        tensors.update({name: stored[name] for name in names})
    return tensors
