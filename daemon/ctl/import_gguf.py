"""`specctl import-gguf FILE OUT_DIR`: a GGUF file (llama.cpp's format) imported as a Hugging
Face directory `specd --model OUT_DIR` serves (workers/convert/gguf_import.py says what is
read and how). The import runs as its own process, since it needs torch."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specd.workers.named_models import run_gguf_import


@click.command("import-gguf")
@click.argument("gguf_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
def import_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Import GGUF_FILE into the new directory OUT_DIR (config.json, safetensors with the
    quantized tensors dequantized to bfloat16, tokenizer.json, tokenizer_config.json and
    the chat template), with a progress bar. Exits 1 naming what cannot be imported."""
    code = run_gguf_import(gguf_file, out_dir)
    if code != 0:
        sys.exit(1)
