"""Kept K/V for plain decode on the CPU, so that a step does not re-gather every history.

The CPU attention attends each query-length group over a padded `[G, kv_heads, S_pad, d]`
copy of its sequences' K/V. Gathering that copy from the paged cache costs as much as the
attention itself at batch 64 (every sequence's whole history, per layer, per step). In
plain decode the batch rarely changes between steps, so the `DecodeStage` keeps the copy
of the decode group (query length 1) from one forward to the next and only appends each
sequence's new token.

Contract: the copy is valid only if the previous forward of the model was the stage's own
(nothing else wrote the cache in between) and the group is the same sequences in the same
order, each one token longer, with the same blocks under the tokens kept. Anything else
rebuilds it with one gather, which is what every step did before. The model runner calls
`invalidate` after any forward that did not use the stage, after a forward that failed and
whenever it moves K/V itself (speculative KV compaction), so a stale copy is never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADROOM_TOKENS = 64  # appended steps before the copy must grow (and be re-gathered)


@dataclass(frozen=True)
class StagePlan:
    """This forward's use of the stage for one decode group of G sequences.

    refresh: gather the whole copy (every layer) instead of appending.
    width: the padded key length S_pad the group's mask was built for.
    new_slots / new_positions: int64 [G], cache slot and position of each sequence's new
    token (the one appended).
    """

    stage: DecodeStage
    refresh: bool
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

    def invalidate(self) -> None:
        """Forget the copy (the next decode forward re-gathers); frees its memory."""
        self._tables, self._lens, self._buffers, self.capacity = [], [], {}, 0

    def plan(self, tables: list[list[int]], lens: list[int], width: int,
             new_slots: torch.Tensor) -> StagePlan:
        """Decide refresh or append for a decode group (block tables and KV lengths after
        this step, this step's new-token slots) and remember the group for the next step."""
        refresh = not self._continues(tables, lens) or width > self.capacity
        if refresh:
            self.capacity = width + HEADROOM_TOKENS
            self._buffers = {}
            self.num_refreshes += 1
        else:
            self.num_appends += 1
        self._tables, self._lens = [list(t) for t in tables], list(lens)
        positions = torch.tensor(lens, dtype=torch.int64) - 1
        return StagePlan(self, refresh, width, new_slots, positions, torch.arange(len(lens)))

    def _continues(self, tables: list[list[int]], lens: list[int]) -> bool:
        if not self._lens or len(lens) != len(self._lens):
            return False
        bs = self.block_size
        for table, n, old_table, old_n in zip(tables, lens, self._tables, self._lens,
                                              strict=True):
            kept = -(-old_n // bs)
            if n != old_n + 1 or table[:kept] != old_table[:kept]:
                return False
        return True

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
        if plan.refresh or buf is None:
            g = plan.new_slots.shape[0]
            gathered = kv_cache_layer.index_select(1, key_blocks)  # [2, G*mb, bs, kvh, d]
            gathered = gathered.view(2, g, -1, num_kv_heads, head_dim).transpose(2, 3)
            buf = kv_cache_layer.new_zeros(2, g, num_kv_heads, self.capacity, head_dim)
            buf[:, :, :, : gathered.shape[3]] = gathered
            self._buffers[key] = buf
        return buf

    def append(self, kv_cache_layer: torch.Tensor, plan: StagePlan, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """Write this step's k, v [G, kv_heads, d] at each sequence's new position."""
        buf = self._buffers[kv_cache_layer.data_ptr()]
        buf[0, plan.rows, :, plan.new_positions] = k
        buf[1, plan.rows, :, plan.new_positions] = v

