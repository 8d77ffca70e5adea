"""The kept decode K/V (decode_stage.py): attention over it equals attention over a fresh
gather at every step, and it is rebuilt whenever the group or the cache changed under it."""

from __future__ import annotations

import torch

from specd.workers.runner.attention import build_attention_metadata, paged_attention_cpu, store_kv
from specd.workers.runner.cpu_backend import CpuBackend
from specd.workers.runner.decode_stage import DecodeStage, assign_rows

BLOCK_SIZE = 4
NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 2, 4, 8
CPU = torch.device("cpu")


class Cache:
    """A paged cache with sequences whose blocks are handed out in scrambled order."""

    def __init__(self, seed: int, num_blocks: int = 64) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.kv = torch.zeros(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()

    def table_for(self, table: list[int], length: int) -> list[int]:
        while len(table) * BLOCK_SIZE < length:
            table.append(self.free.pop())
        return table

    def write(self, tables: list[list[int]], positions: list[list[int]]) -> None:
        """Random K/V for the given positions of each sequence (as `store_kv` would)."""
        slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                 for t, ps in zip(tables, positions, strict=True) for p in ps]
        k = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=self.gen)
        v = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=self.gen)
        store_kv(k, v, self.kv, torch.tensor(slots))


def decode_both(cache: Cache, stage: DecodeStage, tables: list[list[int]], lens: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step (new token at position len - 1 written first): staged and fresh."""
    cache.write(tables, [[n - 1] for n in lens])
    q = torch.randn(len(lens), NUM_HEADS, HEAD_DIM, generator=cache.gen)
    args = ([1] * len(lens), lens, tables, BLOCK_SIZE, CPU)
    staged = paged_attention_cpu(q, cache.kv, build_attention_metadata(*args, stage=stage), 0.3)
    fresh = paged_attention_cpu(q, cache.kv, build_attention_metadata(*args), 0.3)
    return staged, fresh


def test_appending_steps_match_a_fresh_gather_and_do_not_regather() -> None:
    cache, stage = Cache(0), DecodeStage(BLOCK_SIZE)
    lens = [3, 9, 4]
    tables = [cache.table_for([], n) for n in lens]
    cache.write(tables, [list(range(n - 1)) for n in lens])  # the prompts
    for step in range(80):  # past HEADROOM_TOKENS, so the copy also grows once
        tables = [cache.table_for(t, n) for t, n in zip(tables, lens, strict=True)]
        staged, fresh = decode_both(cache, stage, tables, lens)
        torch.testing.assert_close(staged, fresh, atol=1e-6, rtol=1e-6, msg=f"step {step}")
        lens = [n + 1 for n in lens]
    assert stage.num_appends >= 78
    assert stage.num_refreshes == 2  # the first step and the one that outgrew the headroom


def test_a_leaving_sequence_keeps_the_others_rows_and_an_invalidation_rebuilds() -> None:
    cache, stage = Cache(1), DecodeStage(BLOCK_SIZE)
    lens = [5, 6]
    tables = [cache.table_for([], n) for n in lens]
    cache.write(tables, [list(range(n - 1)) for n in lens])
    decode_both(cache, stage, tables, lens)
    # A sequence leaves: the other's row moves to its new place, nothing is re-gathered.
    tables, lens = tables[1:], [7]
    staged, fresh = decode_both(cache, stage, [cache.table_for(tables[0], 7)], lens)
    torch.testing.assert_close(staged, fresh)
    assert (stage.num_refreshes, stage.num_remaps) == (1, 1)
    # Something rewrote the cache (KV compaction, a verify pass): the runner invalidates.
    cache.write(tables, [[2, 3]])
    stage.invalidate()
    staged, fresh = decode_both(cache, stage, tables, [8])
    torch.testing.assert_close(staged, fresh)
    assert stage.num_refreshes == 2


def test_a_length_that_does_not_continue_the_last_step_rebuilds_the_copy() -> None:
    cache, stage = Cache(2), DecodeStage(BLOCK_SIZE)
    tables = [cache.table_for([], 12)]
    cache.write(tables, [list(range(11))])
    decode_both(cache, stage, tables, [6])
    # Two tokens later (a verify step accepted one draft, say): not a continuation.
    staged, fresh = decode_both(cache, stage, tables, [8])
    torch.testing.assert_close(staged, fresh)
    assert (stage.num_refreshes, stage.num_appends) == (2, 0)


def test_requests_leaving_and_joining_every_step_are_remapped_not_regathered() -> None:
    # A steady, staggered load: each step one sequence may finish and a new one join (its
    # prompt already in the cache), in changing positions of the group. (Blocks are not
    # reused here; in the engine a newcomer's prefill step comes between a departure and
    # its first decode, and that step's plan already drops the departed row.)
    cache, stage = Cache(3, num_blocks=512), DecodeStage(BLOCK_SIZE)
    gen = torch.Generator().manual_seed(7)
    group: list[tuple[list[int], int]] = []  # (table, length) per sequence, in order
    departures = arrivals = 0
    for step in range(60):
        group = [(t, n + 1) for t, n in group]
        if group and torch.rand(1, generator=gen).item() < 0.5:
            group.pop(int(torch.randint(len(group), (1,), generator=gen)))
            departures += 1
        if len(group) < 6:
            arrivals += 1
            n = int(torch.randint(2, 20, (1,), generator=gen))
            table = cache.table_for([], n)
            cache.write([table], [list(range(n - 1))])  # its prefill
            group.insert(int(torch.randint(len(group) + 1, (1,), generator=gen)), (table, n))
        tables = [cache.table_for(t, n) for t, n in group]
        staged, fresh = decode_both(cache, stage, tables, [n for _, n in group])
        torch.testing.assert_close(staged, fresh, atol=1e-6, rtol=1e-6, msg=f"step {step}")
    assert stage.num_remaps >= 30
    assert stage.num_refreshes <= 3  # the first step, and growth past the headroom
    # Rows stay put: only a shrinking group moves a row (at most one per departure), and
    # only newcomers are gathered.
    assert stage.num_rows_moved <= departures
    assert stage.num_rows_gathered <= arrivals


def test_a_retried_layer_is_not_remapped_twice() -> None:
    # The compiled decode reads `history`, fails, and the eager step reads it again.
    cache, stage = Cache(4), DecodeStage(BLOCK_SIZE)
    tables = [cache.table_for([], 6), cache.table_for([], 9)]
    cache.write(tables, [list(range(5)), list(range(8))])
    decode_both(cache, stage, tables, [6, 9])
    tables = [tables[1], cache.table_for([], 4)]
    cache.write(tables[1:], [list(range(3))])
    cache.write(tables, [[9], [3]])  # this step's new tokens
    lens = [10, 4]
    meta = build_attention_metadata([1, 1], lens, tables, BLOCK_SIZE, CPU, stage=stage)
    (group,) = meta.groups
    assert group.stage_plan is not None and group.stage_plan.gathers is not None
    first = stage.history(cache.kv, group.key_blocks, group.stage_plan).clone()
    again = stage.history(cache.kv, group.key_blocks, group.stage_plan)
    torch.testing.assert_close(first, again)


def test_plain_engine_steps_use_the_stage() -> None:
    import specd

    engine = specd.Engine(None, dtype="float32", spec_mode="off")
    engine.generate(["def f(x):\n", "import os\n"], specd.SamplingParams(max_tokens=12))
    backend = engine.core.runner.backend
    assert isinstance(backend, CpuBackend)
    stage = backend.stage
    assert stage is not None and stage.num_appends > 0


def test_rows_are_kept_and_only_a_shrinking_group_moves_rows() -> None:
    # Rows 0-4 held five sequences; now rows 1 and 3 left and two newcomers came, first
    # and last in the batch: the sequences keep rows 0, 2 and 4 and the newcomers take the
    # free rows 1 and 3; nothing is copied.
    row_of, moves, newcomers = assign_rows([-1, 4, 0, 2, -1], 5)
    assert row_of == [1, 4, 0, 2, 3] and moves == [] and newcomers == [0, 4]
    # Three of five left, none came: rows 3 and 4 lie past the group of two and move down.
    row_of, moves, newcomers = assign_rows([4, 3], 2)
    assert sorted(row_of) == [0, 1] and moves == [(4, row_of[0]), (3, row_of[1])]
    assert newcomers == []
    # The same sequences in another batch order: rows kept, no copying.
    assert assign_rows([2, 0, 1], 3) == ([2, 0, 1], [], [])


def test_a_group_in_another_order_than_its_rows_attends_each_sequence_to_its_own_row() -> None:
    cache, stage = Cache(5), DecodeStage(BLOCK_SIZE)
    lens = [5, 9, 3, 7]
    tables = [cache.table_for([], n) for n in lens]
    cache.write(tables, [list(range(n - 1)) for n in lens])
    decode_both(cache, stage, tables, lens)
    # The second sequence leaves and a newcomer joins in front: the batch order is no
    # longer the rows' order, and the queries are permuted for the kept rows.
    new_table = cache.table_for([], 4)
    cache.write([new_table], [list(range(3))])
    tables = [new_table, tables[0], tables[2], tables[3]]
    lens = [4, 6, 4, 8]
    tables = [cache.table_for(t, n) for t, n in zip(tables, lens, strict=True)]
    for step in range(3):
        staged, fresh = decode_both(cache, stage, tables, lens)
        torch.testing.assert_close(staged, fresh, atol=1e-6, rtol=1e-6, msg=f"step {step}")
        lens = [n + 1 for n in lens]
        tables = [cache.table_for(t, n) for t, n in zip(tables, lens, strict=True)]
    assert (stage.num_refreshes, stage.num_remaps, stage.num_rows_moved) == (1, 1, 0)
    assert stage.num_appends == 2
