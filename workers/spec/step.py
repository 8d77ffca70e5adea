"""A launched speculative step, and what the host reads of it.

`SpeculativeWorker.launch` leaves every result on the device and returns a `PendingSpec`;
`resolve()` is the host's only read of the step (after the next step is launched, with
overlap scheduling; at once in a whole step, `launch(batch).resolve()`): the sampled and
accepted tokens, the accepted nodes (acceptance figures, log-probabilities from the kept
logits) and the draft loop's checks (NaN, parents), which therefore fail the step when it
is resolved. Resolving changes nothing but the figures (`SpecFigures.record_verify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specd.workers.engine.batch import ModelOutput, ScheduledSequence, TokenLogprobs
from specd.workers.engine.sequence import Sequence as Seq
from specd.workers.runner import sampler
from specd.workers.runner.host_copy import HostCopy
from specd.workers.runner.model_runner import PendingOutput
from specd.workers.runner.prompt_logprobs import PendingPromptLogprobs
from specd.workers.spec.tree import check_parents


@dataclass
class SpecFigures:
    """Cumulative figures (mutable counters, owned by the worker; `record_verify` adds a
    verify pass). `requests`: per request (drafted, accepted) so far, for the requests the
    worker `track`s."""

    num_verify_passes: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)  # [num_steps]
    drafted_at_depth: list[int] = field(default_factory=list)  # [num_steps]
    draft_s: float = 0.0
    catch_up_s: float = 0.0
    verify_s: float = 0.0
    requests: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify pass: accepted drafts + 1 (0 before any pass)."""
        if not self.num_verify_passes:
            return 0.0
        return (self.num_accepted + self.num_verify_passes) / self.num_verify_passes

    def record_verify(self, request_id: str, num_drafted: int, num_accepted: int,
                      drafted_depths: set[int]) -> None:
        """One verify pass of `num_drafted` drafts at `drafted_depths` (1 = the root's
        children), `num_accepted` of them accepted."""
        self.num_verify_passes += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        for d in range(min(num_accepted, len(self.accepted_at_depth))):
            self.accepted_at_depth[d] += 1
        for d in drafted_depths:
            self.drafted_at_depth[d - 1] += 1
        if request_id in self.requests:
            drafted, accepted = self.requests[request_id]
            self.requests[request_id] = (drafted + num_drafted, accepted + num_accepted)

    def track(self, request_id: str) -> None:
        """Keep per-request figures for `request_id` from now on (no-op if kept already)."""
        self.requests.setdefault(request_id, (0, 0))

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def reset(self) -> None:
        """Zero every figure in place (after warm-up, whose drafts are not the workload);
        the per-depth lists keep their length, per-request figures are dropped."""
        self.num_verify_passes = self.num_drafted = self.num_accepted = 0
        self.accepted_at_depth[:] = [0] * len(self.accepted_at_depth)
        self.drafted_at_depth[:] = [0] * len(self.drafted_at_depth)
        self.draft_s = self.catch_up_s = self.verify_s = 0.0
        self.requests.clear()


@dataclass(frozen=True)
class HostTree:
    """A draft tree the host knows, node 0 the root: token ids, parents, depths and tree
    masks (`tree.DraftTree`'s rows as lists)."""

    token_ids: list[int]
    parents: list[int]
    depths: list[int]
    masks: list[int]


@dataclass(frozen=True)
class Verified:
    """The verify part of a launch (device tensors whose copies started at launch).

    num_accepted [V]; token_ids [V * (D + 1)] flat: the emitted tokens; nodes [V * D]
    flat: the accepted nodes; depths [V * T] flat: the verified trees' depths (figures);
    logits [V, T, vocab], kept when a sequence wants log-probabilities.
    """

    items: list[ScheduledSequence]
    num_accepted: HostCopy
    token_ids: HostCopy
    nodes: HostCopy
    depths: HostCopy
    depth: int  # D
    width: int  # T
    logits: torch.Tensor | None


@dataclass(frozen=True)
class Drafted:
    """The draft loop's part of a launch: the sequences drafted for (and the ids of the
    samples whose steps made their drafts: this one's), their trees [B * T] flat and the
    loop's NaN flags [B]."""

    seqs: list[Seq]
    sample_ids: list[int]
    token_ids: HostCopy
    parents: HostCopy
    depths: HostCopy
    tree_mask: HostCopy
    nan_rows: HostCopy
    width: int  # T

    def check(self) -> None:
        """ValueError if the drafts hold NaN log-probabilities or a dropped parent."""
        if any(self.nan_rows.values()):
            raise ValueError("draft log-probabilities contain NaN")
        check_parents(_rows(self.parents.values(), self.width))

    def host_trees(self) -> list[HostTree]:
        """The trees on the host, one per sequence (after `check`)."""
        columns = [_rows(c.values(), self.width)
                   for c in (self.token_ids, self.parents, self.depths, self.tree_mask)]
        return [HostTree(*tree) for tree in zip(*columns, strict=True)]


@dataclass
class PendingSpec:
    """A launched speculative step (see module docstring): plain rows sampled by the
    runner, verified trees, drafts for the next step, each present or not."""

    figures: SpecFigures
    plain: PendingOutput | None = None
    # Prompt rows of plain items in a verify step (a plain step's are in `plain`).
    prompt: PendingPromptLogprobs | None = None
    verified: Verified | None = None
    drafted: Drafted | None = None
    # Device tensors the draft stream reads: kept alive until the next step is launched
    # (which waits for the drafts), so the allocator cannot reuse them meanwhile.
    keep_alive: list[torch.Tensor] = field(default_factory=list)

    @property
    def speculates(self) -> bool:
        """Whether the step verified or drafted (else it ran as a plain step)."""
        return self.verified is not None or self.drafted is not None

    def resolve(self) -> ModelOutput:
        """The step's tokens, as the scheduler's `update` takes them. ValueError if the
        drafts this step made hold NaN log-probabilities or a dropped parent."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        prompt = {} if self.prompt is None else self.prompt.resolve()
        if self.plain is not None:
            plain = self.plain.resolve()
            sampled.update(plain.sampled)
            logprobs.update(plain.logprobs)
            prompt.update(plain.prompt_logprobs)
        if self.verified is not None:
            self._resolve_verified(self.verified, sampled, logprobs)
        if self.drafted is not None:
            self.drafted.check()
        return ModelOutput(sampled=sampled, logprobs=logprobs, prompt_logprobs=prompt)

    def _resolve_verified(self, v: Verified, sampled: dict[str, list[int]],
                          logprobs: dict[str, list[TokenLogprobs]]) -> None:
        accepted = v.num_accepted.values()
        tokens, nodes, depths = v.token_ids.values(), v.nodes.values(), v.depths.values()
        for b, (item, a) in enumerate(zip(v.items, accepted, strict=True)):
            seq = item.seq
            emitted = tokens[b * (v.depth + 1): b * (v.depth + 1) + a + 1]
            sampled[seq.request_id] = emitted
            k = item.num_new_tokens - 1
            self.figures.record_verify(seq.request_id, k, a,
                                       set(depths[b * v.width + 1: b * v.width + k + 1]))
            if seq.sampling.logprobs > 0 and v.logits is not None:
                path = [0, *nodes[b * v.depth: b * v.depth + a]]
                rows = torch.tensor(path, device=v.logits.device)
                logprobs[seq.request_id] = sampler.top_logprobs(
                    v.logits[b, rows], emitted, seq.sampling.logprobs)


def _rows(flat: list[int], width: int) -> list[list[int]]:
    return [flat[i: i + width] for i in range(0, len(flat), width)]
