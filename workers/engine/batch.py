"""What the scheduler hands the model runner for one step, and what comes back.

Both are plain data (no torch). The runner reads `ScheduledBatch`, builds its own tensors and
attention metadata, and returns `ModelOutput`; the scheduler's `update` consumes both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specd.workers.engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence in a step: compute tokens [start, start + num_new_tokens).

    Everything is fixed when the step is scheduled (the scheduler advances
    `seq.num_computed_tokens` at once, so the live count may have moved on): `start`, whether
    the step samples (`needs_sample`: it reaches the end of the sequence, placeholders of
    in-flight samples included), the id of that sample (`sample_id`, see
    `Sequence.pending_sample_ids`) and how many draft tokens it verifies (`num_drafts`).
    Built without them (tests, the runner's own callers), they are read from `seq` now.
    `seq.block_ids` already covers every token computed this step.

    `lagged_sample_id` (overlap scheduling of speculative steps): the step verifies the
    drafts that the step of that sample made on the device, and `start` is a lower bound:
    the true start is `start` plus that step's accepted drafts (at most `num_drafts`),
    which only the device knows when this step is launched, and at most `max_shift`.
    Blocks cover the upper bound.
    """

    seq: Sequence
    num_new_tokens: int
    start: int = -1
    needs_sample: bool = False
    sample_id: int | None = None
    num_drafts: int = -1
    lagged_sample_id: int | None = None
    max_shift: int = 0

    def __post_init__(self) -> None:
        if self.start < 0:
            seq = self.seq
            object.__setattr__(self, "start", seq.num_computed_tokens)
            object.__setattr__(self, "needs_sample", self.end >= seq.num_tokens
                               + seq.num_placeholders)
        if self.num_drafts < 0:
            object.__setattr__(self, "num_drafts", len(self.seq.spec_token_ids))

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


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
class PromptLogprobs:
    """Log-probabilities of prompt tokens `start`, `start + 1`, ... (start >= 1: the first
    prompt token has none), each given the tokens before it."""

    start: int
    logprobs: list[TokenLogprobs]


@dataclass(frozen=True)
class ModelOutput:
    """Per request id that needed a sample: the new token ids (one without speculation;
    accepted drafts plus the bonus token with it) and, if asked for, their log-probs.
    `prompt_logprobs`: per request that asked for them, those of the prompt rows the step
    computed (whether or not it sampled)."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


@dataclass(frozen=True)
class DraftTokenIds:
    """Drafts for each sequence's next verify, from the speculative worker to the scheduler
    (`Scheduler.update_draft_token_ids`, the one door for drafts).

    token_ids: request id -> draft token ids the host knows (a whole step read them).
    lagged: request id -> the sample id of the launched step that made its drafts on the
    device (overlap scheduling: the host knows only that there are `num_lagged` of them).
    """

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    lagged: dict[str, int] = field(default_factory=dict)
    num_lagged: int = 0
