"""Reading a draft head's files: its config.json (`read_draft_config`) and its tensors from
the file layouts heads are published in.

A head directory holds config.json and its weights in one of four layouts, looked for in
this order (the first present is read, as transformers prefers safetensors when a release
ships both):

| file | layout |
| --- | --- |
| `model.safetensors` | one safetensors file (SpecForge, Speculators, specd's trainer) |
| `model.safetensors.index.json` | safetensors shards named by the index's `weight_map` |
| `pytorch_model.bin` | one pickled state dict (the original EAGLE-3 releases) |
| `pytorch_model.bin.index.json` | pickled shards named by the index's `weight_map` |

Safetensors files, the indexes and config.json are read as the target's are
(workers/models/checkpoint.py; `read_json_object` of workers/models/config.py). Pickled files
are read with `torch.load(weights_only=True)`: tensors and plain containers only, never
arbitrary objects, so a head file cannot run code. Names are returned as stored;
`head_weights.load_head_weights` maps the published spellings onto its own.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from specd.workers.models.checkpoint import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    index_shards,
    read_safetensors,
    require_listed,
)
from specd.workers.models.config import read_json_object
from specd.workers.spec.draft_config import DraftConfig

BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX, BIN_FILE, BIN_INDEX)


def read_draft_config(root: Path) -> DraftConfig:
    """The head's DraftConfig from `root`/config.json, in any published format. Raises
    MissingFileError (a FileNotFoundError) when there is no config.json, ValueError naming
    the file when it does not parse or names a value the head cannot have."""
    path = Path(root) / "config.json"
    raw = read_json_object(path, "a draft head directory")
    try:
        return DraftConfig.from_dict(raw)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


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
    not parse or names a shard outside `root` (MissingFileError, a FileNotFoundError, for a
    shard that is absent), a shard missing a tensor its index lists, a pickle that
    `weights_only` refuses or that is not a name -> tensor dict.
    """
    path = find_weights(root)
    if path.name not in (SAFETENSORS_INDEX, BIN_INDEX):
        return _read_file(path, device), path
    tensors: dict[str, torch.Tensor] = {}
    for shard, names in index_shards(path):
        stored = _read_file(shard, device)
        require_listed(shard, names, stored, path.name)
        tensors.update({name: stored[name] for name in names})
    return tensors, path


def _read_file(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    if path.name.endswith(".safetensors"):
        return read_safetensors(path, device)
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
