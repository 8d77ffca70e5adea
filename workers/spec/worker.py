"""`SpeculativeWorker`: EAGLE-3 drafting and verification around the `ModelRunner`.

Shape (vLLM V1): drafts proposed after step N (`propose`, called by the engine after the
scheduler's `update`, because `update` consumes and clears `seq.spec_token_ids`) are verified
in step N + 1 (`execute`). `execute` has the runner's contract: `ScheduledBatch -> ModelOutput`.

Positions (as `tools/train_eagle3.py` and the reference implementations): draft pair j reads
the target's aux hidden state at position j and token t[j + 1], sits at rope position j and
predicts t[j + 2]; its draft K/V lives at slot(j) of the request's own block table (the draft
cache has the target's block geometry). Per request the worker keeps the aux rows whose draft
K/V is not written yet ("pending", positions [num_draft_computed, num_computed)); `propose`
first writes them (catch-up: one batched paged draft forward), then drafts N levels: the
catch-up's last row gives the root's children, each further level is a dense draft forward
over the paged prefix K/V (gathered once) plus the tree nodes so far with their ancestor mask
(tree.py's scratch rows), so drafted nodes never touch the paged cache.

Verify: the target runs over [last token, drafts] with rope positions root + depth and the tree
mask (None for chains, which are causal); `accept.accept_tree` picks the accepted path and
the bonus token; accepted nodes' K/V are moved to the contiguous slots of their final
positions (KV compaction) before the next step.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specd.workers import sampler
from specd.workers.attention import build_attention_metadata
from specd.workers.batch import ModelOutput, ScheduledBatch, ScheduledSequence, TokenLogprobs
from specd.workers.config import EngineConfig
from specd.workers.graphs import capture_sizes
from specd.workers.host_copy import upload
from specd.workers.model_runner import ModelRunner, PendingOutput, StepInputs, _token_slice
from specd.workers.sequence import Sequence as Seq
from specd.workers.spec.accept import accept_tree
from specd.workers.spec.controller import SpecController, SpecEvent
from specd.workers.spec.cpu_draft import CompiledDraftLoop
from specd.workers.spec.draft_graphs import DraftGraphs, DraftInputs, prefix_widths
from specd.workers.spec.draft_model import DraftConfig, DraftHead
from specd.workers.spec.overlap import SpecLauncher
from specd.workers.spec.streams import DraftStreams
from specd.workers.spec.tree import (
    DraftTree,
    build_tree,
    check_parents,
    expand_tree,
    signed64,
    start_tree,
)


@dataclass
class SpecFigures:
    """Cumulative figures (mutable counters, owned by the worker)."""

    num_verify_passes: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)  # [num_steps]
    drafted_at_depth: list[int] = field(default_factory=list)  # [num_steps]
    draft_s: float = 0.0
    catch_up_s: float = 0.0
    verify_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify pass: accepted drafts + 1 (0 before any pass)."""
        if not self.num_verify_passes:
            return 0.0
        return (self.num_accepted + self.num_verify_passes) / self.num_verify_passes


@dataclass
class _RequestState:
    """Per request: pending aux rows [P, 3 * target_hidden] for positions
    [num_draft_computed, num_draft_computed + P), the last proposed tree (parents, depths,
    tree_mask as lists over its nodes, node 0 the root) and cumulative figures."""

    num_draft_computed: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
    tree_parents: list[int] = field(default_factory=list)
    tree_depths: list[int] = field(default_factory=list)
    tree_masks: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def num_pending(self) -> int:
        return sum(p.shape[0] for p in self.pending)


class SpeculativeWorker:
    """Wraps `runner` (built with the head's capture layers) with an EAGLE-3 `head`.

    All state is assigned here; the draft KV cache is allocated here (one layer, the target's
    block count and block size). ValueError if the head does not fit the target.
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner, head: DraftHead,
                 controller: SpecController) -> None:
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
        self.device = runner.device
        self.block_size = config.block_size
        self.topk = config.spec_topk
        self.num_steps = config.spec_num_steps
        self.num_draft_tokens = verify_query_len(config)
        self.draft_kv = torch.zeros(
            2, runner.num_kv_blocks, config.block_size, cfg.num_key_value_heads, cfg.head_dim,
            dtype=next(head.parameters()).dtype, device=self.device)
        self.states: dict[str, _RequestState] = {}
        self.streams = DraftStreams(self.device)  # drafting beside the main stream
        self.figures = SpecFigures(accepted_at_depth=[0] * self.num_steps,
                                   drafted_at_depth=[0] * self.num_steps)
        # Last, once everything the draft loop reads is set: its captured graphs.
        self.draft_graphs = self._capture_draft_graphs() if config.graphs_enabled else None
        # Without graphs, `--cpu-compile` compiles the draft loop instead.
        self.compiled_draft = (CompiledDraftLoop(self.draft_loop)
                               if config.cpu_compile and self.draft_graphs is None else None)
        # Overlap scheduling of speculative steps (drafts and accepted counts on the device).
        self.launcher = SpecLauncher(self)

    def _capture_draft_graphs(self) -> DraftGraphs:
        runner, cfg = self.runner, self.config
        graphs = DraftGraphs(self.draft_loop, capture_sizes(cfg.max_num_seqs),
                             prefix_widths(runner.longest_sequence), self.head.config.hidden_size,
                             self.draft_kv.dtype, self.device)
        with torch.inference_mode():
            graphs.capture()
        return graphs

    # --- verify -----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one step: plain rows as the runner does, draft trees verified. Reads drafts
        from `seq.spec_token_ids` (as `schedule` left them) and positions before `update`."""
        if batch.is_empty:
            return ModelOutput(sampled={})
        t0 = time.perf_counter()
        items = list(batch.scheduled)
        spec = [s for s in items if s.seq.spec_token_ids]
        if not spec:
            return self.launch_plain(batch).resolve()
        self._drop_preempted(batch)
        plain = [s for s in items if not s.seq.spec_token_ids]
        self.streams.wait_for_drafts()  # the verify reads what the draft stream wrote
        needs_tree_mask = any(self._is_tree(s) for s in spec)
        if needs_tree_mask and any(s.num_new_tokens > 64 for s in plain):
            groups = [plain, spec]  # long prefill chunks cannot carry tree-mask bits
        else:
            groups = [items]
        hidden_of: dict[str, torch.Tensor] = {}
        aux_of: dict[str, torch.Tensor] = {}
        for group in groups:
            if group:
                with_mask = needs_tree_mask and any(s.seq.spec_token_ids for s in group)
                self._forward(group, with_mask, hidden_of, aux_of)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        self._sample_plain([s for s in plain if s.needs_sample], hidden_of, aux_of, sampled,
                           logprobs)
        if spec:
            self._verify(spec, hidden_of, aux_of, sampled, logprobs)
            self.figures.verify_s += time.perf_counter() - t0
        return ModelOutput(sampled=sampled, logprobs=logprobs)

    @torch.inference_mode()
    def launch_plain(self, batch: ScheduledBatch) -> PendingOutput:
        """A step without drafts: the runner's own (launched, results still on the device);
        only the aux rows are kept (the whole cost of speculation while it is off)."""
        self._drop_preempted(batch)
        pending = self.runner.launch(batch)
        if batch.is_empty:
            return pending
        aux = self.runner.last_aux_hidden
        if aux is None:
            raise ValueError("the target returned no aux hidden states")
        row = 0
        for s in batch.scheduled:
            self._keep_aux(s.seq, s.start, aux[row: row + s.num_new_tokens])
            row += s.num_new_tokens
        return pending

    def _is_tree(self, s: ScheduledSequence) -> bool:
        state = self.states.get(s.seq.request_id)
        k = len(s.seq.spec_token_ids)
        return state is not None and state.tree_depths[: k + 1] != list(range(k + 1))

    def _forward(self, group: list[ScheduledSequence], tree_mask: bool,
                 hidden_of: dict[str, torch.Tensor], aux_of: dict[str, torch.Tensor]) -> None:
        """One target pass over `group`; per request its hidden [T, H] and aux [T, 3H] rows."""
        token_ids: list[int] = []
        positions: list[int] = []
        masks: list[int] = []
        for s in group:
            seq, k = s.seq, len(s.seq.spec_token_ids)
            token_ids += _token_slice(seq, s.start, s.end)
            if k:
                state = self.states[seq.request_id]
                positions += [s.start + d for d in state.tree_depths[: k + 1]]
                masks += state.tree_masks[: k + 1]
            else:
                positions += range(s.start, s.end)
                masks += [(1 << (i + 1)) - 1 for i in range(min(s.num_new_tokens, 64))]
        meta = build_attention_metadata(
            query_lens=[s.num_new_tokens for s in group], seq_lens=[s.end for s in group],
            block_tables=[s.seq.block_ids for s in group], block_size=self.block_size,
            device=self.device,
            tree_mask=(torch.tensor([signed64(m) for m in masks], dtype=torch.int64,
                                    device=self.device) if tree_mask else None))
        inputs = StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta=meta, sample_rows=torch.empty(0, dtype=torch.int64), sample_seqs=[])
        hidden = self.runner.forward(inputs)
        aux = self.runner.last_aux_hidden
        if aux is None:
            raise ValueError("the target returned no aux hidden states")
        row = 0
        for s in group:
            rid = s.seq.request_id
            hidden_of[rid] = hidden[row: row + s.num_new_tokens]
            aux_of[rid] = aux[row: row + s.num_new_tokens]
            row += s.num_new_tokens
            if not s.seq.spec_token_ids:
                self._keep_aux(s.seq, s.start, aux_of[rid])

    def _sample_plain(self, items: list[ScheduledSequence], hidden_of: dict[str, torch.Tensor],
                      aux_of: dict[str, torch.Tensor], sampled: dict[str, list[int]],
                      logprobs: dict[str, list[TokenLogprobs]]) -> None:
        if not items:
            return
        seqs = [s.seq for s in items]
        last = torch.stack([hidden_of[s.request_id][-1] for s in seqs])
        logits = self.runner.model.compute_logits(last).float()  # [M, vocab]
        tokens = sampler.sample(logits, [s.sampling for s in seqs],
                                [self.runner._generator(s) for s in seqs],
                                self.runner.default_generator)
        for s, t in zip(seqs, tokens.tolist(), strict=True):
            sampled[s.request_id] = [t]
        logprobs.update(self.runner._logprobs(logits, tokens, seqs))

    def _verify(self, items: list[ScheduledSequence], hidden_of: dict[str, torch.Tensor],
                aux_of: dict[str, torch.Tensor], sampled: dict[str, list[int]],
                logprobs: dict[str, list[TokenLogprobs]]) -> None:
        seqs = [s.seq for s in items]
        sizes = [len(s.spec_token_ids) + 1 for s in seqs]
        width = max(sizes)
        vocab = self.runner.model_config.vocab_size
        logits = torch.zeros(len(seqs), width, vocab, device=self.device)
        token_ids = torch.zeros(len(seqs), width, dtype=torch.int64)
        parents = torch.full((len(seqs), width), -1, dtype=torch.int64)
        depths = torch.zeros(len(seqs), width, dtype=torch.int64)
        for b, (seq, n) in enumerate(zip(seqs, sizes, strict=True)):
            state = self.states[seq.request_id]
            logits[b, :n] = self.runner.model.compute_logits(hidden_of[seq.request_id]).float()
            token_ids[b, :n] = torch.tensor([seq.all_token_ids[-1], *seq.spec_token_ids])
            parents[b, :n] = torch.tensor(state.tree_parents[:n])
            depths[b, :n] = torch.tensor(state.tree_depths[:n])
        tree = DraftTree(token_ids=token_ids.to(self.device), parents=parents.to(self.device),
                         depths=depths.to(self.device),
                         tree_mask=torch.zeros_like(token_ids, device=self.device))
        result = accept_tree(tree, logits, [s.sampling for s in seqs],
                             [self.runner._generator(s) for s in seqs],
                             self.runner.default_generator)
        emitted = result.token_lists()
        nodes = result.node_lists()
        moves = result.kv_moves()
        for b, (item, seq) in enumerate(zip(items, seqs, strict=True)):
            rid = seq.request_id
            state = self.states[rid]
            path = [0, *nodes[b]]
            sampled[rid] = emitted[b]
            self._compact_kv(seq, item.start, moves[b])
            self._keep_aux(seq, item.start, aux_of[rid][path])
            a = len(nodes[b])
            state.num_drafted += sizes[b] - 1
            state.num_accepted += a
            self.figures.num_verify_passes += 1
            self.figures.num_drafted += sizes[b] - 1
            self.figures.num_accepted += a
            for d in range(min(a, self.num_steps)):
                self.figures.accepted_at_depth[d] += 1
            for d in set(state.tree_depths[1: sizes[b]]):
                self.figures.drafted_at_depth[d - 1] += 1
            if seq.sampling.logprobs > 0:
                rows = torch.tensor(path, device=self.device)
                found = sampler.top_logprobs(logits[b, rows], emitted[b],
                                             seq.sampling.logprobs)
                logprobs[rid] = found

    def _compact_kv(self, seq: Seq, root: int, moves: list[tuple[int, int]]) -> None:
        """Move accepted nodes' target K/V (every layer) from slot(root + node) to
        slot(root + depth)."""
        if not moves:
            return
        self.runner.invalidate_decode_stage()
        src = torch.tensor([self._slot(seq, root + n) for n, _ in moves], device=self.device)
        dst = torch.tensor([self._slot(seq, root + d) for _, d in moves], device=self.device)
        for layer in self.runner.kv_caches:
            flat = layer.view(2, -1, *layer.shape[-2:])  # [2, slots, kv_heads, d]
            flat[:, dst] = flat[:, src]

    def _slot(self, seq: Seq, position: int) -> int:
        return seq.block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size)

    def _keep_aux(self, seq: Seq, start: int, rows: torch.Tensor) -> None:
        """Record aux rows [n, 3H] for positions [start, start + n) of `seq` (its draft K/V
        is written at the next catch-up). Rows at or after `start` kept earlier are stale
        (preemption, recompute) and dropped; a gap (prefix-cache hit) restarts the record."""
        if not seq.sampling.speculative:
            return
        state = self.states.setdefault(seq.request_id, _RequestState())
        known_end = state.num_draft_computed + state.num_pending
        if start < state.num_draft_computed or start > known_end:
            state.num_draft_computed, state.pending = start, []
        elif start < known_end:
            keep = start - state.num_draft_computed
            state.pending = [torch.cat(state.pending)[:keep]] if keep else []
        state.pending.append(rows)

    # --- draft ------------------------------------------------------------------------

    def update_controller(self, batch_size: int) -> SpecEvent | None:
        """Decide whether the coming step speculates (the engine logs the event)."""
        return self.controller.update(batch_size)

    @torch.inference_mode()
    def propose(self, seqs: list[Seq]) -> None:
        """Set `spec_token_ids` for each running, decoding sequence that may speculate (after
        the scheduler's `update`), when the controller says speculation is on."""
        if not self.controller.enabled:
            return
        todo = [s for s in seqs if not s.is_finished
                and s.num_computed_tokens == s.num_tokens - 1
                and self.aux_reaches(s, s.num_computed_tokens)]
        if not todo:
            return
        t0 = time.perf_counter()
        with self.streams.drafting():
            last_out = self._catch_up(todo)  # [B, H] draft output of each sequence's last pair
            t1 = time.perf_counter()
            self.figures.catch_up_s += t1 - t0
            tree, nan_rows = self._draft(todo, last_out)
            # The host reads the tree (one copy per tensor): the scheduler needs token ids.
            parents, depths = tree.parents.tolist(), tree.depths.tolist()
            masks, drafts = tree.tree_mask.tolist(), tree.draft_token_ids.tolist()
            if any(nan_rows.tolist()):
                raise ValueError("draft log-probabilities contain NaN")
            check_parents(parents)
        self.figures.draft_s += time.perf_counter() - t1
        for b, seq in enumerate(todo):
            state = self.states[seq.request_id]
            state.tree_parents, state.tree_depths = parents[b], depths[b]
            state.tree_masks = masks[b]
            seq.spec_token_ids = drafts[b]

    def aux_reaches(self, seq: Seq, end: int) -> bool:
        """Whether `seq` may speculate and its kept aux rows (some not caught up yet) cover
        exactly positions [0, end): then it can be drafted for from position `end`."""
        state = self.states.get(seq.request_id)
        return (seq.sampling.speculative and state is not None and state.num_pending > 0
                and state.num_draft_computed + state.num_pending == end)

    def _catch_up(self, seqs: list[Seq]) -> torch.Tensor:
        """Write the draft K/V of every pending pair (one paged draft forward); returns the
        output [B, H] of each sequence's last pair (it predicts the first draft)."""
        token_ids: list[int] = []
        positions: list[int] = []
        aux: list[torch.Tensor] = []
        query_lens: list[int] = []
        for seq in seqs:
            state = self.states[seq.request_id]
            lo, hi = state.num_draft_computed, seq.num_computed_tokens
            token_ids += _token_slice(seq, lo + 1, hi + 1)  # pair j reads token j + 1
            positions += range(lo, hi)
            aux += state.pending
            query_lens.append(hi - lo)
        meta = build_attention_metadata(
            query_lens=query_lens, seq_lens=[s.num_computed_tokens for s in seqs],
            block_tables=[s.block_ids for s in seqs], block_size=self.block_size,
            device=self.device)
        head = self.head
        dtype = self.draft_kv.dtype
        hidden = head.fuse(torch.cat(aux).to(dtype))
        out = head.forward(torch.tensor(token_ids, dtype=torch.int64, device=self.device),
                           torch.tensor(positions, dtype=torch.int64, device=self.device),
                           hidden, self.draft_kv, meta)
        for seq in seqs:
            state = self.states[seq.request_id]
            state.num_draft_computed, state.pending = seq.num_computed_tokens, []
        last_rows = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        return out[last_rows]

    def _draft(self, seqs: list[Seq], last_out: torch.Tensor) -> tuple[DraftTree, torch.Tensor]:
        """N levels of drafting (top-k per node; k = 1 is a chain) -> the tree to verify and
        per-row NaN flags [B] (the host checks both when it reads them). Replays a captured
        draft loop when one fits (draft_graphs.py), else runs it eagerly."""
        width = max(s.num_computed_tokens for s in seqs)
        shape = (None if self.draft_graphs is None
                 else self.draft_graphs.shape_for(len(seqs), width))
        inputs = self._draft_inputs(seqs, last_out, width if shape is None else shape[1])
        return self.run_draft_loop(inputs, shape)

    def run_draft_loop(self, inputs: DraftInputs, shape: tuple[int, int] | None
                       ) -> tuple[DraftTree, torch.Tensor]:
        """The draft loop over `inputs`: the captured graph of `shape` (from
        `draft_graphs.shape_for`, the inputs' prefix that wide), else compiled, else eager."""
        if shape is not None and self.draft_graphs is not None:
            return self.draft_graphs.run(shape, inputs)
        if self.draft_graphs is not None:
            self.draft_graphs.num_eager += 1
        if self.compiled_draft is not None:
            result = self.compiled_draft.run(inputs)
            if result is not None:
                return result
        return self.draft_loop(inputs)

    def _draft_inputs(self, seqs: list[Seq], last_out: torch.Tensor, width: int
                      ) -> DraftInputs:
        """The draft loop's inputs, prefix padded to `width` positions."""
        slots, ok = self._prefix_slots(seqs, width)
        return DraftInputs(
            last_out=last_out, prefix_slots=slots, prefix_ok=ok,
            roots=torch.tensor([s.num_computed_tokens for s in seqs], device=self.device),
            root_ids=torch.tensor([s.all_token_ids[-1] for s in seqs], device=self.device))

    def draft_loop(self, inputs: DraftInputs) -> tuple[DraftTree, torch.Tensor]:
        """The device part of drafting: shapes fixed by the inputs' and no host reads, so
        it can be captured (checks are left to the host: NaN flags [B] returned)."""
        head, k = self.head, self.topk
        last_out, roots = inputs.last_out, inputs.roots
        batch = last_out.shape[0]
        flat = self.draft_kv.view(2, -1, *self.draft_kv.shape[-2:])
        prefix_k = flat[0][inputs.prefix_slots]  # [B, L, kvh, d]
        prefix_v = flat[1][inputs.prefix_slots]
        logp, ids = self._top(last_out)  # [B, K]
        nan_rows = logp.isnan().any(dim=-1)
        cands, frontier = start_tree(logp, ids, check=False)
        hidden = last_out[:, None].expand(batch, k, -1)  # [B, K, H] inputs of depth-1 nodes
        scratch_k: list[torch.Tensor] = []
        scratch_v: list[torch.Tensor] = []
        for step in range(1, self.num_steps):
            embeds = head.embed_tokens(frontier.token_ids)  # [B, K, H]
            positions = (roots + step - 1)[:, None].expand(batch, k)
            q, key, value = head.qkv(embeds, hidden, positions)  # [B, K, heads|kvh, d]
            scratch_k.append(key)
            scratch_v.append(value)
            keys = torch.cat([prefix_k, *scratch_k], dim=1)  # [B, L + step*K, kvh, d]
            values = torch.cat([prefix_v, *scratch_v], dim=1)
            bits = (frontier.scratch_masks[:, :, None]
                    >> torch.arange(step * k, device=self.device)) & 1  # [B, K, step*K]
            mask = torch.cat([inputs.prefix_ok[:, None].expand(batch, k, -1), bits.bool()],
                             dim=2)
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=mask[:, None], scale=head.scale, enable_gqa=True)  # [B, heads, K, d]
            out = head.finish(attn.transpose(1, 2), hidden)  # [B, K, H]
            child_logp, child_ids = self._top(out)  # [B, K, K]
            nan_rows = nan_rows | child_logp.isnan().flatten(1).any(dim=-1)
            cands, frontier = expand_tree(cands, frontier, child_logp, child_ids, check=False)
            hidden = out.gather(1, frontier.parent_slots[:, :, None].expand(-1, -1, out.shape[2]))
        return build_tree(cands, inputs.root_ids, self.num_draft_tokens, check=False), nan_rows

    def _top(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k log-probabilities and TARGET token ids of the head's prediction."""
        logp = torch.log_softmax(self.head.logits(out).float(), dim=-1)
        values, draft_ids = logp.topk(self.topk, dim=-1)
        return values, self.head.to_target_ids(draft_ids)

    def _prefix_slots(self, seqs: list[Seq], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft-cache slots of positions [0, width) of each sequence (past its
        num_computed_tokens: its last slot again) int64 [B, width], and a bool [B, width] of
        the real positions."""
        lengths = [s.num_computed_tokens for s in seqs]
        pos = torch.arange(width)
        slots = []
        for seq, n in zip(seqs, lengths, strict=True):
            table = torch.tensor(seq.block_ids, dtype=torch.int64)
            p = pos.clamp(max=n - 1)
            slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
        ok = pos[None] < torch.tensor(lengths)[:, None]
        return upload(torch.stack(slots), self.device), upload(ok, self.device)

    # --- per request ------------------------------------------------------------------

    def request_figures(self, request_id: str) -> tuple[int, int]:
        """(drafted, accepted) so far for a request; (0, 0) if unknown."""
        state = self.states.get(request_id)
        return (0, 0) if state is None else (state.num_drafted, state.num_accepted)

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
            state.tree_parents, state.tree_depths, state.tree_masks = [], [], []

    def release(self, request_id: str) -> None:
        """Forget a finished, aborted or preempted request's pending rows and tree."""
        self.states.pop(request_id, None)
        self.runner.release(request_id)


def verify_query_len(config: EngineConfig) -> int:
    """Rows one sequence verifies: the root and its drafts. A chain verifies all its
    drafts; a tree keeps the best spec_num_draft_tokens - 1 nodes."""
    topk, steps = config.spec_topk, config.spec_num_steps
    num_cands = topk + (steps - 1) * topk * topk
    return steps + 1 if topk == 1 else min(config.spec_num_draft_tokens, num_cands + 1)


def read_draft_config(path: Path) -> DraftConfig:
    """The head's DraftConfig from `path`/config.json (FileNotFoundError / ValueError naming
    the file), read before the runner is built because it names the layers to capture."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"draft model: {config_path} not found")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from e
    return DraftConfig.from_dict(raw)

