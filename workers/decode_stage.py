"""Kept K/V for plain decode on the CPU, so that a step does not re-gather every history.

The CPU attention attends each query-length group over a padded `[G, kv_heads, S_pad, d]`
copy of its sequences' K/V. Gathering that copy from the paged cache costs as much as the
attention itself at batch 64 (every sequence's whole history, per layer, per step). In
plain decode the batch rarely changes between steps, so the `DecodeStage` keeps the copy
of the decode group (query length 1) from one forward to the next and only appends each
sequence's new token.

Contract: a kept row is valid only if the previous forward of the model was the stage's own
(nothing else wrote the cache in between) and its sequence is one token longer, with the
same blocks under the tokens kept. When requests finish and others join (every step or two
under a steady, staggered load), the rows of the sequences that continue are carried over
to their new places and only the newcomers are gathered (a "remap"); a group with no
continuing row, or longer than the copy's capacity, is rebuilt with one gather (a
"refresh"), which is what every step did before. The model runner calls `invalidate` after
any forward that did not use the stage, after a forward that failed and whenever it moves
K/V itself (speculative KV compaction), so a stale copy is never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADROOM_TOKENS = 64  # appended steps before the copy must grow (and be re-gathered)


@dataclass(frozen=True)
class StagePlan:
    """This forward's use of the stage for one decode group of G sequences.

    refresh: gather the whole copy (every layer) instead of appending.
    reuse: when not None (a remap), int64 [G]: the row of the previous copy that row g
        continues, or -1 for a newcomer whose history is gathered.
    width: the padded key length S_pad the group's mask was built for.
    new_slots / new_positions: int64 [G], cache slot and position of each sequence's new
    token (the one appended).
    """

    stage: DecodeStage
    refresh: bool
    reuse: torch.Tensor | None
    width: int
    new_slots: torch.Tensor
    new_positions: torch.Tensor
    rows: torch.Tensor  # arange(G): the copy's sequence index of each new token


class DecodeStage:
    """Per layer (keyed by the layer's cache storage), a `[2, G, kv_heads, capacity, d]`
    copy of the decode group's K/V. Owned by the model runner; CPU only."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.capacity = 0
        self._tables: list[list[int]] = []
        self._lens: list[int] = []
        self._buffers: dict[int, torch.Tensor] = {}
        self.num_refreshes = 0  # figures for tests and profiling
        self.num_appends = 0
        self.num_remaps = 0
        # Layers whose copy this step's remap has been applied to (a layer may ask twice in
        # one step: an eager retry after a failed compiled call must not remap again).
        self._remapped: set[int] = set()

    def invalidate(self) -> None:
        """Forget the copy (the next decode forward re-gathers); frees its memory."""
        self._tables, self._lens, self._buffers, self.capacity = [], [], {}, 0

    def plan(self, tables: list[list[int]], lens: list[int], width: int,
             new_slots: torch.Tensor) -> StagePlan:
        """Decide append, remap or refresh for a decode group (block tables and KV lengths
        after this step, this step's new-token slots) and remember the group for the next
        step."""
        reuse = self._match(tables, lens) if width <= self.capacity else None
        refresh = reuse is None or all(r < 0 for r in reuse)
        if refresh:
            reuse = None
            self.capacity = width + HEADROOM_TOKENS
            self._buffers = {}
            self.num_refreshes += 1
        elif reuse == list(range(len(self._lens))):
            reuse = None  # the same sequences in the same order: append only
            self.num_appends += 1
        else:
            self.num_remaps += 1
        self._remapped = set()
        self._tables, self._lens = [list(t) for t in tables], list(lens)
        positions = torch.tensor(lens, dtype=torch.int64) - 1
        return StagePlan(self, refresh, None if reuse is None else torch.tensor(reuse), width,
                         new_slots, positions, torch.arange(len(lens)))

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
        reuse = []
        for table, n in zip(tables, lens, strict=True):
            candidates = rows.get((tuple(table[: -(-(n - 1) // bs)]), n - 1))
            reuse.append(candidates.pop(0) if candidates else -1)
        return reuse

    def keys_values(self, kv_cache_layer: torch.Tensor, key_blocks: torch.Tensor,
                    plan: StagePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [G, kv_heads, width, d] of the group for one layer, from the kept copy
        (appending this step's token, already in the cache) or, on refresh, from one gather
        of `key_blocks`."""
        refreshed = plan.refresh or kv_cache_layer.data_ptr() not in self._buffers
        buf = self.history(kv_cache_layer, key_blocks, plan)
        if not refreshed:
            num_kv_heads, head_dim = kv_cache_layer.shape[-2:]
            new = kv_cache_layer.view(2, -1, num_kv_heads, head_dim)[:, plan.new_slots]
            # buf[:, g, :, pos[g]] has shape [G, 2, kvh, d]: advanced indices lead.
            buf[:, plan.rows, :, plan.new_positions] = new.transpose(0, 1)
        return buf[0, :, :, : plan.width], buf[1, :, :, : plan.width]

    def history(self, kv_cache_layer: torch.Tensor, key_blocks: torch.Tensor,
                plan: StagePlan) -> torch.Tensor:
        """The kept copy [2, G, kv_heads, capacity, d] of one layer before this step's
        token is written (the compiled decode, cpu_decode.py): gathered on refresh, as is
        otherwise. Position S - 1 of each sequence (its new token) is stale until `append`."""
        num_kv_heads, head_dim = kv_cache_layer.shape[-2:]
        key = kv_cache_layer.data_ptr()
        buf = self._buffers.get(key)
        g = plan.new_slots.shape[0]
        if plan.refresh or buf is None:
            buf = kv_cache_layer.new_zeros(2, g, num_kv_heads, self.capacity, head_dim)
            _gather_rows(buf, kv_cache_layer, key_blocks, torch.arange(g))
            self._buffers[key] = buf
        elif plan.reuse is not None and key not in self._remapped:
            old, reuse = buf, plan.reuse
            buf = kv_cache_layer.new_zeros(2, g, num_kv_heads, self.capacity, head_dim)
            kept = (reuse >= 0).nonzero().flatten()
            buf[:, kept] = old[:, reuse[kept]]
            _gather_rows(buf, kv_cache_layer, key_blocks, (reuse < 0).nonzero().flatten())
            self._buffers[key] = buf
            self._remapped.add(key)
        return buf

    def append(self, kv_cache_layer: torch.Tensor, plan: StagePlan, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """Write this step's k, v [G, kv_heads, d] at each sequence's new position."""
        buf = self._buffers[kv_cache_layer.data_ptr()]
        buf[0, plan.rows, :, plan.new_positions] = k
        buf[1, plan.rows, :, plan.new_positions] = v


def _gather_rows(buf: torch.Tensor, kv_cache_layer: torch.Tensor, key_blocks: torch.Tensor,
                 rows: torch.Tensor) -> None:
    """Copy the paged history of the group's `rows` (int64 [R]) into `buf` [2, G, kvh,
    capacity, d]; `key_blocks` is the group's [G * max_blocks] block ids, row-major."""
    if rows.numel() == 0:
        return
    num_kv_heads, head_dim = kv_cache_layer.shape[-2:]
    g = buf.shape[1]
    blocks = key_blocks.view(g, -1)[rows].flatten()
    gathered = kv_cache_layer.index_select(1, blocks)  # [2, R * mb, bs, kvh, d]
    gathered = gathered.view(2, rows.numel(), -1, num_kv_heads, head_dim).transpose(2, 3)
    buf[:, rows, :, : gathered.shape[3]] = gathered
