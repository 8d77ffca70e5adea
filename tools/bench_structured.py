"""Structured output under speculative decoding on the fixture model (greedy, float32).

For each constraint kind (none, a JSON schema with and without whitespace between tokens,
a regex, a choice, tool calls in Hermes' format, a named call in Llama-3's), two prompts
at once, 48 new tokens at most, with a chain of 5 steps and a tree (top-k 4, 5 steps, 10
draft tokens): the acceptance length (accepted drafts + 1 per verify pass), the drafts
accepted, and the mask figures (rows, the mask thread's seconds, the seconds the host
waited for them: what the forward did not hide).

Prints a table and writes bench_out/bench_structured.json. Run: python -m
tools.bench_structured [--device cuda]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from specd.ipc.sampling import SamplingParams
from specd.ipc.structured import Choice, JsonSchema, Regex, StructuredOutput, ToolCall, ToolSpec
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR, EngineConfig
from specd.workers.engine.core import EngineCore

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "size": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "size"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [ToolSpec("get_weather", WEATHER), ToolSpec("get_time", {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False})]
CONSTRAINTS: dict[str, StructuredOutput | None] = {
    "none": None,
    "json_schema compact": JsonSchema(SCHEMA, any_whitespace=False),
    "json_schema": JsonSchema(SCHEMA),
    "regex": Regex(r"[a-z]{2,8}(_[a-z0-9]{1,4}){0,3}"),
    "choice": Choice(["alpha", "beta", "gamma delta"]),
    "tool_call hermes": ToolCall("hermes", TOOLS, parallel=False),
    "tool_call named": ToolCall("llama3_json", TOOLS, function="get_weather"),
}
SHAPES: dict[str, dict[str, Any]] = {
    "chain5": {"spec_topk": 1, "spec_num_steps": 5},
    "tree": {"spec_topk": 4, "spec_num_steps": 5, "spec_num_draft_tokens": 10},
}
PROMPTS = ["import json\n\nCONFIG = json.loads('", "def parse(text):\n    return"]
MAX_TOKENS = 48


def measure(device: str, constraint: StructuredOutput | None, shape: dict[str, Any],
            prompts: list[list[int]]) -> dict[str, Any]:
    core = EngineCore(EngineConfig(device=device, dtype="float32", spec_mode="on", **shape))
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS,
                                                         structured=constraint))
    num_tokens = 0
    while core.has_unfinished():
        num_tokens += sum(len(d.new_token_ids) for d in core.step())
    stats, masks = core.stats(), core.structured.figures
    core.close()
    return {"acceptance_length": round(stats.acceptance_length, 3),
            "accepted": stats.num_accepted, "drafted": stats.num_drafted,
            "tokens": num_tokens, "mask_rows": masks.num_rows,
            "mask_fill_s": round(masks.fill_s, 4), "mask_wait_s": round(masks.wait_s, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("bench_out/bench_structured.json"))
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(FIXTURE_DIR)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    results: dict[str, dict[str, Any]] = {}
    print(f"{'constraint':22s} {'shape':7s} {'accept':>7s} {'drafts':>9s} {'tokens':>6s} "
          f"{'rows':>5s} {'fill s':>7s} {'wait s':>7s}")
    for name, constraint in CONSTRAINTS.items():
        for shape_name, shape in SHAPES.items():
            r = measure(args.device, constraint, shape, prompts)
            results[f"{name} / {shape_name}"] = r
            print(f"{name:22s} {shape_name:7s} {r['acceptance_length']:7.2f} "
                  f"{r['accepted']:4d}/{r['drafted']:<4d} {r['tokens']:6d} {r['mask_rows']:5d} "
                  f"{r['mask_fill_s']:7.3f} {r['mask_wait_s']:7.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
