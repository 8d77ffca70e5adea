"""Write the held-out prompt set that the benchmarks and speculation checks use.

Each prompt is a window of source lines from a held-out standard-library file (never trained
on), ending with a `def` line, so that the continuation is a function body. Deterministic:
the files and windows are chosen in sorted order.

    python -m tools.make_prompts --out workers/fixture/heldout_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tools.train_fixture import corpus_files, stdlib_root


def prompts_from_file(text: str, context_lines: int, per_file: int) -> list[str]:
    """Windows of `context_lines` lines ending at each `def` line (at most `per_file`)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("def ") and line.rstrip().endswith(":") and i >= 4:
            out.append("".join(lines[max(0, i - context_lines + 1) : i + 1]))
            if len(out) == per_file:
                break
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="workers/fixture/heldout_prompts.jsonl")
    p.add_argument("--context-lines", type=int, default=12)
    p.add_argument("--per-file", type=int, default=8)
    args = p.parse_args(argv)
    root = stdlib_root()
    _, heldout = corpus_files(root)
    rows = []
    for path in heldout:
        text = path.read_text(encoding="utf-8", errors="replace")
        for j, prompt in enumerate(prompts_from_file(text, args.context_lines, args.per_file)):
            rows.append({"file": path.relative_to(root).as_posix(), "index": j, "prompt": prompt})
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts from {len(heldout)} held-out files to {args.out}")


if __name__ == "__main__":
    main()
