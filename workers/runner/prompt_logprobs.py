"""The prompt's log-probabilities (`SamplingParams.prompt_logprobs`), computed where the
prompt's rows are: each row of a prompt chunk gives the distribution of the next prompt
token.

A step computes tokens [start, end) of a sequence; row p (position p) predicts token
p + 1, so the rows p in [start, min(end, P - 1)) (P prompt tokens) give the log-probabilities
of prompt tokens start + 1 ... The last prompt row predicts the first output token: that
is the sampling row, reported as output logprobs. Logits are computed in slices of
`ROWS_PER_SLICE` rows (a prompt chunk may have thousands of rows and the vocabulary
hundreds of thousands of entries) and reduced at once on the device to what is reported:
the prompt token's log-probability and the top-n (sampler.top_logprob_tensors, the output
logprobs' own rule); the host reads them when the step resolves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specd.workers.engine.batch import PromptLogprobs, ScheduledSequence, TokenLogprobs
from specd.workers.runner.host_copy import upload
from specd.workers.runner.sampler import top_logprob_tensors

ROWS_PER_SLICE = 64
ComputeLogits = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Rows:
    """One sequence's share: tokens `start`... of its prompt, their log-probabilities [R]
    and top-n values and ids [R, n] on the device."""

    request_id: str
    start: int
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor


@dataclass(frozen=True)
class PendingPromptLogprobs:
    """A step's prompt log-probabilities, on the device until `resolve`."""

    rows: list[_Rows]

    def resolve(self) -> dict[str, PromptLogprobs]:
        out = {}
        for r in self.rows:
            chosen, values, ids = r.chosen.tolist(), r.top_values.tolist(), r.top_ids.tolist()
            out[r.request_id] = PromptLogprobs(r.start, [
                TokenLogprobs(c, i, v) for c, i, v in zip(chosen, ids, values, strict=True)])
        return out


def prompt_rows(item: ScheduledSequence) -> range:
    """The positions of `item`'s rows that predict a prompt token (empty for a request that
    did not ask)."""
    seq = item.seq
    if not seq.wants_prompt_logprobs:
        return range(0)
    return range(item.start, min(item.end, seq.num_prompt_tokens - 1))


def launch_prompt_logprobs(compute_logits: ComputeLogits, items: Sequence[ScheduledSequence],
                           hidden: Sequence[torch.Tensor]) -> PendingPromptLogprobs | None:
    """The prompt log-probabilities of `items` (hidden[i]: item i's rows [num_new, H], in
    position order); None when none asked or none of their rows predicts a prompt token."""
    out = []
    for item, rows in zip(items, hidden, strict=True):
        positions = prompt_rows(item)
        if not positions:
            continue
        seq = item.seq
        wanted = rows[positions.start - item.start: positions.stop - item.start]
        targets = seq.prompt_token_ids[positions.start + 1: positions.stop + 1]
        target_ids = upload(torch.tensor(targets, dtype=torch.int64), rows.device)
        num_top = seq.sampling.prompt_logprobs or 0
        parts = [top_logprob_tensors(compute_logits(wanted[i: i + ROWS_PER_SLICE]).float(),
                                     target_ids[i: i + ROWS_PER_SLICE], num_top)
                 for i in range(0, len(positions), ROWS_PER_SLICE)]
        out.append(_Rows(seq.request_id, positions.start + 1,
                         torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                         torch.cat([p[2] for p in parts])))
    return PendingPromptLogprobs(out) if out else None


def item_rows(items: Sequence[ScheduledSequence], hidden: torch.Tensor) -> list[torch.Tensor]:
    """hidden [N, H] of a step in the batch's row layout, cut into each item's rows."""
    out, offset = [], 0
    for item in items:
        out.append(hidden[offset: offset + item.num_new_tokens])
        offset += item.num_new_tokens
    return out
