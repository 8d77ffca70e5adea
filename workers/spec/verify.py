"""The target's side of a speculative step: one forward over plain rows and draft trees, then
acceptance and KV compaction, all on the device (nothing read on the host).

Trees come from two places. Drafts the host knows (a whole step read them and handed them
to the scheduler) are in `seq.spec_token_ids`, their tree shapes in the worker's
`HostTree`s. Drafts the step in flight made on the device (overlap scheduling) are *lagged*
(`ScheduledSequence.lagged_sample_id`): tree and accepted count are read from
`DraftFutures`, and that count shifts every position of the verify (input ids, rope
positions, tree masks, KV lengths and slots are completed on the device: attention's
`shift`). Plain rows (prefill chunks, sequences that do not speculate) run beside them,
their placeholders resolved from the runner's `future_tokens` as in plain steps.

Acceptance reads the constrained, penalized target distribution: a structured-output
request's rows take their grammar masks first, each node's from the grammar state of its
path (workers/structured/: a draft the grammar forbids has probability 0 at its parent, so
acceptance stops before it), then `accept.penalize_tree` (each node's penalties count the
drafts on its path). Requests with history penalties or a constraint are never verified
lagged: their tokens must all be on the host, so the workers run them in whole steps.

Acceptance runs fixed loops on a GPU (`accept_tree(max_depth, max_children)`, nothing read
on the host; the CPU, whose host is the device, stops early instead): the bonus token goes
to `future_tokens`, the accepted count to `DraftFutures`; a tree's accepted path is
compacted in the KV cache with slots computed on the device (depths past the accepted path
copy a slot onto itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specd.workers.engine.batch import ScheduledSequence
from specd.workers.engine.sequence import Sequence as Seq
from specd.workers.runner.attention import build_attention_metadata
from specd.workers.runner.host_copy import HostCopy, upload
from specd.workers.runner.min_tokens import mask_tree_stop_tokens
from specd.workers.runner.model_runner import ModelRunner
from specd.workers.runner.step_inputs import StepInputs, token_slice
from specd.workers.spec.accept import Acceptance, accept_tree, penalize_tree
from specd.workers.spec.futures import DraftFutures
from specd.workers.spec.step import HostTree, Verified
from specd.workers.spec.tree import DraftTree, signed64
from specd.workers.structured.masks import StepMasks


def verifies(s: ScheduledSequence) -> bool:
    """Whether the step verifies drafts for this sequence (host-known or lagged)."""
    return s.lagged_sample_id is not None or bool(s.seq.spec_token_ids)


@dataclass(frozen=True)
class Rows:
    """One item's rows of a target forward: hidden [n, H] and aux [n, A]."""

    hidden: torch.Tensor
    aux: torch.Tensor


class Verifier:
    """Verifies draft trees against `runner`'s target (see module docstring). Reads lagged
    trees and accepted counts from `futures` and writes the accepted counts there."""

    def __init__(self, runner: ModelRunner, futures: DraftFutures, topk: int, num_steps: int,
                 num_draft_tokens: int) -> None:
        self.runner = runner
        self.futures = futures
        self.topk = topk
        self.num_steps = num_steps
        self.num_draft_tokens = num_draft_tokens
        self.device = runner.device
        self.block_size = runner.config.block_size
        self.num_lagged_verifies = 0  # figures for tests: verifies whose start was shifted

    def shifts(self, items: list[ScheduledSequence]) -> torch.Tensor:
        """Per item, int64 [len(items)] on the device: the drafts accepted by the step in
        flight (0 unless lagged). ValueError for a lagged verify of another row count."""
        for s in items:
            if s.lagged_sample_id is not None and s.num_new_tokens != self.num_draft_tokens:
                raise ValueError(f"request {s.seq.request_id}: a lagged verify has "
                                 f"{self.num_draft_tokens} rows, got {s.num_new_tokens}")
        lagged = [s.lagged_sample_id is not None for s in items]
        if not any(lagged):
            return torch.zeros(len(items), dtype=torch.int64, device=self.device)
        index = self.futures.index([s.lagged_sample_id or 0 for s in items], self.device)
        return torch.where(upload(torch.tensor(lagged), self.device),
                           self.futures.accepted[index], 0)

    def forward(self, items: list[ScheduledSequence], shift: torch.Tensor,
                trees: dict[str, HostTree]) -> list[Rows]:
        """The target over `items` (shift: `shifts(items)`): per item its rows. One forward,
        or two when long prefill chunks (which cannot carry tree-mask bits) meet trees."""
        verify = [i for i, s in enumerate(items) if verifies(s)]
        plain = [i for i, s in enumerate(items) if not verifies(s)]
        tree_mask = self.topk > 1 and bool(verify)
        if tree_mask and any(items[i].num_new_tokens > 64 for i in plain):
            order = [plain, verify]
        else:
            order = [list(range(len(items)))]
        rows: dict[int, Rows] = {}
        for index in order:
            if index:
                group = [items[i] for i in index]
                with_mask = tree_mask and any(verifies(s) for s in group)
                for i, r in zip(index, self._forward(group, shift[_ids(index, self.device)],
                                                     with_mask, trees), strict=True):
                    rows[i] = r
        return [rows[i] for i in range(len(items))]

    def _forward(self, group: list[ScheduledSequence], shift: torch.Tensor,
                 with_tree_mask: bool, trees: dict[str, HostTree]) -> list[Rows]:
        """One target pass over `group` (lagged rows completed on the device)."""
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
                tree = _tree_of(trees, seq)
                token_ids += token_slice(seq, s.start, s.end)
                positions += [s.start + d for d in tree.depths[:n]]
                masks += tree.masks[:n]
            else:
                token_ids += token_slice(seq, s.start, s.end)
                positions += range(s.start, s.end)
                masks += [(1 << (i + 1)) - 1 for i in range(min(n, 64))]
        device = self.device
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
            block_tables=[s.seq.block_ids for s in group], block_size=self.block_size,
            device=device, tree_mask=mask,
            shift=shift if lagged else None,
            max_shift=[s.max_shift for s in group] if lagged else None)
        inputs = StepInputs(input_ids=ids, positions=pos, meta=meta,
                            sample_rows=torch.empty(0, dtype=torch.int64), sample_seqs=[],
                            num_placeholders=sum(1 for t in token_ids if t < 0))
        hidden = self.runner.forward(inputs)
        aux = self.runner.last_aux_hidden
        if aux is None:
            raise ValueError("the target returned no aux hidden states")
        return [Rows(hidden[off: off + s.num_new_tokens], aux[off: off + s.num_new_tokens])
                for s, off in zip(group, offsets, strict=True)]

    def verify(self, items: list[ScheduledSequence], hidden: list[torch.Tensor],
               shift: torch.Tensor, trees: dict[str, HostTree], masks: StepMasks
               ) -> tuple[Verified, Acceptance, torch.Tensor]:
        """Accept on the device: `items` verify, hidden[b] [T_b, H] their forward rows,
        shift [V] their `shifts`, `masks` the step's (their constrained trees'). Returns
        what resolving reads, the acceptance and the roots' positions int64 [V]."""
        runner, device = self.runner, self.device
        width = max(s.num_new_tokens for s in items)
        padded = torch.stack([F.pad(h, (0, 0, 0, width - h.shape[0]))
                              for h in hidden])  # [V, T, H]
        logits = runner.model.compute_logits(padded.flatten(0, 1)).float()
        logits = logits.view(len(items), width, -1)
        tree = self._trees(items, width, trees)
        depth = min(self.num_steps, width - 1)
        seqs = [s.seq for s in items]
        # Grammar masks per node, then penalties counting each node's path
        # (accept.penalize_tree), and so does min_tokens' mask (its depth); log-probabilities
        # stay raw.
        params = [s.sampling for s in seqs]
        target = mask_tree_stop_tokens(
            penalize_tree(masks.apply_tree(logits, seqs), tree, params, seqs), tree, params,
            seqs, runner.model_config.eos_token_ids)
        acc = self._accept(tree, target, seqs, depth)
        bonus = acc.token_ids.gather(1, acc.num_accepted[:, None])[:, 0]
        sample_ids = [s.sample_id or 0 for s in items]
        runner.write_futures(sample_ids, bonus)
        self.futures.write_accepted(self.futures.index(sample_ids, device), acc.num_accepted)
        root = _ids([s.start for s in items], device) + shift
        if self.topk > 1:
            self._compact_kv(items, acc, root, depth, trees)
        verified = Verified(
            items=items, num_accepted=HostCopy(acc.num_accepted),
            token_ids=HostCopy(acc.token_ids.reshape(-1)),
            nodes=HostCopy(acc.accepted_nodes.reshape(-1)),
            depths=HostCopy(tree.depths.reshape(-1)), depth=depth, width=width,
            logits=logits if any(s.sampling.logprobs > 0 for s in seqs) else None)
        return verified, acc, root

    def _accept(self, tree: DraftTree, logits: torch.Tensor, seqs: list[Seq], depth: int
                ) -> Acceptance:
        """`accept_tree` over trees [V, T] at most `depth` deep, its result `depth` levels
        wide. On a GPU the walk runs a fixed number of levels and children, reading nothing
        on the host; on the CPU the host is the device, and the walk stops at the first
        level where every tree rejected (about half the ops of acceptance at batch 1)."""
        runner = self.runner
        fixed = self.device.type != "cpu"
        acc = accept_tree(tree, logits, [s.sampling for s in seqs], runner.generators_of(seqs),
                          runner.default_generator, max_depth=depth if fixed else None,
                          max_children=self.topk if fixed else None)
        missing = depth - acc.accepted_nodes.shape[1]
        if missing == 0:
            return acc
        return Acceptance(num_accepted=acc.num_accepted,
                          accepted_nodes=F.pad(acc.accepted_nodes, (0, missing), value=-1),
                          token_ids=F.pad(acc.token_ids, (0, missing), value=-1))

    def own_depth(self, s: ScheduledSequence, depth: int, trees: dict[str, HostTree]) -> int:
        """The deepest node of the tree this item verifies (all of `depth` when lagged)."""
        if s.lagged_sample_id is not None:
            return depth
        return min(depth, max(_tree_of(trees, s.seq).depths[: s.num_new_tokens]))

    def _trees(self, items: list[ScheduledSequence], width: int, trees: dict[str, HostTree]
               ) -> DraftTree:
        """The trees verified, [V, T]: host drafts from their HostTrees, lagged ones from
        the futures (gathered on the device)."""
        token_ids = torch.zeros(len(items), width, dtype=torch.int64)
        parents = torch.full((len(items), width), -1, dtype=torch.int64)
        depths = torch.zeros(len(items), width, dtype=torch.int64)
        lagged: list[int] = []
        for b, s in enumerate(items):
            if s.lagged_sample_id is not None:
                lagged.append(b)
                continue
            seq, n = s.seq, s.num_new_tokens
            tree = _tree_of(trees, seq)
            token_ids[b, :n] = torch.tensor([seq.all_token_ids[-1], *seq.spec_token_ids])
            parents[b, :n] = torch.tensor(tree.parents[:n])
            depths[b, :n] = torch.tensor(tree.depths[:n])
        device = self.device
        token_ids, parents, depths = (upload(t, device) for t in (token_ids, parents, depths))
        if lagged:
            rows = upload(torch.tensor(lagged), device)
            found = self.futures.tree(
                self.futures.index([items[b].lagged_sample_id or 0 for b in lagged], device))
            token_ids[rows] = found.token_ids
            parents[rows] = found.parents
            depths[rows] = found.depths
        return DraftTree(token_ids=token_ids, parents=parents, depths=depths,
                         tree_mask=torch.zeros_like(token_ids))

    def _compact_kv(self, items: list[ScheduledSequence], acc: Acceptance, root: torch.Tensor,
                    depth: int, trees: dict[str, HostTree]) -> None:
        """Move each accepted node's target K/V from slot(root + node) to slot(root +
        depth), slots computed on the device. Depths past a sequence's own tree (drafts cut
        by the budget) and past its accepted path copy a slot onto itself."""
        device = self.device
        own_depth = upload(torch.tensor([self.own_depth(s, depth, trees) for s in items]),
                           device)
        d = torch.arange(1, depth + 1, device=device)[None, :].expand(len(items), -1)
        nodes = acc.accepted_nodes
        inside = d <= own_depth[:, None]
        src = root[:, None] + torch.where(inside, torch.where(nodes >= 0, nodes, d), 0)
        dst = root[:, None] + torch.where(inside, d, 0)
        tables = block_tables([s.seq for s in items], device)
        bs = self.block_size
        self.runner.move_kv(slots(tables, src, bs).reshape(-1), slots(tables, dst, bs).reshape(-1))


def _tree_of(trees: dict[str, HostTree], seq: Seq) -> HostTree:
    tree = trees.get(seq.request_id)
    if tree is None:
        raise ValueError(f"request {seq.request_id}: drafts {seq.spec_token_ids} without "
                         f"their tree (not proposed by this worker)")
    return tree


def block_tables(seqs: list[Seq], device: torch.device) -> torch.Tensor:
    """Block tables [B, max_blocks] on the device (padded with block 0)."""
    width = max(len(s.block_ids) for s in seqs)
    return upload(torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs],
                               dtype=torch.int64), device)


def slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots [B, P] of positions [B, P] through block tables [B, max_blocks]."""
    return tables.gather(1, positions // block_size) * block_size + positions % block_size


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 values on the device, without a host wait (an index built from a Python list
    would be copied from pageable memory, which waits for the step in flight)."""
    return upload(torch.tensor(values, dtype=torch.int64), device)
