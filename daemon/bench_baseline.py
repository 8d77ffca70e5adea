"""The baseline a Python user would otherwise write: Hugging Face transformers
`model.generate()` at batch 1, greedy, on the same prompts and token counts as the
serving benchmark (prompts tokenized by specd's tokenizer, so both see the same ids).

Assisted generation: transformers (5.x, `GenerationMixin._get_candidate_generator`) drafts
with a standalone causal LM (`assistant_model`, same or different tokenizer), prompt
lookup, early exit of the target itself, a model's own MTP layers, Gemma-4 assistants that
read the target's shared KV states, or DFlash. None of them feeds a draft head the
target's hidden states from three layers each step, which is what an EAGLE-3 head needs,
so the fixture's EAGLE-3 head cannot serve as a transformers assistant; the baseline is
plain `generate()` and the report says so.

Imports torch and transformers: tools-only, never imported by the daemon.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

ASSISTED_GENERATION = {
    "possible": False,
    "verdict": "not possible: transformers' assisted generation takes a standalone causal "
               "LM (assistant_model), prompt lookup, early exit, MTP layers, Gemma-4 "
               "assistants or DFlash; none feeds a draft head the target's low/mid/high "
               "hidden states, which an EAGLE-3 head needs",
}


def run_baseline(model_dir: Path, prompts: list[str], max_new_tokens: int,
                 num_threads: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """Greedy `generate()` of exactly `max_new_tokens` tokens per prompt, one prompt at a
    time (after one untimed warm-up), in `dtype` (the daemon's); tokens/s over the run."""
    import torch
    from transformers import AutoModelForCausalLM

    from specd.daemon.tokenizer import Tokenizer

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    tokenizer = Tokenizer.from_dir(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
    ids = [torch.tensor([tokenizer.encode(p)]) for p in prompts]

    def generate(input_ids: torch.Tensor) -> int:
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
        return int(out.shape[1] - input_ids.shape[1])

    with torch.inference_mode():
        generate(ids[0][:, :8])
        started = time.perf_counter()
        num_tokens = sum(generate(x) for x in ids)
        wall = time.perf_counter() - started
    return {"library": "transformers", "model": str(model_dir), "batch_size": 1,
            "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "num_output_tokens": num_tokens, "wall_s": wall, "tokens_per_s": num_tokens / wall,
            "torch_threads": torch.get_num_threads(), "dtype": dtype,
            "assisted_generation": ASSISTED_GENERATION}
