"""Import a GGUF file (llama.cpp's format) as a Hugging Face directory specd serves.

`import_gguf(path, out_dir)` writes `config.json`, `generation_config.json`,
`model.safetensors` (quantized tensors dequantized to bfloat16, float ones as stored),
`tokenizer.json`, `tokenizer_config.json` (with the chat template the file carries) and
`chat_template.jinja`, all from the file's own metadata and tensors, read with the `gguf`
package (llama.cpp's reference reader). What is read and how: gguf_config.py (the model),
gguf_tokenizer.py (the tokenizer), gguf_tensors.py (names, layout, dequantization).
Anything the import cannot reproduce exactly is refused by name before a byte is written.

The directory appears whole or not at all: everything is written into a temporary sibling,
which is renamed to `out_dir` at the end (an `out_dir` that exists is refused). Run as
`python -m specd.workers.convert.gguf_import FILE OUT_DIR`, it shows a progress bar on
stderr; `specctl import-gguf` and the daemon's default-model import run it so, since the
front never imports torch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import torch
from safetensors.torch import save_file

from specd.workers.convert.gguf_config import generation_config, model_config
from specd.workers.convert.gguf_tensors import hf_name, hf_tensor
from specd.workers.convert.gguf_tokenizer import build_tokenizer, tokenizer_config_text

# (tensors done, tensors in all, the tensor's GGUF name)
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class ImportSummary:
    """What an import wrote: the directory, the architecture, the tensor count by GGUF type,
    and the bytes of model.safetensors."""

    out_dir: Path
    architecture: str
    tensor_types: dict[str, int]
    num_bytes: int


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every metadata key of the file as a Python value (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}


def import_gguf(path: Path, out_dir: Path, progress: Progress | None = None) -> ImportSummary:
    """Import GGUF file `path` into the new directory `out_dir` (module docstring). ValueError
    naming the file and what it cannot import; FileExistsError if out_dir exists."""
    path, out_dir = Path(path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; the import writes a new directory")
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a GGUF file gguf can read ({exc})") from exc
    try:
        metadata = read_metadata(reader)
        tokenizer_json, tokenizer_config, special_ids = build_tokenizer(metadata)
        names = [t.name for t in reader.tensors]
        config = model_config(metadata, len(metadata["tokenizer.ggml.tokens"]),
                              tied="output.weight" not in names, special_ids=special_ids)
        hf_names = [hf_name(n) for n in names]  # refuses a tensor with no place first
        tensors: dict[str, torch.Tensor] = {}
        types: dict[str, int] = {}
        for i, (tensor, name) in enumerate(zip(reader.tensors, hf_names, strict=True)):
            tensors[name] = hf_tensor(tensor, config)
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
            if progress is not None:
                progress(i + 1, len(names), tensor.name)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", generation_config(config))
        (staging / "tokenizer.json").write_text(tokenizer_json)
        (staging / "tokenizer_config.json").write_text(tokenizer_config_text(tokenizer_config))
        if "chat_template" in tokenizer_config:
            (staging / "chat_template.jinja").write_text(tokenizer_config["chat_template"])
        for written in staging.iterdir():
            written.chmod(0o644)
        staging.chmod(0o755)  # mkdtemp makes it private; the daemon's user must read it
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ImportSummary(out_dir, config["architectures"][0], types,
                         (out_dir / "model.safetensors").stat().st_size)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


class ProgressBar:
    """A progress bar on a stream (the import's command line), redrawn in place on a
    terminal each time it grows, else one line per tenth of the way."""

    def __init__(self, stream: Any = sys.stderr, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.t0 = time.monotonic()
        self.is_tty = bool(getattr(stream, "isatty", lambda: False)())
        self.shown = -1  # the last filled width drawn

    def __call__(self, done: int, total: int, name: str) -> None:
        del name
        filled = self.width * done // total
        step = 1 if self.is_tty else self.width // 10
        if filled < self.shown + step and done != total:
            return
        self.shown = filled
        line = (f"importing [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} "
                f"tensors, {time.monotonic() - self.t0:.0f} s")
        end = "\n" if done == total or not self.is_tty else ""
        self.stream.write(("\r" if self.is_tty else "") + line + end)
        self.stream.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specd.workers.convert.gguf_import",
                                     description="Import a GGUF file as a Hugging Face "
                                     "directory specd serves.")
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        summary = import_gguf(args.gguf_file, args.out_dir, ProgressBar())
    except (ValueError, FileExistsError, OSError) as exc:
        print(f"import failed: {exc}", file=sys.stderr)
        return 1
    types = ", ".join(f"{n} {k}" for k, n in sorted(summary.tensor_types.items()))
    print(f"imported {summary.architecture} into {summary.out_dir} ({types}; "
          f"{summary.num_bytes / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
