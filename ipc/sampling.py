"""Sampling parameters: one typed, validated object shared by the wire and the engine.

`SamplingParams` is a frozen msgspec Struct so that the same object travels from the client,
through the front process, to the scheduler without a second schema. It imports no torch.
Validation raises `ValueError` naming the field and the expected range.
"""

from __future__ import annotations

import math

import msgspec

# Temperatures below this are greedy (vLLM's threshold). At T = 1e-5 two logits 0.001 apart
# already differ by e^100 in probability, so a smaller T changes nothing but near-exact ties,
# while float32 cannot divide by it (1e-300 rounds to 0). `is_greedy` is the one place that
# applies it, so the sampler, speculative acceptance and the seeded generators agree.
GREEDY_TEMPERATURE = 1e-5
# The integer range a msgpack frame carries (int64 and uint64), also torch.Generator's seed
# range: a larger value would fail to encode between processes or to seed a generator.
MIN_INT64 = -(2**63)
MAX_INT64 = 2**63 - 1
MAX_UINT64 = 2**64 - 1
MAX_LOGPROBS = 20  # top log-probabilities per token a request may ask for


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """How to pick each next token and when to stop.

    temperature: finite, >= 0. Below GREEDY_TEMPERATURE (1e-5; 0 included) means greedy
        (argmax, the lowest token id among equal maxima); otherwise samples from
        softmax(logits / temperature).
    top_k: keep the k most likely tokens; -1 (or 0) keeps all; k above the vocabulary keeps
        all.
    top_p: keep the smallest set whose probability reaches top_p; in (0, 1]. The most likely
        token is always kept (a top_p that rounds to 0 in float32 keeps it and its ties).
    min_p: drop tokens whose probability is below min_p times the largest; in [0, 1].
    seed: per-request seed, in [-2**63, 2**64 - 1] (torch.Generator's range; a negative
        seed s seeds as its two's complement 2**64 + s); the same seed and prompt give the
        same tokens.
    max_tokens: most new tokens to generate; in [1, 2**63 - 1].
    stop_token_ids: tokens that end generation (kept in the output); in [0, 2**63 - 1].
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
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):  # NaN too
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not -1 <= self.top_k <= MAX_INT64:
            raise ValueError(f"top_k must be -1 (all) or in [0, 2**63 - 1], got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not MIN_INT64 <= self.seed <= MAX_UINT64:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        if not 1 <= self.max_tokens <= MAX_INT64:
            raise ValueError(f"max_tokens must be in [1, 2**63 - 1], got {self.max_tokens}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not 0 <= t <= MAX_INT64 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be in [0, 2**63 - 1], got {list(self.stop_token_ids)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are the argmax: temperature below GREEDY_TEMPERATURE. Every greedy
        decision (sampler, speculative acceptance, whether to seed a generator) reads this."""
        return self.temperature < GREEDY_TEMPERATURE
