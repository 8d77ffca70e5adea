"""A request's state inside the scheduler process (plain Python, no torch).

There are no prefill and decode phases: a sequence tracks `num_computed_tokens` (tokens
whose KV is in the cache) against `num_tokens` (prompt + output). A step computes some of
the missing tokens; when it reaches the end, the last position's logits give the next
token. Draft tokens (speculation) extend the tokens to compute; rejecting them is one
subtraction of `num_computed_tokens`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection, Iterable

from specd.ipc.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_tokens or the model's maximum length
    ABORT = "abort"  # aborted by the client or the operator
    ERROR = "error"  # a step failed because of this request (workers/engine/isolation.py)


class Sequence:
    """One request. All state is assigned here; nothing is added later."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: the prompt has no tokens")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        # Read by every step's overlap decision (`any_counts_its_tokens`): decided once,
        # but for min_tokens, whose mask needs the count only until it is reached.
        self._needs_its_tokens = sampling.needs_its_tokens
        self._masks_stop_tokens = sampling.masks_stop_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache
        self.block_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        # Draft tokens proposed for the next verify step (speculation); empty otherwise.
        self.spec_token_ids: list[int] = []
        # Samples scheduled but not yet known on the host, oldest first (overlap scheduling:
        # the device resolves them; see scheduler.py). Each is a placeholder token after
        # the output tokens, fed to the model as `placeholder_token_id(sample_id)`.
        self.pending_sample_ids: list[int] = []
        # Overlap scheduling of speculative steps: drafts for this sequence's next verify
        # that the step in flight made on the device (spec/futures.py), known to the host
        # only by the id of that step's sample and their number. None/0 when there are none.
        self.lagged_sample_id: int | None = None
        self.num_lagged_drafts = 0

    @property
    def counts_its_tokens(self) -> bool:
        """Whether this sequence's sampling depends on its earlier tokens: penalties, a
        structured constraint, or a min_tokens mask not yet lifted
        (workers/runner/min_tokens.py)."""
        return self._needs_its_tokens or (
            self._masks_stop_tokens and self.num_output_tokens < self.sampling.min_tokens)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The request asked for its prompt's log-probabilities (its prompt is computed
        whole, not taken from the prefix cache)."""
        return self.sampling.prompt_logprobs is not None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_placeholders(self) -> int:
        return len(self.pending_sample_ids)

    @property
    def num_unknown_tokens(self) -> int:
        """While a step samples for this sequence: the tokens before the one it samples
        that the host does not know yet (the samples of steps still in flight; the step's
        own sample is the last pending one). Penalties need 0."""
        return max(0, self.num_placeholders - 1)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def lagged_start(self) -> int:
        """The lower bound of a lagged verify's start: every draft in flight rejected."""
        return self.num_tokens + self.num_placeholders - 1

    def awaits_its_last_sample(self, max_model_len: int) -> bool:
        """Pending samples already reach max_tokens or max_model_len: nothing more to run."""
        n = self.num_placeholders
        return n > 0 and (self.num_output_tokens + n >= self.sampling.max_tokens
                          or self.num_tokens + n >= max_model_len)

    def append_tokens(self, token_ids: list[int], eos_token_ids: Collection[int],
                      max_model_len: int) -> None:
        """Append sampled tokens one by one; stop at the first that finishes the sequence
        (status FINISHED, reason length or stop; the tokens after it are dropped).

        The length limits are checked before the stop tokens, as vLLM and SGLang do."""
        params = self.sampling
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
                self.status, self.finish_reason = SequenceStatus.FINISHED, FinishReason.LENGTH
            elif ((token_id in eos_token_ids and not params.ignore_eos)
                  or token_id in params.stop_token_ids):
                self.status, self.finish_reason = SequenceStatus.FINISHED, FinishReason.STOP
            if self.is_finished:
                # Dropped tokens were never fed back; no KV past the last kept token is valid.
                self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)
                return

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")


def any_counts_its_tokens(seqs: Iterable[Sequence]) -> bool:
    """Whether some sequence's sampling counts its earlier tokens (repetition, frequency or
    presence penalty, a structured constraint's grammar state; min_tokens not yet reached).
    Those samples need every earlier token on the host, so while such a sequence runs the
    workers run whole steps (no overlap, no lagged verify)."""
    return any(s.counts_its_tokens for s in seqs)


def placeholder_token_id(sample_id: int) -> int:
    """The input id standing for the token of sample `sample_id` (negative, so it can never
    be a real token): the runner replaces it on the device with the sampled token."""
    return -1 - sample_id
