"""Sampling parameters: one typed, validated object shared by the wire and the engine.

`SamplingParams` is a frozen msgspec Struct so that the same object travels from the client,
through the front process, to the scheduler without a second schema. It imports no torch.
Validation raises `ValueError` naming the field and the expected range.
"""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """How to pick each next token and when to stop.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens; -1 (or 0) keeps all.
    top_p: keep the smallest set whose probability reaches top_p; in (0, 1].
    min_p: drop tokens whose probability is below min_p times the largest; in [0, 1].
    seed: per-request seed; the same seed and prompt give the same tokens.
    max_tokens: most new tokens to generate; >= 1.
    stop_token_ids: tokens that end generation (kept in the output).
    ignore_eos: keep going past the model's end-of-sequence tokens.
    logprobs: number of top log-probabilities to return per token (0 = none).
    stop: strings that end generation; handled by the front's detokenizer, which cuts the
        text exactly before the first match.
    speculative: False opts this request out of speculative decoding.
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    stop: tuple[str, ...] = ()
    speculative: bool = True

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs < 0 or self.logprobs > 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
