"""`SpeculativeWorker`: EAGLE-3 drafting and verification around the `ModelRunner`.

One pipeline for every step (as the runner's `launch`/`execute`): `launch(batch)` runs the
whole step on the device and returns a pending step whose `resolve()` is the host's only
read of it; a synchronous step is `launch(batch).resolve()` (`execute`). A step:

1. **Forward and verify** (verify.py): one target pass over plain rows and draft trees,
   acceptance and KV compaction on the device. Drafts come from the scheduler, as token
   ids the host knows (`seq.spec_token_ids`) or as drafts the step in flight left on the
   device (lagged, overlap scheduling).
2. **Sample** the plain rows that reach their end (the runner's `sample`).
3. **Catch up and draft** (drafting.py) on the draft stream: the draft K/V of every
   verified sequence's accepted path, and, while the controller speculates, of every
   speculative plain row whose kept aux rows reach its end; then the next trees of all of
   them, left on the device (`DraftFutures`, under this step's sample ids).

A step without drafts to verify or make is the runner's own plain step (backends' fast
paths, the CPU's compiled decode and kept K/V included), of which the worker keeps the aux
rows (the whole cost of speculation while it is off).

How drafts reach the next step is the caller's choice, through the scheduler's one door
(`take_draft_token_ids` -> `Scheduler.update_draft_token_ids`): overlapped, right after
launch, as drafts on the device known by sample id (the next verify is scheduled lagged
and completed on the device); in whole steps, once the step is resolved, as token ids read
on the host (the next verify is scheduled exactly; the worker keeps the trees' shapes).

Per request the worker keeps the aux rows whose draft K/V is not written yet ("pending",
positions [num_draft_computed, num_draft_computed + P)), written at its next catch-up.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from specd.workers.config import EngineConfig
from specd.workers.engine.batch import DraftTokenIds, ModelOutput, ScheduledBatch, ScheduledSequence
from specd.workers.engine.sequence import Sequence as Seq
from specd.workers.engine.sequence import SequenceStatus, any_counts_its_tokens
from specd.workers.runner.host_copy import upload
from specd.workers.runner.model_runner import ModelRunner
from specd.workers.spec.controller import SpecController, SpecEvent
from specd.workers.spec.draft_head import Eagle3Head
from specd.workers.spec.drafting import Drafter, PlainRows, VerifiedRows
from specd.workers.spec.futures import DraftFutures
from specd.workers.spec.step import Drafted, HostTree, PendingSpec, SpecFigures
from specd.workers.spec.streams import DraftStreams
from specd.workers.spec.verify import Verifier, verifies
from specd.workers.structured.outputs import StructuredOutput

__all__ = ["SpecFigures", "SpeculativeWorker", "verify_query_len"]


@dataclass
class _RequestState:
    """Per request: pending aux rows [P, 3 * target_hidden] for positions
    [num_draft_computed, num_draft_computed + P)."""

    num_draft_computed: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_pending(self) -> int:
        return sum(p.shape[0] for p in self.pending)


class SpeculativeWorker:
    """Wraps `runner` (built with the head's capture layers) with an EAGLE-3 `head`; the
    engine's step worker (plain_worker.StepWorker) when a draft model is loaded. Constrained
    rows, verified trees included, are masked by `structured`.

    All state is assigned here; the draft KV cache is allocated here (one layer, the target's
    block count and block size). ValueError if the head does not fit the target.
    """

    speculative = True

    def __init__(self, config: EngineConfig, runner: ModelRunner, head: Eagle3Head,
                 controller: SpecController, structured: StructuredOutput) -> None:
        cfg = head.config
        target = runner.model_config
        if cfg.target_hidden_size != target.hidden_size:
            raise ValueError(f"draft model: target_hidden_size {cfg.target_hidden_size} does not "
                             f"match the target's hidden_size {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"draft model: vocab_size {cfg.vocab_size} does not match the "
                             f"target's vocab_size {target.vocab_size}")
        if len(runner.capture_layers) != 3:
            raise ValueError(f"the runner must capture 3 hidden states for EAGLE-3, it captures "
                             f"{list(runner.capture_layers)}")
        if config.spec_topk * config.spec_num_steps > 64:
            raise ValueError("spec_topk * spec_num_steps must be <= 64 (tree mask bits), got "
                             f"{config.spec_topk} * {config.spec_num_steps}")
        self.config = config
        self.runner = runner
        self.head = head
        self.controller = controller
        self.structured = structured
        self.device = runner.device
        self.num_steps = config.spec_num_steps
        self.num_draft_tokens = verify_query_len(config)
        self.draft_kv = torch.zeros(
            cfg.kv_layer_shape(runner.num_kv_blocks, config.block_size),
            dtype=next(head.parameters()).dtype, device=self.device)
        self.states: dict[str, _RequestState] = {}
        # The tree shapes of drafts handed to the scheduler as token ids (whole steps).
        self.trees: dict[str, HostTree] = {}
        self.streams = DraftStreams(self.device)  # drafting beside the main stream
        self.figures = SpecFigures(accepted_at_depth=[0] * self.num_steps,
                                   drafted_at_depth=[0] * self.num_steps)
        # What a step leaves on the device for the next one (overlap scheduling).
        self.futures = DraftFutures(runner.future_tokens.shape[0], self.num_draft_tokens,
                                    self.device)
        self.verifier = Verifier(runner, self.futures, config.spec_topk, self.num_steps,
                                 self.num_draft_tokens)
        # Last: the draft loop's runner (captured graphs read everything above).
        self.drafter = Drafter(runner, head, self.draft_kv, self.futures, config.spec_topk,
                               self.num_steps, self.num_draft_tokens)
        self._drafted: Drafted | None = None  # the last launched step's drafts, until taken
        # The last launched step and its plain rows that sample (drafted for late when
        # speculation turns on: `update_controller`).
        self._last: tuple[PendingSpec, list[ScheduledSequence]] | None = None

    # --- steps ------------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one whole step: `launch(batch).resolve()`."""
        return self.launch(batch).resolve()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> PendingSpec:
        """Launch one step (see module docstring): nothing is read on the host. Reads drafts
        from the batch as `schedule` left them."""
        self._drop_preempted(batch)
        self._drafted = None
        if any(verifies(s) for s in batch.scheduled):
            pending = self._launch_verify(batch)
        else:
            pending = self._launch_plain(batch)
        self._last = (pending, [s for s in batch.scheduled
                                if s.needs_sample and not verifies(s)])
        return pending

    def _launch_plain(self, batch: ScheduledBatch) -> PendingSpec:
        """A step without trees: the runner's own, its aux rows kept, drafts made after it."""
        pending = PendingSpec(self.figures, plain=self.runner.launch(
            batch, self.structured.start_masks(batch, self.trees)))
        if batch.is_empty:
            return pending
        aux = self.runner.last_aux_hidden
        if aux is None:
            raise ValueError("the target returned no aux hidden states")
        row = 0
        for s in batch.scheduled:
            self._keep_aux(s.seq, s.start, aux[row: row + s.num_new_tokens])
            row += s.num_new_tokens
        to_draft = self._to_draft(batch.scheduled)
        if to_draft:
            self._catch_up_and_draft(pending, None, to_draft)
        return pending

    def _launch_verify(self, batch: ScheduledBatch) -> PendingSpec:
        """A step that verifies trees (and runs plain rows beside them)."""
        t0 = time.perf_counter()
        items = list(batch.scheduled)
        # Constrained rows' masks (every node of their trees) fill beside the forward.
        masks = self.structured.start_masks(batch, self.trees)
        verifier = self.verifier
        shift = verifier.shifts(items)  # [len(items)] on the device
        self.streams.wait_for_drafts()  # the verify reads what the draft stream wrote
        rows = verifier.forward(items, shift, self.trees)
        plain = [i for i, s in enumerate(items) if not verifies(s)]
        verify = [i for i, s in enumerate(items) if verifies(s)]
        for i in plain:
            self._keep_aux(items[i].seq, items[i].start, rows[i].aux)
        pending = PendingSpec(self.figures, prompt=self.runner.prompt_logprobs(
            [items[i] for i in plain], [rows[i].hidden for i in plain]))
        sampling = [i for i in plain if items[i].needs_sample]
        if sampling:
            last = torch.stack([rows[i].hidden[-1] for i in sampling])
            logits = self.runner.model.compute_logits(last).float()  # [M, vocab]
            pending.plain = self.runner.sample(
                logits, [items[i].seq for i in sampling],
                [-1 if items[i].sample_id is None else items[i].sample_id for i in sampling],
                masks)
        verified = [items[i] for i in verify]
        index = upload(torch.tensor(verify, dtype=torch.int64), self.device)
        pending.verified, acc, root = verifier.verify(
            verified, [rows[i].hidden for i in verify], shift[index], self.trees, masks)
        self.figures.verify_s += time.perf_counter() - t0
        depth = acc.accepted_nodes.shape[1]
        caught_up = VerifiedRows(
            items=verified, aux=[rows[i].aux for i in verify],
            own_depths=[verifier.own_depth(s, depth, self.trees) for s in verified],
            acc=acc, root=root, shift=shift[index])
        self._catch_up_and_draft(pending, caught_up,
                                 self._to_draft([items[i] for i in plain]))
        return pending

    def _to_draft(self, items: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """The plain items drafted for in this step: while the controller speculates, those
        that sample and whose aux rows now reach their end (prefill ended, plain decode)."""
        if not self.controller.enabled:
            return []
        return [s for s in items if s.needs_sample and s.seq.status is SequenceStatus.RUNNING
                and self.aux_reaches(s.seq, s.end)]

    def _catch_up_and_draft(self, pending: PendingSpec, verified: VerifiedRows | None,
                            plain: list[ScheduledSequence]) -> None:
        """On the draft stream: catch up `verified` (always: the draft K/V of their accepted
        paths) and `plain`, then, while the controller speculates, draft for all of them."""
        t0 = time.perf_counter()
        rows = []
        for s in plain:
            state = self.states[s.seq.request_id]
            rows.append(PlainRows(s, state.num_draft_computed, state.pending))
            state.num_draft_computed, state.pending = s.end, []
        if verified is not None:
            for s in verified.items:
                # Written up to the new root, which the host learns when the step is
                # resolved: until then `start` (a later plain row restarts the record).
                verified_state = self.states.get(s.seq.request_id)
                if verified_state is not None:
                    verified_state.num_draft_computed, verified_state.pending = s.start, []
        # Plain rows' next verifies start where the host knows (nothing accepted).
        sample_ids = [s.sample_id or 0 for s in plain]
        if sample_ids:
            self.futures.write_accepted(self.futures.index(sample_ids, self.device),
                                        torch.zeros(len(plain), dtype=torch.int64,
                                                    device=self.device))
        with self.streams.drafting():
            self.streams.reads([t for r in rows for t in r.aux] + ([] if verified is None else [
                *verified.aux, verified.acc.num_accepted, verified.acc.accepted_nodes,
                verified.acc.token_ids, verified.root, verified.shift]))
            caught_up = self.drafter.catch_up(verified, rows)
            t1 = time.perf_counter()
            self.figures.catch_up_s += t1 - t0
            pending.keep_alive += caught_up.keep_alive
            if self.controller.enabled:
                pending.drafted, keep_alive = self.drafter.draft(caught_up)
                pending.keep_alive += keep_alive
                self._drafted = pending.drafted
        self.figures.draft_s += time.perf_counter() - t1

    def can_overlap(self, in_flight: PendingSpec | None, running: Sequence[Seq]) -> bool:
        """Whether the next step can be launched before `in_flight` is resolved. Not while
        speculation is off and the step in flight drafted on the device (the verifies of
        those drafts could not be scheduled without drafting again), nor while drafts the
        host knows wait (a whole step verifies them), nor while a running request has
        penalties or a structured constraint (every token they count must be on the host:
        `any_counts_its_tokens`)."""
        if any_counts_its_tokens(running):
            return False
        if self.controller.enabled:
            return True
        if in_flight is not None and in_flight.drafted is not None:
            return False
        return not any(s.spec_token_ids for s in running)

    def ran_speculating(self, pending: PendingSpec, overlapped: bool) -> bool:
        """The state a resolved step ran in; read before `update_controller`. A whole step
        ran in the controller's state; an overlapped one was launched before the last
        decision, so what it did tells (whether it verified or drafted)."""
        return pending.speculates if overlapped else self.controller.enabled

    def take_draft_token_ids(self, on_device: bool) -> DraftTokenIds:
        """The drafts made for the last launched step's sequences, once, for the scheduler's
        one door (`update_draft_token_ids`); none if it made none or speculation is off now
        (the sequences decode plainly next).

        Call after the controller's decision for the next step (`update_controller`).
        on_device (overlap scheduling: that step may still be in flight): they stay on the
        device, known by the sample id of that step. Else (that step is resolved and the
        scheduler has applied it): their token ids, read on the host (ValueError for NaN
        drafts or a dropped parent); the worker keeps the trees' shapes for their verify.
        A constrained sequence whose grammar forces its next tokens drafts those instead,
        as a chain, unless its tree already holds them as a path (`StructuredOutput.
        forced_drafts`: the head drafts without the grammar, which forces tokens it would
        not guess). Sequences released meanwhile are left out."""
        drafted, self._drafted = self._drafted, None
        if drafted is None or not self.controller.enabled:
            return DraftTokenIds()
        if on_device:
            return DraftTokenIds(
                lagged={s.request_id: i for s, i in zip(drafted.seqs, drafted.sample_ids,
                                                         strict=True)},
                num_lagged=self.num_draft_tokens - 1)
        drafted.check()
        token_ids: dict[str, list[int]] = {}
        for seq, tree in zip(drafted.seqs, drafted.host_trees(), strict=True):
            if seq.request_id in self.states:
                forced = self.structured.forced_drafts(seq.request_id, self.num_steps)
                if forced and not _holds_path(tree, forced):
                    tree = chain_host_tree(tree.token_ids[0], forced)
                self.trees[seq.request_id] = tree
                token_ids[seq.request_id] = tree.token_ids[1:]
        return DraftTokenIds(token_ids=token_ids)

    # --- per request ------------------------------------------------------------------

    def update_controller(self, batch_size: int) -> SpecEvent | None:
        """Decide whether the coming steps draft (the engine logs the event); call after the
        scheduler's `update` of a step. Turned on, speculation drafts at once for the last
        launched step's plain rows, as that step would have with it on, so that the next
        step verifies (`take_draft_token_ids`) instead of drafting first."""
        event = self.controller.update(batch_size)
        if event is not None and event.enabled and self._last is not None:
            pending, plain = self._last
            to_draft = self._to_draft(plain)
            if pending.drafted is None and to_draft:
                with torch.inference_mode():
                    self._catch_up_and_draft(pending, None, to_draft)
        return event

    def aux_reaches(self, seq: Seq, end: int) -> bool:
        """Whether `seq` may speculate and its kept aux rows (some not caught up yet) cover
        exactly positions [0, end): then it can be drafted for from position `end`."""
        state = self.states.get(seq.request_id)
        return (seq.sampling.speculative and state is not None and state.num_pending > 0
                and state.num_draft_computed + state.num_pending == end)

    def _keep_aux(self, seq: Seq, start: int, rows: torch.Tensor) -> None:
        """Record aux rows [n, 3H] for positions [start, start + n) of `seq` (its draft K/V
        is written at the next catch-up). Rows at or after `start` kept earlier are stale
        (preemption, recompute) and dropped; a gap (prefix-cache hit, a verify whose new
        root only the device knew) restarts the record."""
        if not seq.sampling.speculative:
            return
        state = self.states.get(seq.request_id)
        if state is None:
            state = self.states[seq.request_id] = _RequestState()
            self.figures.track(seq.request_id)
        known_end = state.num_draft_computed + state.num_pending
        if start < state.num_draft_computed or start > known_end:
            state.num_draft_computed, state.pending = start, []
        elif start < known_end:
            keep = start - state.num_draft_computed
            state.pending = [torch.cat(state.pending)[:keep]] if keep else []
        state.pending.append(rows)

    def request_figures(self, request_id: str) -> tuple[int, int]:
        """(drafted, accepted) so far for a request; (0, 0) if unknown."""
        return self.figures.requests.get(request_id, (0, 0))

    def _drop_preempted(self, batch: ScheduledBatch) -> None:
        """The batch's preempted requests lost their KV: drop their pending rows and tree."""
        for request_id in batch.preempted_ids:
            self.drop_pending(request_id)

    def drop_pending(self, request_id: str) -> None:
        """A preempted request: its KV is gone, so are its pending rows and tree (its
        figures and its sampling generator stay)."""
        state = self.states.get(request_id)
        if state is not None:
            state.num_draft_computed, state.pending = 0, []
        self.trees.pop(request_id, None)

    def reset_after_failure(self, request_ids: Iterable[str]) -> None:
        """A step failed and the scheduler was reset (every sequence is recomputed): the
        failed step's drafts are dropped, so are the pending rows and trees of
        `request_ids`, and the runner's kept decode K/V."""
        self._drafted = None
        for request_id in request_ids:
            self.drop_pending(request_id)
        self.runner.invalidate_decode_stage()

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request: its pending rows, tree and figures."""
        self.states.pop(request_id, None)
        self.trees.pop(request_id, None)
        self.figures.forget(request_id)
        self.runner.release(request_id)

    # --- status -----------------------------------------------------------------------

    def graphs_status(self) -> str:
        """The target's backend (captured graphs, compiled CPU steps) and the draft loop's
        ("off" when nothing is captured or compiled)."""
        parts = [self.runner.backend.status()]
        if self.drafter.loop_runner.status():
            parts.append(self.drafter.loop_runner.status())
        return " | ".join(parts)

    @property
    def graph_memory_bytes(self) -> int:
        """The target's and the draft loop's captured graphs."""
        return self.runner.backend.memory_bytes + self.drafter.loop_runner.memory_bytes


def chain_host_tree(root: int, drafts: list[int]) -> HostTree:
    """The HostTree of a chain: `root`, then `drafts`, node i the parent of node i + 1."""
    num_nodes = len(drafts) + 1
    return HostTree(token_ids=[root, *drafts], parents=list(range(-1, num_nodes - 1)),
                    depths=list(range(num_nodes)),
                    masks=[(1 << (i + 1)) - 1 for i in range(num_nodes)])


def _holds_path(tree: HostTree, tokens: list[int]) -> bool:
    """Whether `tree` has a path from its root whose tokens start with `tokens`."""
    node = 0
    for token in tokens:
        child = next((c for c in range(node + 1, len(tree.parents))
                      if tree.parents[c] == node and tree.token_ids[c] == token), None)
        if child is None:
            return False
        node = child
    return True


def verify_query_len(config: EngineConfig) -> int:
    """Rows one sequence verifies: the root and its drafts. A chain verifies all its
    drafts; a tree keeps the best spec_num_draft_tokens - 1 nodes."""
    topk, steps = config.spec_topk, config.spec_num_steps
    num_cands = topk + (steps - 1) * topk * topk
    return steps + 1 if topk == 1 else min(config.spec_num_draft_tokens, num_cands + 1)

