"""The draft head's side of a speculative step, on the device: catch-up, then the draft loop.

Positions (as `tools/train_eagle3.py` and the reference implementations): draft pair j reads
the target's aux hidden state at position j and token t[j + 1], sits at rope position j and
predicts t[j + 2]; its draft K/V lives at slot(j) of the request's own block table (the draft
cache has the target's block geometry).

1. **Catch-up**: one batched paged draft forward writes the draft K/V of every pair not
   written yet. A verified sequence's pairs are its root and accepted path, padded to its
   tree's depth (the padding writes draft K/V past the new root, which the draft loop masks
   and the next catch-up overwrites); their tokens are the emitted ones and their positions
   start at the root, both on the device. A plain row's pairs are the aux rows the worker
   kept for it (the last one reads this step's sample, a placeholder resolved on the
   device).
2. **Draft loop** (`draft_loop`, run by the backend's draft loop runner: captured, compiled
   or eager): N levels of top-k drafting from each sequence's next root (computed on the
   device: root + accepted + 1). The catch-up's last accepted row gives the root's
   children; each further level is a dense draft forward over the paged prefix (gathered
   once, `Eagle3Head.gather_prefix`) plus the tree nodes so far with their ancestor mask
   (tree.py's scratch rows; `Eagle3Head.draft_level`), so drafted nodes never touch the
   paged cache. The trees go to `DraftFutures` under the step's sample ids; the host reads
   them (or not) later (`Drafted`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.workers.engine.batch import ScheduledSequence
from specd.workers.runner.attention import build_attention_metadata
from specd.workers.runner.backend import DraftLoopShape
from specd.workers.runner.host_copy import HostCopy, upload
from specd.workers.runner.model_runner import ModelRunner
from specd.workers.runner.step_inputs import token_slice
from specd.workers.spec.accept import Acceptance
from specd.workers.spec.draft_graphs import DraftInputs, DraftOutputs
from specd.workers.spec.draft_head import Eagle3Head
from specd.workers.spec.futures import DraftFutures
from specd.workers.spec.step import Drafted
from specd.workers.spec.tree import build_tree, chain_tree, expand_tree, start_tree
from specd.workers.spec.verify import block_tables, slots


@dataclass(frozen=True)
class VerifiedRows:
    """What catching up after a verify needs: the verified items, each one's aux rows
    [T_b, A] of the verify and the depth of its own tree, the acceptance, and the roots'
    positions [V] and shifts [V] (device)."""

    items: list[ScheduledSequence]
    aux: list[torch.Tensor]
    own_depths: list[int]
    acc: Acceptance
    root: torch.Tensor
    shift: torch.Tensor


@dataclass(frozen=True)
class PlainRows:
    """A plain item to catch up: its kept aux rows cover positions [start, item.end)."""

    item: ScheduledSequence
    start: int
    aux: list[torch.Tensor]


@dataclass(frozen=True)
class CaughtUp:
    """The catch-up of `items` (verified ones first): per item the head's output [B, H] of
    the pair before its next root (it predicts the first draft) and that root's position
    [B] (device), a bound on the roots (the prefix width the loop needs) and the tensors
    the forward read (kept alive while the draft stream runs)."""

    items: list[ScheduledSequence]
    last_out: torch.Tensor
    roots: torch.Tensor
    width: int
    keep_alive: list[torch.Tensor]


class Drafter:
    """Catch-up and drafting for `runner`'s target with `head` (see module docstring): the
    draft K/V lives in `draft_kv` (`DraftConfig.kv_layer_shape`: per-head K/V, or MLA
    latents); trees go to `futures`. The draft loop runs as the runner's backend runs it
    (`loop_runner`)."""

    def __init__(self, runner: ModelRunner, head: Eagle3Head, draft_kv: torch.Tensor,
                 futures: DraftFutures, topk: int, num_steps: int, num_draft_tokens: int
                 ) -> None:
        self.runner = runner
        self.head = head
        self.draft_kv = draft_kv
        self.futures = futures
        self.topk = topk
        self.num_steps = num_steps
        self.num_draft_tokens = num_draft_tokens
        self.device = runner.device
        self.block_size = runner.config.block_size
        # Last, once everything the loop reads is set: graphs capture it here.
        self.loop_runner = runner.backend.draft_loop_runner(self.draft_loop, DraftLoopShape(
            hidden_size=head.config.hidden_size, dtype=draft_kv.dtype,
            max_num_seqs=runner.config.max_num_seqs,
            longest_sequence=runner.longest_sequence))

    def catch_up(self, verified: VerifiedRows | None, plain: list[PlainRows]) -> CaughtUp:
        """Write the draft K/V of every pending pair of `verified` then `plain` (one paged
        draft forward); see `CaughtUp` for what it returns."""
        query_lens: list[int] = []
        seq_lens: list[int] = []
        token_ids: list[int] = []
        positions: list[int] = []
        aux: list[torch.Tensor] = []
        max_shift: list[int] = []
        width_bounds: list[int] = []  # the next roots' latest positions
        root_base: list[int] = []  # next root = root_base + shift + accepted
        items: list[ScheduledSequence] = []
        if verified is not None:
            path = torch.cat([torch.zeros_like(verified.acc.accepted_nodes[:, :1]),
                              verified.acc.accepted_nodes.clamp(min=0)], dim=1)  # [V, D + 1]
            for b, s in enumerate(verified.items):
                n = verified.own_depths[b] + 1
                query_lens.append(n)
                seq_lens.append(s.start + n)
                token_ids += [0] * n  # the emitted tokens, filled in below
                positions += [0] * n
                aux.append(verified.aux[b][path[b, :n]])
                max_shift.append(s.max_shift)
                width_bounds.append(s.start + s.max_shift + n)
                root_base.append(s.start + 1)
                items.append(s)
        for p in plain:
            s = p.item
            query_lens.append(s.end - p.start)
            seq_lens.append(s.end)
            token_ids += token_slice(s.seq, p.start + 1, s.end + 1)  # pair j reads token j + 1
            positions += range(p.start, s.end)
            aux += p.aux
            max_shift.append(0)
            width_bounds.append(s.end)
            root_base.append(s.end)
            items.append(s)
        device = self.device
        num_verified = 0 if verified is None else len(verified.items)
        ids = upload(torch.tensor(token_ids, dtype=torch.int64), device)
        pos = upload(torch.tensor(positions, dtype=torch.int64), device)
        shift = torch.zeros(len(items), dtype=torch.int64, device=device)
        accepted = torch.zeros(len(items), dtype=torch.int64, device=device)
        if verified is not None:
            shift[:num_verified] = verified.shift
            accepted[:num_verified] = verified.acc.num_accepted
            self._fill_verified(ids, pos, query_lens[:num_verified], verified)
        if any(t < 0 for t in token_ids):  # plain pairs that read this step's samples
            ids = self.runner.resolve_placeholders(ids)
        lagged = any(s.lagged_sample_id is not None for s in items)
        meta = build_attention_metadata(
            query_lens=query_lens, seq_lens=seq_lens,
            block_tables=[s.seq.block_ids for s in items], block_size=self.block_size,
            device=device, shift=shift if lagged else None,
            max_shift=max_shift if lagged else None)
        hidden = self.head.fuse(torch.cat(aux).to(self.draft_kv.dtype))
        out = self.head.forward(ids, pos, hidden, self.draft_kv, meta)
        # A verified sequence's last pair is its accepted path's end; a plain one's its last.
        last_rows = (upload(torch.tensor(query_lens).cumsum(0) - 1 - torch.tensor(
            [query_lens[b] - 1 if b < num_verified else 0 for b in range(len(items))]), device)
                     + accepted)
        roots = upload(torch.tensor(root_base), device) + shift + accepted
        return CaughtUp(items, out[last_rows], roots, max(width_bounds), [ids, pos, hidden])

    def _fill_verified(self, ids: torch.Tensor, pos: torch.Tensor, query_lens: list[int],
                       verified: VerifiedRows) -> None:
        """The verified rows' tokens (the emitted ones: the root's row reads the first) and
        positions (from the root), written into ids and pos on the device."""
        device, depth = self.device, verified.acc.accepted_nodes.shape[1]
        flat_rows, flat_src, flat_off = [], [], []
        start = 0
        for b, n in enumerate(query_lens):
            for j in range(n):
                flat_rows.append(start + j)
                flat_src.append(b * (depth + 1) + j)
                flat_off.append(j)
            start += n
        rows = upload(torch.tensor(flat_rows), device)
        src = upload(torch.tensor(flat_src), device)
        emitted = verified.acc.token_ids.clamp(min=0).reshape(-1)
        ids[rows] = emitted[src]
        pos[rows] = verified.root.repeat_interleave(depth + 1)[src] + upload(
            torch.tensor(flat_off), device)

    def draft(self, caught_up: CaughtUp) -> tuple[Drafted, list[torch.Tensor]]:
        """The next trees of the sequences `catch_up` caught up, written to the futures
        under their items' sample ids. Returns what the host reads of them and the tensors
        the loop read (kept alive while the draft stream runs)."""
        device, items, roots = self.device, caught_up.items, caught_up.roots
        sample_ids = [s.sample_id or 0 for s in items]
        index = self.futures.index(sample_ids, device)
        # The token each next root holds: this step's bonus or sample (same sample ids).
        root_ids = self.runner.future_tokens[index]
        width = self.loop_runner.prefix_width(len(items), caught_up.width)
        prefix_slots, ok = _prefix(block_tables([s.seq for s in items], device), roots, width,
                                   self.block_size)
        inputs = DraftInputs(last_out=caught_up.last_out, prefix_slots=prefix_slots,
                             prefix_ok=ok, roots=roots, root_ids=root_ids)
        tree, nan_rows = self.loop_runner.run(inputs)
        self.futures.write_tree(index, tree)
        drafted = Drafted(
            seqs=[s.seq for s in items], sample_ids=sample_ids,
            token_ids=HostCopy(tree.token_ids.reshape(-1).clone()),
            parents=HostCopy(tree.parents.reshape(-1).clone()),
            depths=HostCopy(tree.depths.reshape(-1).clone()),
            tree_mask=HostCopy(tree.tree_mask.reshape(-1).clone()),
            nan_rows=HostCopy(nan_rows.to(torch.int64).clone()), width=tree.parents.shape[1])
        return drafted, [caught_up.last_out, prefix_slots, ok, roots, root_ids]

    def draft_loop(self, inputs: DraftInputs) -> DraftOutputs:
        """The device part of drafting (`draft_loop` over this drafter's head and cache)."""
        return draft_loop(self.head, self.draft_kv, self.topk, self.num_steps,
                          self.num_draft_tokens, inputs)


def draft_loop(head: Eagle3Head, draft_kv: torch.Tensor, topk: int, num_steps: int,
               num_draft_tokens: int, inputs: DraftInputs) -> DraftOutputs:
    """The device part of drafting: shapes fixed by the inputs' and no host reads, so it can
    be captured (checks are left to the host: NaN flags [B] returned). draft_kv: the head's
    paged cache (`DraftConfig.kv_layer_shape`), which `inputs.prefix_slots` index. A chain
    that keeps every draft takes `draft_chain`, which gives the same tree."""
    if topk == 1 and num_draft_tokens == num_steps + 1:
        return draft_chain(head, draft_kv, num_steps, inputs)
    return draft_tree(head, draft_kv, topk, num_steps, num_draft_tokens, inputs)


def draft_chain(head: Eagle3Head, draft_kv: torch.Tensor, num_steps: int,
                inputs: DraftInputs) -> DraftOutputs:
    """`draft_tree` for top-k 1 keeping all `num_steps` drafts, without its bookkeeping
    (about 290 torch ops a step at 5 levels, more than the head's own): each level's one
    node extends the last, so it sees the prefix and every earlier level, the tree is the
    chain itself and its masks are constants."""
    last_out, roots = inputs.last_out, inputs.roots
    batch, device = last_out.shape[0], last_out.device
    prefix = head.gather_prefix(draft_kv, inputs.prefix_slots)
    logp, ids = _top(head, 1, last_out)  # [B, 1]
    nan_rows = logp[:, 0].isnan()
    drafts = [ids]
    hidden = last_out[:, None]  # [B, 1, H]
    seen = torch.ones(batch, 1, num_steps, dtype=torch.bool, device=device)
    scratch: list[tuple[torch.Tensor, ...]] = []
    for step in range(1, num_steps):
        mask = torch.cat([inputs.prefix_ok[:, None], seen[:, :, :step]], dim=2)
        hidden = head.draft_level(head.embed_tokens(ids), hidden, (roots + step - 1)[:, None],
                                  prefix, scratch, mask)  # [B, 1, H]
        logp, ids = _top(head, 1, hidden[:, 0])
        nan_rows = nan_rows | logp[:, 0].isnan()
        drafts.append(ids)
    return chain_tree(inputs.root_ids, torch.cat(drafts, dim=1)), nan_rows


def draft_tree(head: Eagle3Head, draft_kv: torch.Tensor, topk: int, num_steps: int,
               num_draft_tokens: int, inputs: DraftInputs) -> DraftOutputs:
    """`draft_loop` for any tree (tree.py's EAGLE-2 bookkeeping)."""
    k = topk
    last_out, roots = inputs.last_out, inputs.roots
    batch, device = last_out.shape[0], last_out.device
    prefix = head.gather_prefix(draft_kv, inputs.prefix_slots)  # L rows per sequence
    logp, ids = _top(head, topk, last_out)  # [B, K]
    nan_rows = logp.isnan().any(dim=-1)
    cands, frontier = start_tree(logp, ids, check=False)
    hidden = last_out[:, None].expand(batch, k, -1)  # [B, K, H] inputs of depth-1 nodes
    scratch: list[tuple[torch.Tensor, ...]] = []  # each level's keys, never paged
    for step in range(1, num_steps):
        embeds = head.embed_tokens(frontier.token_ids)  # [B, K, H]
        positions = (roots + step - 1)[:, None].expand(batch, k)
        bits = (frontier.scratch_masks[:, :, None]
                >> torch.arange(step * k, device=device)) & 1  # [B, K, step*K]
        mask = torch.cat([inputs.prefix_ok[:, None].expand(batch, k, -1), bits.bool()],
                         dim=2)  # [B, K, L + step*K]
        out = head.draft_level(embeds, hidden, positions, prefix, scratch, mask)  # [B, K, H]
        child_logp, child_ids = _top(head, topk, out)  # [B, K, K]
        nan_rows = nan_rows | child_logp.isnan().flatten(1).any(dim=-1)
        cands, frontier = expand_tree(cands, frontier, child_logp, child_ids, check=False)
        hidden = out.gather(1, frontier.parent_slots[:, :, None].expand(-1, -1, out.shape[2]))
    return build_tree(cands, inputs.root_ids, num_draft_tokens, check=False), nan_rows


def _top(head: Eagle3Head, topk: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probabilities and TARGET token ids of the head's prediction."""
    logp = torch.log_softmax(head.logits(out).float(), dim=-1)
    values, draft_ids = logp.topk(topk, dim=-1)
    return values, head.to_target_ids(draft_ids)


def _prefix(tables: torch.Tensor, roots: torch.Tensor, width: int, block_size: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft-cache slots of positions [0, width) (past a root: its last slot again) and
    which are real (< root), computed on the device from the roots."""
    pos = torch.arange(width, device=roots.device)[None, :]
    clamped = torch.minimum(pos, (roots - 1)[:, None])
    return slots(tables, clamped, block_size), pos < roots[:, None]
