"""Overlap scheduling of speculative steps: step N + 1 is launched before the host reads N.

`SpecLauncher.launch(batch)` runs one whole speculative step on the device and returns a
`PendingSpec` whose `resolve()` is the host's only read of it (made after the next step
is launched):

1. **Verify** every sequence that carries drafts. Drafts the host knows (`propose` after a
   whole step) come from `seq.spec_token_ids`; drafts the step in flight made come from
   `DraftFutures` (`ScheduledSequence.lagged_sample_id`), and so does the number of drafts
   that step accepted, which shifts every position of this one: input ids, rope positions,
   tree masks, KV lengths and slots are completed on the device (attention's `shift`).
   Other sequences (prefill chunks, sequences that do not speculate) run beside them as
   plain rows, their placeholders resolved from `future_tokens` as in plain overlap.
2. **Accept** on the device with fixed loops (`accept_tree(max_depth, max_children)`); the
   bonus token goes to `future_tokens`, the accepted count to `DraftFutures`; a tree's
   accepted path is compacted in the KV cache with device-computed slots.
3. **Draft for the next step** on the draft stream: every verified sequence (its catch-up
   rows are its root and accepted path, padded to the tree's depth: the padding writes
   draft K/V past the new root, which nothing reads before it is written again) and every
   speculative sequence whose prefill ended here. The trees go to `DraftFutures`, and the
   sequence is marked (`seq.lagged_sample_id`) so the scheduler schedules its verify
   without knowing where it starts.

`resolve()` reads the sampled and accepted tokens, the accepted nodes (figures,
log-probabilities) and the draft loop's checks (NaN, parents), which the host therefore
makes one step late. Nothing in `launch` reads a device value on the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specd.workers import sampler
from specd.workers.attention import build_attention_metadata
from specd.workers.batch import ModelOutput, ScheduledBatch, ScheduledSequence, TokenLogprobs
from specd.workers.host_copy import HostCopy, upload
from specd.workers.model_runner import StepInputs, _token_slice
from specd.workers.sequence import Sequence as Seq
from specd.workers.sequence import SequenceStatus
from specd.workers.spec.accept import Acceptance, accept_tree
from specd.workers.spec.draft_graphs import DraftInputs
from specd.workers.spec.futures import DraftFutures
from specd.workers.spec.tree import DraftTree, check_parents, signed64

if TYPE_CHECKING:
    from specd.workers.spec.worker import SpeculativeWorker


def verifies(s: ScheduledSequence) -> bool:
    """Whether the step verifies drafts for this sequence (host-known or lagged)."""
    return s.lagged_sample_id is not None or bool(s.seq.spec_token_ids)


@dataclass
class _Verified:
    """The verify part of a launch, for `resolve` (device tensors start their copies)."""

    items: list[ScheduledSequence]
    num_accepted: HostCopy
    token_ids: HostCopy  # [V * (D + 1)] flat
    nodes: HostCopy  # [V * D] flat
    depths: HostCopy  # [V * T] flat: the verified trees' depths (figures)
    depth: int  # D
    width: int  # T
    logits: torch.Tensor | None  # [V, T, vocab], kept when a sequence wants logprobs


@dataclass
class _Drafted:
    """The drafting part of a launch: the sequences and the loop's checks."""

    seqs: list[Seq]
    nan_rows: HostCopy
    parents: HostCopy  # [B * T] flat
    width: int


@dataclass
class PendingSpec:
    """A launched speculative step (see module docstring); `resolve()` reads it."""

    worker: SpeculativeWorker
    plain_seqs: list[Seq] = field(default_factory=list)
    plain_tokens: HostCopy | None = None
    plain_logits: torch.Tensor | None = None
    verified: _Verified | None = None
    drafted: _Drafted | None = None
    # Device tensors the draft stream reads: kept alive until the next step is launched
    # (which waits for the drafts), so the allocator cannot reuse them meanwhile.
    keep_alive: list[torch.Tensor] = field(default_factory=list)

    def resolve(self) -> ModelOutput:
        """The step's tokens, as the scheduler's `update` takes them. ValueError if the
        drafts this step made hold NaN log-probabilities or a dropped parent."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        runner = self.worker.runner
        if self.plain_tokens is not None:
            values = self.plain_tokens.values()
            for seq, t in zip(self.plain_seqs, values, strict=True):
                sampled[seq.request_id] = [t]
            if self.plain_logits is not None:
                logprobs.update(runner._logprobs(
                    self.plain_logits, torch.tensor(values, device=self.plain_logits.device),
                    self.plain_seqs))
        if self.verified is not None:
            self._resolve_verified(self.verified, sampled, logprobs)
        if self.drafted is not None:
            drafted = self.drafted
            if any(drafted.nan_rows.values()):
                raise ValueError("draft log-probabilities contain NaN")
            parents = drafted.parents.values()
            check_parents([parents[i: i + drafted.width]
                           for i in range(0, len(parents), drafted.width)])
        return ModelOutput(sampled=sampled, logprobs=logprobs)

    def _resolve_verified(self, v: _Verified, sampled: dict[str, list[int]],
                          logprobs: dict[str, list[TokenLogprobs]]) -> None:
        worker, fig = self.worker, self.worker.figures
        accepted = v.num_accepted.values()
        tokens, nodes, depths = v.token_ids.values(), v.nodes.values(), v.depths.values()
        for b, (item, a) in enumerate(zip(v.items, accepted, strict=True)):
            seq = item.seq
            emitted = tokens[b * (v.depth + 1): b * (v.depth + 1) + a + 1]
            sampled[seq.request_id] = emitted
            k = item.num_new_tokens - 1
            state = worker.states.get(seq.request_id)
            if state is not None:
                state.num_drafted += k
                state.num_accepted += a
            fig.num_verify_passes += 1
            fig.num_drafted += k
            fig.num_accepted += a
            for d in range(min(a, worker.num_steps)):
                fig.accepted_at_depth[d] += 1
            for d in set(depths[b * v.width + 1: b * v.width + k + 1]):
                fig.drafted_at_depth[d - 1] += 1
            if seq.sampling.logprobs > 0 and v.logits is not None:
                path = [0, *nodes[b * v.depth: b * v.depth + a]]
                rows = torch.tensor(path, device=v.logits.device)
                logprobs[seq.request_id] = sampler.top_logprobs(
                    v.logits[b, rows], emitted, seq.sampling.logprobs)

    def after_update(self) -> None:
        """After the scheduler's `update` of this step: a drafted sequence's draft K/V now
        reaches its last token (the root of its next verify)."""
        if self.drafted is None:
            return
        for seq in self.drafted.seqs:
            state = self.worker.states.get(seq.request_id)
            if state is not None and seq.status is SequenceStatus.RUNNING:
                state.num_draft_computed, state.pending = seq.num_tokens - 1, []


@dataclass
class _Group:
    """One target forward's rows: per item its row offset; lagged items' futures index."""

    items: list[ScheduledSequence]
    offsets: list[int]
    hidden: torch.Tensor
    aux: torch.Tensor


class SpecLauncher:
    """Launches overlapped speculative steps for `worker` (see module docstring)."""

    def __init__(self, worker: SpeculativeWorker) -> None:
        self.worker = worker
        runner = worker.runner
        self.futures = DraftFutures(runner.future_tokens.shape[0], worker.num_draft_tokens,
                                    worker.device)
        self.num_lagged_verifies = 0  # figures for tests: verifies whose start was shifted

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> PendingSpec:
        w = self.worker
        w._drop_preempted(batch)
        pending = PendingSpec(w)
        if batch.is_empty:
            return pending
        t0 = time.perf_counter()
        items = list(batch.scheduled)
        for s in items:
            if s.lagged_sample_id is not None and s.num_new_tokens != w.num_draft_tokens:
                raise ValueError(f"request {s.seq.request_id}: a lagged verify has "
                                 f"{w.num_draft_tokens} rows, got {s.num_new_tokens}")
        shift = self._shifts(items)  # [len(items)] on the device
        w.streams.wait_for_drafts()  # the verify reads what the draft stream wrote
        verify = [i for i, s in enumerate(items) if verifies(s)]
        plain = [i for i, s in enumerate(items) if not verifies(s)]
        tree_mask = w.topk > 1 and bool(verify)
        if tree_mask and any(items[i].num_new_tokens > 64 for i in plain):
            order = [plain, verify]  # long prefill chunks cannot carry tree-mask bits
        else:
            order = [list(range(len(items)))]
        rows_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for index in order:
            if index:
                group = self._forward([items[i] for i in index], shift[_ids(index, w.device)],
                                      tree_mask and any(i in verify for i in index))
                for i, s, off in zip(index, group.items, group.offsets, strict=True):
                    n = s.num_new_tokens
                    rows_of[i] = (group.hidden[off: off + n], group.aux[off: off + n])
        for i in plain:
            w._keep_aux(items[i].seq, items[i].start, rows_of[i][1])
        self._sample_plain(pending, [i for i in plain if items[i].needs_sample], items,
                           rows_of)
        acc = root = None
        if verify:
            acc, root = self._verify(pending, verify, items, rows_of, shift)
            w.figures.verify_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        drafting_plain = [i for i in plain if self._drafts_after_prefill(items[i])]
        if verify or drafting_plain:
            with w.streams.drafting():
                self._draft(pending, verify, drafting_plain, items, rows_of, shift, acc, root)
            w.figures.draft_s += time.perf_counter() - t1
        return pending

    # --- inputs ----------------------------------------------------------------------

    def _shifts(self, items: list[ScheduledSequence]) -> torch.Tensor:
        """Per item, the drafts accepted by the step in flight (0 unless lagged)."""
        device = self.worker.device
        lagged = [s.lagged_sample_id is not None for s in items]
        if not any(lagged):
            return torch.zeros(len(items), dtype=torch.int64, device=device)
        index = self.futures.index([s.lagged_sample_id or 0 for s in items], device)
        return torch.where(upload(torch.tensor(lagged), device), self.futures.accepted[index], 0)

    def _forward(self, group: list[ScheduledSequence], shift: torch.Tensor,
                 with_tree_mask: bool) -> _Group:
        """One target pass over `group` (lagged rows completed on the device)."""
        w = self.worker
        token_ids: list[int] = []
        positions: list[int] = []
        masks: list[int] = []
        offsets: list[int] = []
        lagged: list[int] = []  # positions in `group`
        for b, s in enumerate(group):
            seq, n = s.seq, s.num_new_tokens
            offsets.append(len(token_ids))
            if s.lagged_sample_id is not None:
                lagged.append(b)
                token_ids += [0] * n  # filled in from the futures below
                positions += [0] * n
                masks += [0] * n
            elif seq.spec_token_ids:
                state = w.states[seq.request_id]
                token_ids += _token_slice(seq, s.start, s.end)
                positions += [s.start + d for d in state.tree_depths[:n]]
                masks += state.tree_masks[:n]
            else:
                token_ids += _token_slice(seq, s.start, s.end)
                positions += range(s.start, s.end)
                masks += [(1 << (i + 1)) - 1 for i in range(min(n, 64))]
        device = w.device
        ids = upload(torch.tensor(token_ids, dtype=torch.int64), device)
        pos = upload(torch.tensor(positions, dtype=torch.int64), device)
        mask = (upload(torch.tensor([signed64(m) for m in masks], dtype=torch.int64), device)
                if with_tree_mask else None)
        if lagged:
            t = self.futures.num_nodes
            index = self.futures.index([group[b].lagged_sample_id or 0 for b in lagged], device)
            tree = self.futures.tree(index)
            rows = upload((torch.tensor([offsets[b] for b in lagged])[:, None]
                           + torch.arange(t)).reshape(-1), device)
            starts = upload(torch.tensor([group[b].start for b in lagged]), device)
            roots = starts + shift[_ids(lagged, device)]
            ids[rows] = tree.token_ids.reshape(-1)
            pos[rows] = (roots[:, None] + tree.depths).reshape(-1)
            if mask is not None:
                mask[rows] = tree.tree_mask.reshape(-1)
            self.num_lagged_verifies += len(lagged)
        meta = build_attention_metadata(
            query_lens=[s.num_new_tokens for s in group], seq_lens=[s.end for s in group],
            block_tables=[s.seq.block_ids for s in group], block_size=w.block_size,
            device=device, tree_mask=mask,
            shift=shift if lagged else None,
            max_shift=[s.max_shift for s in group] if lagged else None)
        inputs = StepInputs(input_ids=ids, positions=pos, meta=meta,
                            sample_rows=torch.empty(0, dtype=torch.int64), sample_seqs=[],
                            num_placeholders=sum(1 for t in token_ids if t < 0))
        hidden = w.runner.forward(inputs)
        aux = w.runner.last_aux_hidden
        if aux is None:
            raise ValueError("the target returned no aux hidden states")
        return _Group(group, offsets, hidden, aux)

    # --- sample and verify -------------------------------------------------------------

    def _sample_plain(self, pending: PendingSpec, index: list[int],
                      items: list[ScheduledSequence],
                      rows_of: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not index:
            return
        runner = self.worker.runner
        seqs = [items[i].seq for i in index]
        last = torch.stack([rows_of[i][0][-1] for i in index])
        logits = runner.model.compute_logits(last).float()
        tokens = sampler.sample(logits, [s.sampling for s in seqs],
                                [runner._generator(s) for s in seqs], runner.default_generator)
        sample_ids = [items[i].sample_id or 0 for i in index]
        runner._write_futures(sample_ids, tokens)
        self.futures.write_accepted(self.futures.index(sample_ids, runner.device),
                                    torch.zeros_like(tokens))
        pending.plain_seqs, pending.plain_tokens = seqs, HostCopy(tokens)
        if any(s.sampling.logprobs > 0 for s in seqs):
            pending.plain_logits = logits

    def _verify(self, pending: PendingSpec, index: list[int], items: list[ScheduledSequence],
                rows_of: dict[int, tuple[torch.Tensor, torch.Tensor]], shift: torch.Tensor
                ) -> tuple[Acceptance, torch.Tensor]:
        """Accept on the device; returns the acceptance and the roots' positions [V]."""
        w = self.worker
        runner, device = w.runner, w.device
        verify = [items[i] for i in index]
        width = max(s.num_new_tokens for s in verify)
        hidden = torch.stack([F.pad(rows_of[i][0], (0, 0, 0, width - items[i].num_new_tokens))
                              for i in index])  # [V, T, H]
        logits = runner.model.compute_logits(hidden.flatten(0, 1)).float()
        logits = logits.view(len(verify), width, -1)
        tree = self._verify_trees(verify, width)
        depth = min(w.num_steps, width - 1)
        acc = accept_tree(tree, logits, [s.seq.sampling for s in verify],
                          [runner._generator(s.seq) for s in verify], runner.default_generator,
                          max_depth=depth, max_children=w.topk)
        bonus = acc.token_ids.gather(1, acc.num_accepted[:, None])[:, 0]
        sample_ids = [s.sample_id or 0 for s in verify]
        runner._write_futures(sample_ids, bonus)
        self.futures.write_accepted(self.futures.index(sample_ids, device), acc.num_accepted)
        root = _ids([s.start for s in verify], device) + shift[_ids(index, device)]
        if w.topk > 1:
            self._compact_kv(verify, acc, root, depth)
        pending.verified = _Verified(
            items=verify, num_accepted=HostCopy(acc.num_accepted),
            token_ids=HostCopy(acc.token_ids.reshape(-1)),
            nodes=HostCopy(acc.accepted_nodes.reshape(-1)),
            depths=HostCopy(tree.depths.reshape(-1)), depth=depth, width=width,
            logits=logits if any(s.seq.sampling.logprobs > 0 for s in verify) else None)
        return acc, root

    def _verify_trees(self, verify: list[ScheduledSequence], width: int) -> DraftTree:
        """The trees verified, [V, T]: host drafts from the lists `propose` left, lagged
        ones from the futures (gathered on the device)."""
        w = self.worker
        token_ids = torch.zeros(len(verify), width, dtype=torch.int64)
        parents = torch.full((len(verify), width), -1, dtype=torch.int64)
        depths = torch.zeros(len(verify), width, dtype=torch.int64)
        lagged: list[int] = []
        for b, s in enumerate(verify):
            if s.lagged_sample_id is not None:
                lagged.append(b)
                continue
            seq, n = s.seq, s.num_new_tokens
            state = w.states[seq.request_id]
            token_ids[b, :n] = torch.tensor([seq.all_token_ids[-1], *seq.spec_token_ids])
            parents[b, :n] = torch.tensor(state.tree_parents[:n])
            depths[b, :n] = torch.tensor(state.tree_depths[:n])
        device = w.device
        token_ids, parents, depths = (upload(t, device) for t in (token_ids, parents, depths))
        if lagged:
            rows = upload(torch.tensor(lagged), device)
            found = self.futures.tree(
                self.futures.index([verify[b].lagged_sample_id or 0 for b in lagged], device))
            token_ids[rows] = found.token_ids
            parents[rows] = found.parents
            depths[rows] = found.depths
        return DraftTree(token_ids=token_ids, parents=parents, depths=depths,
                         tree_mask=torch.zeros_like(token_ids))

    def _compact_kv(self, verify: list[ScheduledSequence], acc: Acceptance, root: torch.Tensor,
                    depth: int) -> None:
        """Move each accepted node's target K/V from slot(root + node) to slot(root +
        depth), slots computed on the device. Depths past a sequence's own tree (drafts cut
        by the budget) and past its accepted path copy a slot onto itself."""
        w = self.worker
        device = w.device
        own_depth = upload(torch.tensor(
            [depth if s.lagged_sample_id is not None
             else max(w.states[s.seq.request_id].tree_depths[: s.num_new_tokens])
             for s in verify]), device)
        d = torch.arange(1, depth + 1, device=device)[None, :].expand(len(verify), -1)
        nodes = acc.accepted_nodes
        inside = d <= own_depth[:, None]
        src = root[:, None] + torch.where(inside, torch.where(nodes >= 0, nodes, d), 0)
        dst = root[:, None] + torch.where(inside, d, 0)
        tables = self._tables([s.seq for s in verify])
        src_slots, dst_slots = _slots(tables, src, w.block_size), _slots(tables, dst, w.block_size)
        w.runner.invalidate_decode_stage()
        for layer in w.runner.kv_caches:
            flat = layer.view(2, -1, *layer.shape[-2:])  # [2, slots, kv_heads, d]
            flat[:, dst_slots.reshape(-1)] = flat[:, src_slots.reshape(-1)]

    # --- draft -----------------------------------------------------------------------

    def _drafts_after_prefill(self, s: ScheduledSequence) -> bool:
        """A plain item whose step samples and whose aux rows now reach its end: it is
        drafted for here, as `propose` would after the step."""
        return (s.needs_sample and s.seq.status is SequenceStatus.RUNNING
                and self.worker.aux_reaches(s.seq, s.end))

    def _draft(self, pending: PendingSpec, verify: list[int], plain: list[int],
               items: list[ScheduledSequence],
               rows_of: dict[int, tuple[torch.Tensor, torch.Tensor]], shift: torch.Tensor,
               acc: Acceptance | None, root: torch.Tensor | None) -> None:
        """Catch up the draft K/V of every item in `verify` + `plain`, draft their next
        trees, and leave them in the futures (see module docstring)."""
        w = self.worker
        device, dtype = w.device, w.draft_kv.dtype
        index = verify + plain
        seqs = [items[i].seq for i in index]
        query_lens: list[int] = []
        seq_lens: list[int] = []
        token_ids: list[int] = []
        positions: list[int] = []
        aux: list[torch.Tensor] = []
        max_shift: list[int] = []
        width_bounds: list[int] = []
        root_base: list[int] = []  # next root = root_base + shift + accepted
        depth = 0
        if acc is not None and root is not None:
            depth = acc.accepted_nodes.shape[1]
            path = torch.cat([torch.zeros_like(acc.accepted_nodes[:, :1]),
                              acc.accepted_nodes.clamp(min=0)], dim=1)  # [V, D + 1]
            for b, i in enumerate(verify):
                s = items[i]
                n = self._own_depth(s, depth) + 1
                query_lens.append(n)
                seq_lens.append(s.start + n)
                token_ids += [0] * n
                positions += [0] * n
                aux.append(rows_of[i][1][path[b, :n]])
                max_shift.append(s.max_shift)
                width_bounds.append(s.start + s.max_shift + n)
                root_base.append(s.start + 1)
        for i in plain:
            s = items[i]
            state = w.states[s.seq.request_id]
            lo, hi = state.num_draft_computed, s.end
            query_lens.append(hi - lo)
            seq_lens.append(hi)
            token_ids += _token_slice(s.seq, lo + 1, hi + 1)  # pair j reads token j + 1
            positions += range(lo, hi)
            aux += state.pending
            state.num_draft_computed, state.pending = hi, []
            max_shift.append(0)
            width_bounds.append(hi)
            root_base.append(hi)
        ids = upload(torch.tensor(token_ids, dtype=torch.int64), device)
        pos = upload(torch.tensor(positions, dtype=torch.int64), device)
        starts = torch.tensor([0, *query_lens[:-1]]).cumsum(0)
        shift_d = shift[_ids(index, device)]
        accepted = torch.zeros(len(index), dtype=torch.int64, device=device)
        if acc is not None and root is not None:
            accepted[: len(verify)] = acc.num_accepted
            flat_rows, flat_src, flat_off = [], [], []
            for b in range(len(verify)):
                for j in range(query_lens[b]):
                    flat_rows.append(int(starts[b]) + j)
                    flat_src.append(b * (depth + 1) + j)
                    flat_off.append(j)
            rows = upload(torch.tensor(flat_rows), device)
            src = upload(torch.tensor(flat_src), device)
            emitted = acc.token_ids.clamp(min=0).reshape(-1)
            ids[rows] = emitted[src]
            pos[rows] = root.repeat_interleave(depth + 1)[src] + upload(
                torch.tensor(flat_off), device)
        ids = w.runner._resolve_placeholders(ids)  # plain pairs read this step's samples
        meta = build_attention_metadata(
            query_lens=query_lens, seq_lens=seq_lens, block_tables=[s.block_ids for s in seqs],
            block_size=w.block_size, device=device, shift=shift_d, max_shift=max_shift)
        hidden = w.head.fuse(torch.cat(aux).to(dtype))
        out = w.head.forward(ids, pos, hidden, w.draft_kv, meta)
        last_rows = (upload(torch.tensor(query_lens).cumsum(0) - 1 - torch.tensor(
            [query_lens[b] - 1 if b < len(verify) else 0 for b in range(len(index))]), device)
                     + accepted)
        roots = upload(torch.tensor(root_base), device) + shift_d + accepted
        sample_ids = [items[i].sample_id or 0 for i in index]
        # The token each next root holds: this step's bonus or sample (same sample ids).
        root_ids = w.runner.future_tokens[self.futures.index(sample_ids, device)]
        width = max(width_bounds)
        shape = None if w.draft_graphs is None else w.draft_graphs.shape_for(len(index), width)
        width = width if shape is None else shape[1]
        slots, ok = _prefix(self._tables(seqs), roots, width, w.block_size)
        inputs = DraftInputs(last_out=out[last_rows], prefix_slots=slots, prefix_ok=ok,
                             roots=roots, root_ids=root_ids)
        tree, nan_rows = w.run_draft_loop(inputs, shape)
        self.futures.write_tree(self.futures.index(sample_ids, device), tree)
        for i in index:
            items[i].seq.lagged_sample_id = items[i].sample_id
            items[i].seq.num_lagged_drafts = w.num_draft_tokens - 1
        pending.drafted = _Drafted(seqs=seqs, nan_rows=HostCopy(nan_rows.to(torch.int64).clone()),
                                   parents=HostCopy(tree.parents.reshape(-1).clone()),
                                   width=tree.parents.shape[1])
        pending.keep_alive += [ids, pos, hidden, inputs.last_out, slots, ok, roots, root_ids]

    def _own_depth(self, s: ScheduledSequence, depth: int) -> int:
        """The deepest node of the tree this item verifies (all of `depth` when lagged)."""
        if s.lagged_sample_id is not None:
            return depth
        state = self.worker.states[s.seq.request_id]
        return min(depth, max(state.tree_depths[: s.num_new_tokens]))

    def _tables(self, seqs: list[Seq]) -> torch.Tensor:
        """Block tables [B, max_blocks] on the device (padded with block 0)."""
        width = max(len(s.block_ids) for s in seqs)
        return upload(torch.tensor([s.block_ids + [0] * (width - len(s.block_ids))
                                    for s in seqs], dtype=torch.int64), self.worker.device)


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 values on the device, without a host wait (an index built from a Python list
    would be copied from pageable memory, which waits for the step in flight)."""
    return upload(torch.tensor(values, dtype=torch.int64), device)


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots [B, P] of positions [B, P] through block tables [B, max_blocks]."""
    return tables.gather(1, positions // block_size) * block_size + positions % block_size


def _prefix(tables: torch.Tensor, roots: torch.Tensor, width: int, block_size: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft-cache slots of positions [0, width) (past a root: its last slot again) and
    which are real (< root), computed on the device from the roots."""
    pos = torch.arange(width, device=roots.device)[None, :]
    clamped = torch.minimum(pos, (roots - 1)[:, None])
    return _slots(tables, clamped, block_size), pos < roots[:, None]

