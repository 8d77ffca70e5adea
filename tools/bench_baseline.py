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

Imports torch and transformers: tools-only, never imported by specd. `tools/bench_serving.py`
hands it to the serving benchmark (`specd.daemon.bench.command.run_bench`), whose
`Baseline` protocol it implements.
"""

from __future__ import annotations

import statistics
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


class Baseline:
    """transformers `generate()` loaded once and timed in rounds, so that its rounds can
    be interleaved with the daemon's (a drifting machine then biases neither side).

    Greedy `generate()` of exactly `max_new_tokens` tokens per prompt, one prompt at a time
    (after one untimed warm-up), in `dtype` (the daemon's). A round runs the first
    `round_prompts` prompts (default: all); `run_prompt` runs any one of them."""

    name = "transformers"

    def __init__(self, model_dir: Path, prompts: list[str], max_new_tokens: int,
                 num_threads: int | None = None, dtype: str = "float32",
                 round_prompts: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from specd.tokenizer import Tokenizer

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model_dir, self.max_new_tokens, self.dtype = model_dir, max_new_tokens, dtype
        tokenizer = Tokenizer.from_dir(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                          dtype=getattr(torch, dtype))
        self.model.eval()
        self.ids = [torch.tensor([tokenizer.encode(p)]) for p in prompts]
        self.round_prompts = len(self.ids) if round_prompts is None else round_prompts
        if not 1 <= self.round_prompts <= len(self.ids):
            raise ValueError(f"round_prompts must be in [1, {len(self.ids)}], got "
                             f"{round_prompts}")
        self.rounds: list[tuple[int, float]] = []  # (tokens, seconds) per round
        self._warm = False

    def _generate(self, input_ids: Any) -> int:
        import torch

        out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                  max_new_tokens=self.max_new_tokens,
                                  min_new_tokens=self.max_new_tokens, do_sample=False,
                                  pad_token_id=0)
        return int(out.shape[1] - input_ids.shape[1])

    def _warm_up(self) -> None:
        if not self._warm:
            self._generate(self.ids[0][:, :8])
            self._warm = True

    def run_round(self) -> float:
        """Time each of the round's prompts once; returns this round's tokens/s."""
        import torch

        with torch.inference_mode():
            self._warm_up()
            started = time.perf_counter()
            num_tokens = sum(self._generate(x) for x in self.ids[: self.round_prompts])
            wall = time.perf_counter() - started
        self.rounds.append((num_tokens, wall))
        return num_tokens / wall

    def run_prompt(self, index: int) -> tuple[int, float]:
        """(tokens, seconds) of one timed generation of prompt `index` (IndexError past
        the prompts given)."""
        import torch

        with torch.inference_mode():
            self._warm_up()
            started = time.perf_counter()
            num_tokens = self._generate(self.ids[index])
            return num_tokens, time.perf_counter() - started

    def result(self) -> dict[str, Any]:
        """The report's baseline: tokens_per_s is the median of the rounds' figures."""
        import torch

        if not self.rounds:
            raise RuntimeError("the baseline has not run a round")
        by_round = [n / wall for n, wall in self.rounds]
        return {"library": self.name, "label": "transformers generate()",
                "model": str(self.model_dir), "batch_size": 1,
                "num_prompts": self.round_prompts, "max_new_tokens": self.max_new_tokens,
                "num_output_tokens": self.rounds[-1][0],
                "wall_s": statistics.median(wall for _, wall in self.rounds),
                "tokens_per_s": statistics.median(by_round),
                "tokens_per_s_by_round": by_round,
                "torch_threads": torch.get_num_threads(), "dtype": self.dtype,
                "assisted_generation": ASSISTED_GENERATION}
