"""Kept K/V for plain decode on the CPU, so that a step does not re-gather every history.

The CPU attention attends each query-length group over a padded copy of its sequences'
K/V. Gathering that copy from the paged cache costs as much as the attention itself at
batch 64 (every sequence's whole history, per layer, per step). In plain decode the batch
rarely changes between steps, so the `DecodeStage` keeps the copy of the decode group
(query length 1) from one forward to the next and only appends each sequence's new token.

Rows stay put. Each sequence of the group owns one row of the copy for as long as it
decodes, whatever its place in the batch: the step runs in *row order* (the compiled
decode permutes its G input rows, the eager attention its queries, both a few hundred
bytes) instead of moving histories into batch order. When requests finish and others join
(every step or two under a steady, staggered load), a newcomer's history is gathered into
a row left free, and only a continuing sequence whose row lies past the new group size G
is copied down into a free row below it, so rows [0, G) are always the group (a "remap").
Moving every continuing row into its new batch place instead cost ~16 ms a step at 32
sequences on the 2-core CPU (a whole new copy per layer), beside ~10 ms for the step.
A group with no continuing row, longer than the copy's key capacity or wider than its rows,
is rebuilt with one gather (a "refresh").

Contract: a kept row is valid only if the previous forward of the model was the stage's own
(nothing else wrote the cache in between) and its sequence is one token longer, with the
same blocks under the tokens kept. The model runner calls `invalidate` after any forward
that did not use the stage, after a forward that failed and whenever it moves K/V itself
(speculative KV compaction), so a stale copy is never read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

HEADROOM_TOKENS = 64  # appended steps before the copy must grow (and be re-gathered)
HEADROOM_ROWS = 8  # sequences that may join before the copy must grow


@dataclass(frozen=True)
class StagePlan:
    """This forward's use of the stage for one decode group of G sequences.

    refresh: gather the whole copy (every layer) instead of appending.
    row_of: int64 [G], the copy's row of each sequence of the group (batch order); a
        permutation of [0, G). order: its inverse, the group index held by each row.
    is_identity: row_of is arange(G) (the step needs no permuting).
    moves: (src, dst) int64 [M] each, rows copied down before the step (src >= G > dst),
        or None.
    gathers: (group index, row) int64 [R] each, newcomers whose history is gathered into
        their row, or None (on refresh every row is gathered).
    width: the padded key length S_pad the group's mask was built for.
    new_slots / new_positions: int64 [G], cache slot and position of each sequence's new
        token (the one appended), batch order.
    capacity, num_rows: the copy's key positions per row and rows, as the stage that made
        the plan allocates them (what another rank's stage follows: `follow`).
    """

    stage: DecodeStage
    refresh: bool
    row_of: torch.Tensor
    order: torch.Tensor
    is_identity: bool
    moves: tuple[torch.Tensor, torch.Tensor] | None
    gathers: tuple[torch.Tensor, torch.Tensor] | None
    width: int
    new_slots: torch.Tensor
    new_positions: torch.Tensor
    capacity: int
    num_rows: int

    @property
    def num_seqs(self) -> int:
        return int(self.row_of.shape[0])


class DecodeStage:
    """Per layer (keyed by the layer's cache storage), a `[2, rows, kv_heads, capacity, d]`
    copy of the decode group's K/V whose rows [0, G) hold the group (K and V each
    row-major, so rows [0, G) of either are one contiguous block). Owned by the model
    runner; CPU only."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.capacity = 0  # key positions per row
        self.num_rows = 0  # rows allocated (>= the group size)
        # Per row of the copy: the block table and KV length of the sequence it holds.
        self._tables: list[list[int]] = []
        self._lens: list[int] = []
        self._buffers: dict[int, torch.Tensor] = {}
        self.num_refreshes = 0  # figures for tests and profiling
        self.num_appends = 0
        self.num_remaps = 0
        self.num_rows_moved = 0
        self.num_rows_gathered = 0  # newcomers gathered by remaps
        # Layers whose copy this step's remap has been applied to (a layer may ask twice in
        # one step: an eager retry after a failed compiled call must not remap again).
        self._remapped: set[int] = set()

    def invalidate(self) -> None:
        """Forget the copy (the next decode forward re-gathers); frees its memory."""
        self._tables, self._lens, self._buffers = [], [], {}
        self.capacity = self.num_rows = 0

    def plan(self, tables: list[list[int]], lens: list[int], width: int,
             new_slots: torch.Tensor) -> StagePlan:
        """Decide append, remap or refresh for a decode group (block tables and KV lengths
        after this step, this step's new-token slots, batch order) and remember the group,
        row by row, for the next step."""
        g = len(lens)
        old_rows = (self._match(tables, lens)
                    if width <= self.capacity and g <= self.num_rows else None)
        positions = torch.tensor(lens, dtype=torch.int64) - 1
        self._remapped = set()
        if old_rows is None or all(r < 0 for r in old_rows):
            self.capacity = width + HEADROOM_TOKENS
            self.num_rows = g + HEADROOM_ROWS
            self._buffers = {}
            self.num_refreshes += 1
            self._tables, self._lens = [list(t) for t in tables], list(lens)
            rows = torch.arange(g)
            return StagePlan(self, True, rows, rows, True, None, None, width, new_slots,
                             positions, self.capacity, self.num_rows)
        row_of, moves, newcomers = assign_rows(old_rows, g)
        if moves or newcomers:
            self.num_remaps += 1
            self.num_rows_moved += len(moves)
            self.num_rows_gathered += len(newcomers)
        else:
            self.num_appends += 1
        self._tables, self._lens = [[] for _ in range(g)], [0] * g
        for b, row in enumerate(row_of):
            self._tables[row], self._lens[row] = list(tables[b]), lens[b]
        row_t = torch.tensor(row_of, dtype=torch.int64)
        order = torch.empty_like(row_t)
        order[row_t] = torch.arange(g)
        return StagePlan(
            self, False, row_t, order, row_of == list(range(g)),
            _pairs(moves), _pairs([(b, row_of[b]) for b in newcomers]),
            width, new_slots, positions, self.capacity, self.num_rows)

    def follow(self, plan: StagePlan) -> StagePlan:
        """Another rank's plan for this step (tensor parallelism: rank 0 plans, every rank
        keeps the K/V of its own heads for the same rows) as this stage's: its copy sized
        as the planner's, its remap applied once per layer. The planner's bookkeeping of
        which sequence holds which row stays the planner's; this stage only follows."""
        if plan.refresh:
            self._buffers = {}
            self.num_refreshes += 1
        self.capacity, self.num_rows = plan.capacity, plan.num_rows
        self._remapped = set()
        return replace(plan, stage=self)

    def _match(self, tables: list[list[int]], lens: list[int]) -> list[int] | None:
        """Per sequence of the new group, the row of the kept copy it continues (one token
        longer, the same blocks under the kept tokens) or -1; None without a copy. Rows
        with the same blocks and length hold the same K/V, so any of them will do."""
        if not self._lens:
            return None
        bs = self.block_size
        rows: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for i, (table, n) in enumerate(zip(self._tables, self._lens, strict=True)):
            rows.setdefault((tuple(table[: -(-n // bs)]), n), []).append(i)
        matched = []
        for table, n in zip(tables, lens, strict=True):
            candidates = rows.get((tuple(table[: -(-(n - 1) // bs)]), n - 1))
            matched.append(candidates.pop(0) if candidates else -1)
        return matched

    def keys_values(self, kv_cache_layer: torch.Tensor, key_blocks: torch.Tensor,
                    plan: StagePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [G, kv_heads, width, d] of the group for one layer in row order (row r
        holds sequence `plan.order[r]`), from the kept copy with this step's token (already
        in the cache) appended, or, on refresh, from one gather of `key_blocks`."""
        refreshed = plan.refresh or kv_cache_layer.data_ptr() not in self._buffers
        buf = self.history(kv_cache_layer, key_blocks, plan)
        if not refreshed:
            num_kv_heads, head_dim = kv_cache_layer.shape[-2:]
            new = kv_cache_layer.view(2, -1, num_kv_heads, head_dim)[:, plan.new_slots]
            # buf[:, row_of[g], :, pos[g]] has shape [G, 2, kvh, d]: advanced indices lead.
            buf[:, plan.row_of, :, plan.new_positions] = new.transpose(0, 1)
        g = plan.num_seqs
        return buf[0, :g, :, : plan.width], buf[1, :g, :, : plan.width]

    def history(self, kv_cache_layer: torch.Tensor, key_blocks: torch.Tensor,
                plan: StagePlan) -> torch.Tensor:
        """The kept copy [2, rows, kv_heads, capacity, d] of one layer, whose rows [0, G)
        hold the group, before this step's token is written (the compiled decode,
        cpu_decode.py): gathered on refresh, else remapped once per step (rows moved down,
        newcomers gathered). Position S - 1 of each sequence (its new token) is stale until
        `append`."""
        num_kv_heads, head_dim = kv_cache_layer.shape[-2:]
        key = kv_cache_layer.data_ptr()
        buf = self._buffers.get(key)
        g = plan.num_seqs
        if plan.refresh or buf is None:
            # Zeroed: padding positions are masked, but a masked NaN would still poison the
            # weighted sum of values (0 * NaN).
            buf = kv_cache_layer.new_zeros(2, self.num_rows, num_kv_heads, self.capacity,
                                           head_dim)
            _gather_rows(buf, kv_cache_layer, key_blocks, g, plan.order, torch.arange(g))
            self._buffers[key] = buf
        elif key not in self._remapped:
            if plan.moves is not None:
                src, dst = plan.moves
                buf[:, dst] = buf[:, src]
            if plan.gathers is not None:
                _gather_rows(buf, kv_cache_layer, key_blocks, g, *plan.gathers)
            self._remapped.add(key)
        return buf

    def append(self, kv_cache_layer: torch.Tensor, plan: StagePlan, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """Write this step's k, v [G, kv_heads, d] (batch order) at each sequence's row
        and new position."""
        buf = self._buffers[kv_cache_layer.data_ptr()]
        buf[0, plan.row_of, :, plan.new_positions] = k
        buf[1, plan.row_of, :, plan.new_positions] = v


def assign_rows(old_rows: list[int], g: int) -> tuple[list[int], list[tuple[int, int]],
                                                       list[int]]:
    """Rows of a new group of g sequences, given the row each continued (-1: newcomer).

    Returns (row_of [g]: a permutation of range(g); moves: (src, dst) pairs, a continuing
    sequence whose row is >= g copied down into a free row < g; newcomers: the group
    indices whose history must be gathered). A continuing sequence whose row is < g keeps
    it, so the copying is only what the shrinking group forces.
    """
    row_of = [r if 0 <= r < g else -1 for r in old_rows]
    free = sorted(set(range(g)) - {r for r in row_of if r >= 0}, reverse=True)
    moves, newcomers = [], []
    for b, r in enumerate(old_rows):
        if row_of[b] >= 0:
            continue
        row_of[b] = free.pop()
        if r >= 0:
            moves.append((r, row_of[b]))
        else:
            newcomers.append(b)
    return row_of, moves, newcomers


def _pairs(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not pairs:
        return None
    t = torch.tensor(pairs, dtype=torch.int64)
    return t[:, 0].contiguous(), t[:, 1].contiguous()


def _gather_rows(buf: torch.Tensor, kv_cache_layer: torch.Tensor, key_blocks: torch.Tensor,
                 g: int, members: torch.Tensor, rows: torch.Tensor) -> None:
    """Copy the paged history of the group's sequences `members` (int64 [R], group
    indices) into `rows` (int64 [R]) of `buf` [2, rows, kvh, capacity, d]; `key_blocks` is
    the group's [g * max_blocks] block ids, row-major in group order."""
    num_kv_heads, head_dim = kv_cache_layer.shape[-2:]
    blocks = key_blocks.view(g, -1)[members].flatten()
    gathered = kv_cache_layer.index_select(1, blocks)  # [2, R * mb, bs, kvh, d]
    gathered = gathered.view(2, members.numel(), -1, num_kv_heads, head_dim).transpose(2, 3)
    buf[:, rows, :, : gathered.shape[3]] = gathered  # [2, R, kvh, mb * bs, d]
