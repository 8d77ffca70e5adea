"""Continuous batching: which tokens of which sequences one step computes (plain Python).

Each step has a token budget (`max_num_batched_tokens`). Running sequences come first, in
arrival order: each gets the tokens it is missing (one for plain decode, a chunk of its
prompt during chunked prefill, its last token plus its draft tokens with speculation).
Waiting sequences are then admitted first come, first served, while the budget, the cap on
running sequences (`max_num_seqs`) and the free blocks allow; a prompt larger than the
remaining budget is split across steps (chunked prefill).

When a running sequence needs a block and none is free, the most recently arrived running
sequence is preempted by recomputation: its blocks are freed (cached full blocks stay
reusable), its computed tokens drop to 0, and it goes back to the front of the waiting
queue. No new sequence is admitted in a step that preempted one.

Bookkeeping happens when a step is scheduled, not when its results come back (as vLLM's
async scheduling): `schedule` advances `num_computed_tokens` by the tokens it schedules and
gives each step that reaches the end of a sequence a sample id, kept in
`seq.pending_sample_ids` until `update` appends the sampled token. So the next step can be
scheduled before this one's results are known on the host (overlap scheduling): a sequence
with a pending sample has a placeholder token after its output, scheduled like any other
token and fed to the model as `placeholder_token_id(sample_id)`, which the runner resolves
on the device. A sequence whose pending samples would reach max_tokens or max_model_len is
not scheduled again until they are known. A result for a sequence that finished meanwhile
(a stop token in an earlier result, an abort) is dropped.

Speculation: a sequence with k = len(spec_token_ids) drafts is scheduled for
num_tokens + k - num_computed_tokens tokens. After the step, with a = len(sampled) - 1
accepted drafts, num_computed_tokens drops by the k - a rejected drafts: their slots are
simply written over later. This assumes the accepted drafts' KV sits in the slots
of positions num_tokens - 1 + 1 .. + a (a chain); with a draft tree, verification must move
the accepted path's KV there before `update`.

Overlap scheduling of speculation: a sequence whose drafts the step in flight made on the
device (`seq.lagged_sample_id`) is scheduled before that step's accepted count is known:
a verify of its drafts + 1 rows from the lower bound `num_tokens + num_placeholders - 1`,
which the device shifts by the accepted count (`ScheduledSequence.max_shift` bounds it).
While a verify is in flight `num_computed_tokens` counts all its drafts as accepted, so
the blocks appended cover the latest position the lagged verify can write; `update`
takes the rejected back as above. A lagged verify that does not fit the budget or
max_model_len at its latest start is not scheduled; its drafts are stale once the step
in flight is read.

A failed step (workers/engine/isolation.py): `reset_after_failure`, then `schedule_alone` runs
one sequence at a time to find the one that caused it.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass

from specd.workers.config import EngineConfig
from specd.workers.engine.batch import DraftTokenIds, ModelOutput, ScheduledBatch, ScheduledSequence
from specd.workers.engine.block_manager import BlockManager, BlockManagerStats
from specd.workers.engine.sequence import FinishReason, Sequence, SequenceStatus

log = logging.getLogger("specd.scheduler")


@dataclass(frozen=True)
class SchedulerStats:
    num_steps: int  # steps scheduled so far
    num_running: int
    num_waiting: int
    num_scheduled_seqs: int  # in the last step
    num_scheduled_tokens: int  # in the last step
    num_preemptions: int  # cumulative
    blocks: BlockManagerStats


class Scheduler:
    """Owns the waiting queue, the running list and the block manager."""

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        capacity = num_blocks * config.block_size
        if capacity < max_model_len:
            # A lone sequence of max_model_len tokens must fit, or it could never run.
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks x {config.block_size} = {capacity} "
                f"tokens, fewer than max_model_len ({max_model_len})")
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival (the order of `add`)
        self.sequences: dict[str, Sequence] = {}  # every unfinished sequence by request id
        self.arrival_index: dict[str, int] = {}
        self.num_added = 0
        self.num_steps = 0
        self.num_preemptions = 0  # each is also one log record (event "preemption")
        self.last_batch = ScheduledBatch(scheduled=[])
        self.num_samples = 0  # sample ids handed out so far

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. ValueError for a duplicate id or a prompt longer than
        max_model_len (a prompt of exactly max_model_len tokens gets one new token)."""
        if seq.request_id in self.sequences:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if seq.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {seq.request_id}: the prompt has {seq.num_prompt_tokens} tokens, "
                f"more than max_model_len ({self.max_model_len})")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_ids:
            raise ValueError(f"request {seq.request_id}: only a new sequence can be added, "
                             f"got {seq!r}")
        self.sequences[seq.request_id] = seq
        self.arrival_index[seq.request_id] = self.num_added
        self.num_added += 1
        self.waiting.append(seq)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT
              ) -> Sequence | None:
        """Finish a waiting or running sequence now with `reason` (abort, or error for the
        request a failed step is blamed on); None if it is unknown or already finished."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        self._remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self._release(seq)
        return seq

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_steps=self.num_steps,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_scheduled_seqs=len(self.last_batch.scheduled),
            num_scheduled_tokens=self.last_batch.num_tokens,
            num_preemptions=self.num_preemptions,
            blocks=self.block_manager.stats(),
        )

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work: running sequences first, then waiting ones (FCFS).

        Every scheduled sequence holds blocks for all the tokens it computes this step.
        Drafts that do not fit the budget or max_model_len are cut from the end of
        `seq.spec_token_ids`, so the runner must read the drafts after `schedule`.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted_ids: list[str] = []
        for seq in list(self.running):
            if budget == 0 or seq.status is not SequenceStatus.RUNNING:
                break  # out of budget, or seq itself was preempted (it was the last)
            if seq.awaits_its_last_sample(self.max_model_len):
                continue
            if seq.lagged_sample_id is not None:
                num_new = seq.num_lagged_drafts + 1
                if not self._lag_fits(seq, budget):
                    continue  # sits this step out; drafts again once its result is read
            else:
                num_new = self._num_tokens_to_run(seq, budget)
            while not self.block_manager.can_append_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted_ids.append(victim.request_id)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.append_slots(seq, num_new)
                scheduled.append(self._schedule_tokens(seq, num_new))
                budget -= num_new
        if not preempted_ids:
            scheduled += self._admit_waiting(budget)
        self.last_batch = ScheduledBatch(scheduled=scheduled, preempted_ids=preempted_ids)
        self.num_steps += 1
        return self.last_batch

    def _schedule_tokens(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        """Fix the step's view of `seq` and advance its bookkeeping (see module docstring)."""
        if seq.lagged_sample_id is not None:
            return self._schedule_lagged(seq, num_new)
        start = seq.num_computed_tokens
        needs_sample = start + num_new >= seq.num_tokens + seq.num_placeholders
        sample_id = self._new_sample(seq) if needs_sample else None
        seq.num_computed_tokens += num_new
        return ScheduledSequence(seq, num_new, start=start, needs_sample=needs_sample,
                                 sample_id=sample_id, num_drafts=len(seq.spec_token_ids))

    def _schedule_lagged(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        """A verify of drafts made on the device by the step in flight (see module
        docstring): it starts at the root that step's bonus token takes, the lower bound
        `num_tokens + num_placeholders - 1` plus the drafts it accepts (device only).

        `num_computed_tokens` is an upper bound while a verify is in flight (it counts
        every draft as accepted until `update` takes the rejected back), so advancing it
        by `num_new` makes `append_slots` cover the latest position this step can write.
        """
        start = seq.lagged_start
        max_shift = seq.num_computed_tokens - start  # the drafts the step in flight verifies
        sample_id = self._new_sample(seq)
        seq.num_computed_tokens += num_new
        return ScheduledSequence(seq, num_new, start=start, needs_sample=True,
                                 sample_id=sample_id, num_drafts=num_new - 1,
                                 lagged_sample_id=seq.lagged_sample_id, max_shift=max_shift)

    def _new_sample(self, seq: Sequence) -> int:
        """A new sample id, pending for `seq` until `update` takes its result."""
        sample_id = self.num_samples
        self.num_samples += 1
        seq.pending_sample_ids.append(sample_id)
        return sample_id

    def _lag_fits(self, seq: Sequence, budget: int) -> bool:
        """Whether a lagged verify fits the budget and, at its latest start (every draft
        in flight accepted: `num_computed_tokens` counts them so), max_model_len."""
        num_new = seq.num_lagged_drafts + 1
        return (budget >= num_new
                and seq.num_computed_tokens + num_new <= self.max_model_len)

    def update(self, batch: ScheduledBatch, output: ModelOutput) -> list[Sequence]:
        """Apply a step's results; return the sequences that got tokens or finished, in
        batch order.

        A sequence whose step sampled appends `output.sampled[request_id]` token by token,
        stopping at the first that ends it (tokens after it are dropped). A sequence that
        finished since `schedule` (abort, or a stop token in an earlier step's result) is
        skipped. A preempted sequence still takes its result (the token is valid; its KV is
        recomputed when it is admitted again).
        """
        changed: list[Sequence] = []
        for item in batch.scheduled:
            seq = item.seq
            if seq.is_finished:
                continue
            if not item.needs_sample:
                self.block_manager.cache_computed_blocks(seq)
                continue
            sampled = output.sampled.get(seq.request_id)
            if not sampled or len(sampled) > item.num_drafts + 1:
                raise ValueError(
                    f"request {seq.request_id}: expected 1 to {item.num_drafts + 1} sampled "
                    f"tokens (with {item.num_drafts} drafts), got {sampled}")
            if not seq.pending_sample_ids or seq.pending_sample_ids[0] != item.sample_id:
                raise ValueError(f"request {seq.request_id}: result for sample {item.sample_id} "
                                 f"out of order (pending {seq.pending_sample_ids})")
            seq.pending_sample_ids.pop(0)
            if seq.lagged_sample_id == item.sample_id:
                # No later step verifies the drafts this one made: they are stale now.
                seq.lagged_sample_id, seq.num_lagged_drafts = None, 0
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens -= item.num_drafts - (len(sampled) - 1)
                seq.spec_token_ids = []
            seq.append_tokens(sampled, self.eos_token_ids, self.max_model_len)
            self.block_manager.cache_computed_blocks(seq)
            if seq.is_finished:
                self._remove(seq)
                self._release(seq)
            changed.append(seq)
        return changed

    def update_draft_token_ids(self, drafts: DraftTokenIds) -> None:
        """Take the drafts for each sequence's next verify (the one door for drafts): token
        ids the host knows become `seq.spec_token_ids`; drafts left on the device by a
        launched step make the sequence lagged (see the module docstring). Sequences that
        are no longer running (finished, aborted, preempted) are skipped."""
        for request_id, token_ids in drafts.token_ids.items():
            seq = self.sequences.get(request_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                seq.spec_token_ids = list(token_ids)
        for request_id, sample_id in drafts.lagged.items():
            seq = self.sequences.get(request_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                seq.lagged_sample_id, seq.num_lagged_drafts = sample_id, drafts.num_lagged

    def drop_lagged_drafts(self) -> None:
        """Forget every device-side draft (the engine leaves overlapped speculation: the
        next step of each sequence runs from what the host knows)."""
        for seq in self.running:
            seq.lagged_sample_id, seq.num_lagged_drafts = None, 0

    def _remove(self, seq: Sequence) -> None:
        """Take a sequence out of the running list or (preempted) the waiting queue."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def _num_tokens_to_run(self, seq: Sequence, budget: int) -> int:
        """Tokens to compute for a running sequence, trimming drafts (and prefill chunks) to
        the budget and drafts to max_model_len. Drafts are kept as a prefix, so a draft tree
        listed parents first stays a tree."""
        num_missing = seq.num_tokens + seq.num_placeholders - seq.num_computed_tokens
        max_drafts = max(0, min(self.max_model_len - seq.num_tokens - seq.num_placeholders,
                                budget - num_missing))
        if len(seq.spec_token_ids) > max_drafts:
            seq.spec_token_ids = seq.spec_token_ids[:max_drafts]
        return min(budget, num_missing + len(seq.spec_token_ids))

    def _admit_waiting(self, budget: int) -> list[ScheduledSequence]:
        admitted: list[ScheduledSequence] = []
        while (self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs
               and not self.waiting[0].pending_sample_ids  # preempted, result not back yet
               and self.block_manager.can_allocate(self.waiting[0])):
            item = self._admit(self.waiting.popleft(), budget)
            admitted.append(item)
            budget -= item.num_new_tokens
        return admitted

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSequence:
        """Give a waiting sequence (out of the queue already) its blocks and a first chunk."""
        num_cached = self.block_manager.allocate(seq)
        seq.num_computed_tokens = num_cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: self.arrival_index[s.request_id])
        return self._schedule_tokens(seq, min(budget, seq.num_tokens - num_cached))

    def reset_after_failure(self) -> None:
        """Forget every step scheduled and not applied (a step raised): pending samples and
        drafts are dropped, every running sequence is preempted (its output is kept and
        recomputed) and the prefix cache starts empty (figures too), since the failed step
        may have left KV half written in blocks registered for reuse."""
        for seq in reversed(list(self.running)):  # latest first: the queue keeps arrival order
            self._preempt(seq, cause="step_failed")
        for seq in self.sequences.values():
            seq.pending_sample_ids, seq.spec_token_ids = [], []
            seq.lagged_sample_id, seq.num_lagged_drafts = None, 0
        old = self.block_manager
        if old.num_free_blocks != old.num_blocks:
            raise ValueError(f"after preempting every sequence {old.num_free_blocks} of "
                             f"{old.num_blocks} blocks are free")
        self.block_manager = BlockManager(old.num_blocks, old.block_size,
                                          old.enable_prefix_caching)

    def schedule_alone(self, request_id: str) -> ScheduledBatch:
        """A step for one sequence only (isolating a failed step, none in flight): running
        ones are preempted, latest first, when it needs their blocks (max_num_seqs is not
        checked: it admits only a sequence that a failed step had running)."""
        seq = self.sequences[request_id]
        budget = self.config.max_num_batched_tokens
        is_waiting = seq.status is SequenceStatus.WAITING
        num_new = 0 if is_waiting else self._num_tokens_to_run(seq, budget)
        preempted_ids: list[str] = []
        while not (self.block_manager.can_allocate(seq) if is_waiting
                   else self.block_manager.can_append_slots(seq, num_new)):
            victims = [s for s in self.running if s is not seq]
            if not victims:
                raise ValueError(f"request {request_id} does not fit the KV cache alone")
            self._preempt(victims[-1], cause="isolation")
            preempted_ids.append(victims[-1].request_id)
        if is_waiting:
            self.waiting.remove(seq)
            item = self._admit(seq, budget)
        else:
            self.block_manager.append_slots(seq, num_new)
            item = self._schedule_tokens(seq, num_new)
        self.last_batch = ScheduledBatch(scheduled=[item], preempted_ids=preempted_ids)
        self.num_steps += 1
        return self.last_batch

    def _preempt(self, seq: Sequence, cause: str = "no_free_block") -> None:
        """Preempt by recomputation: free the blocks, requeue at the front; one record."""
        num_computed = seq.num_computed_tokens
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.lagged_sample_id, seq.num_lagged_drafts = None, 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.info("preempted %s (%s)", seq.request_id, cause, extra={
            "event": "preemption", "request_id": seq.request_id, "cause": cause,
            "step": self.num_steps, "num_tokens": seq.num_tokens,
            "num_computed_tokens": num_computed, "num_preemptions": seq.num_preemptions,
            "num_free_blocks": self.block_manager.num_free_blocks})

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        del self.sequences[seq.request_id]
        del self.arrival_index[seq.request_id]
