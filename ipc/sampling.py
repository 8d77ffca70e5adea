"""Sampling parameters: one typed, validated object shared by the wire and the engine.

`SamplingParams` is a frozen msgspec Struct so that the same object travels from the client,
through the front process, to the scheduler without a second schema. It imports no torch.
Validation raises `ValueError` naming the field and the expected range.
"""

from __future__ import annotations

import math

import msgspec

from specd.ipc.structured import StructuredOutput

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
# Bounds OpenAI's API sets on its penalties and biases: beyond them a penalty or bias only
# forbids or forces tokens, which a bias of 100 already does (e^100 dwarfs any logit gap).
MAX_FREQUENCY_PENALTY = 2.0  # frequency_penalty and presence_penalty in [-2, 2]
MAX_LOGIT_BIAS = 100.0  # each bias in [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024  # entries in one request's logit_bias
MAX_TOKEN_ID = 2**31 - 1  # the socket protocol's bound on any token id


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
    repetition_penalty: > 0 (finite), 1 = none (transformers' rule): a token that occurs in
        the prompt or the generated tokens has its logit divided by it when positive,
        multiplied by it otherwise.
    frequency_penalty: in [-2, 2] (OpenAI's rule): subtracted from a token's logit once per
        time the token occurs in the generated tokens (the prompt does not count).
    presence_penalty: in [-2, 2] (OpenAI's rule): subtracted from a token's logit once if the
        token occurs in the generated tokens.
    logit_bias: token id -> bias added to its logit, at most 1024 entries, each bias finite
        in [-100, 100]; token ids in [0, 2**31 - 1] here and below the model's vocabulary
        size where the engine takes the request (`bad_request` otherwise).
    min_tokens: in [0, max_tokens]: until this many tokens are generated, the tokens that
        would end the request (the model's end-of-sequence tokens unless ignore_eos, and
        stop_token_ids) cannot be sampled (their logits are -inf). Stop strings still end it.
        Not with `structured` (its grammar decides where the output ends).
    prompt_logprobs: None, or in [0, 20]: the log-probability of every prompt token after
        the first under the model (given the tokens before it), with the n most likely
        alternatives, as `logprobs` reports output tokens (raw distribution). The prompt is
        then computed whole, not taken from the prefix cache.
    structured: a constraint the output must satisfy (ipc/structured.py: a JSON schema, any
        JSON object, a regex, a grammar, a choice, or tool calls in the model's format), or
        None. The engine masks every token the constraint does not allow before sampling
        (speculative drafts included), and refuses one it cannot compile (`bad_request`).

    The logits are changed in vLLM's order: the structured constraint's mask (disallowed
    tokens to -inf), then logit_bias, then repetition_penalty, then frequency_penalty and
    presence_penalty, then temperature, top-k, top-p and min-p. Greedy requests take the
    argmax of the changed logits; log-probabilities stay the raw model's.
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
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None

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
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got "
                             f"{self.min_tokens}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.prompt_logprobs}")
        if self.structured is not None and self.min_tokens > 0:
            # The grammar allows the end of sequence exactly where its output is complete;
            # forbidding it there would leave no token to sample.
            raise ValueError("min_tokens cannot be combined with structured: the "
                             "constraint decides where the output ends")
        self._check_penalties()

    def _check_penalties(self) -> None:
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_FREQUENCY_PENALTY <= value <= MAX_FREQUENCY_PENALTY:  # NaN too
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS_TOKENS} entries, "
                             f"got {len(self.logit_bias)}")
        for token_id, bias in self.logit_bias.items():
            if not 0 <= token_id <= MAX_TOKEN_ID:
                raise ValueError(
                    f"logit_bias token ids must be in [0, 2**31 - 1], got {token_id}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN too
                raise ValueError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are the argmax: temperature below GREEDY_TEMPERATURE. Every greedy
        decision (sampler, speculative acceptance, whether to seed a generator) reads this."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_history_penalties(self) -> bool:
        """Whether the logits depend on the tokens so far (repetition, frequency or presence
        penalty): such a request samples only once the host knows every earlier token."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def masks_stop_tokens(self) -> bool:
        """Whether min_tokens can forbid a token: it is set, and some token would end the
        request (the model's EOS unless ignore_eos; stop_token_ids)."""
        return self.min_tokens > 0 and (not self.ignore_eos or bool(self.stop_token_ids))

    @property
    def needs_its_tokens(self) -> bool:
        """Whether every sample depends on every earlier token of the request: its history
        penalties count them, or its structured constraint's grammar state follows them.
        Such a request samples only once the host knows them all (the engine runs whole
        steps while one runs)."""
        return self.has_history_penalties or self.structured is not None

    @property
    def changes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before temperature (any penalty
        or a logit bias); when no request in a batch does, that work is skipped."""
        # One expression, not has_history_penalties: the sampler reads this per row and step.
        return bool(self.logit_bias or self.repetition_penalty != 1.0
                    or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)
