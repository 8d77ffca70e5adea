"""What the scheduler hands the model runner for one step, and what comes back.

Both are plain data (no torch). The runner reads `ScheduledBatch`, builds its own tensors and
attention metadata, and returns `ModelOutput`; the scheduler's `update` consumes both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specd.workers.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence in a step: compute tokens [num_computed_tokens, + num_new_tokens).

    `seq.block_ids` already covers every token computed this step. When the step reaches the
    end of the sequence (`needs_sample`), the runner samples the next token from the logits
    of the last computed position.
    """

    seq: Sequence
    num_new_tokens: int

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def end(self) -> int:
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def needs_sample(self) -> bool:
        return self.end >= self.seq.num_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work, in the order the runner lays tokens out (running first, then new)."""

    scheduled: list[ScheduledSequence]
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the chosen token and the top-n alternatives (ids, logprobs)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class ModelOutput:
    """Per request id that needed a sample: the new token ids (one without speculation;
    accepted drafts plus the bonus token with it) and, if asked for, their log-probs."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
