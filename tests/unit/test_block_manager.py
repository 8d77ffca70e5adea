"""Block manager: allocation, reference counts, prefix reuse and LRU eviction (no torch)."""

from __future__ import annotations

import pytest

from specd.ipc.sampling import SamplingParams
from specd.workers.engine.block_manager import BlockManager
from specd.workers.engine.sequence import Sequence

BLOCK = 4


def make_seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, token_ids, SamplingParams())


def compute_all(manager: BlockManager, seq: Sequence) -> None:
    """What the scheduler does once a step has computed every token of seq."""
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_computed_blocks(seq)


def test_allocate_covers_every_token_and_free_returns_the_blocks() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = make_seq("a", list(range(9)))
    assert manager.allocate(seq) == 0
    assert len(seq.block_ids) == 3 and len(set(seq.block_ids)) == 3
    assert manager.num_free_blocks == 5
    assert manager.stats().usage == pytest.approx(3 / 8)
    manager.free(seq)
    assert seq.block_ids == [] and manager.num_free_blocks == 8


def test_a_shared_prefix_is_reused_with_reference_counts() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    first = make_seq("a", list(range(10)))  # blocks [0-3] [4-7] [8 9]
    manager.allocate(first)
    compute_all(manager, first)
    second = make_seq("b", list(range(8)) + [50, 51, 52])  # shares the two full blocks
    assert manager.allocate(second) == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    assert [manager.blocks[b].ref_count for b in first.block_ids] == [2, 2, 1]
    assert manager.num_free_blocks == 8 - 4
    assert manager.stats().prefix_hit_tokens == 8
    assert manager.stats().prefix_query_tokens == 10 + 11

    manager.free(first)  # the shared blocks stay held by the second sequence
    assert [manager.blocks[b].ref_count for b in second.block_ids] == [1, 1, 1]
    assert manager.num_free_blocks == 8 - 3
    manager.free(second)
    assert manager.num_free_blocks == 8


def test_the_last_prompt_token_is_never_served_from_the_cache() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    first = make_seq("a", list(range(8)))
    manager.allocate(first)
    compute_all(manager, first)
    same = make_seq("b", list(range(8)))
    assert manager.allocate(same) == 4, "only the first block: the last token needs logits"
    assert same.block_ids[0] == first.block_ids[0] and same.block_ids[1] != first.block_ids[1]


def test_only_computed_full_blocks_are_shared() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    first = make_seq("a", list(range(10)))
    manager.allocate(first)
    first.num_computed_tokens = 6  # a prefill chunk: block 0 is full and computed, block 1 not
    manager.cache_computed_blocks(first)
    assert manager.allocate(make_seq("b", list(range(10)))) == 4
    compute_all(manager, first)
    assert manager.stats().num_cached_blocks == 2  # the partial block [8, 9] is not registered
    assert manager.allocate(make_seq("c", list(range(10)) + [99])) == 8


def test_a_block_matches_only_after_the_same_prefix() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    first = make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    manager.allocate(first)
    compute_all(manager, first)
    # Same second block, different first block: the chained hash must not match it.
    assert manager.allocate(make_seq("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])) == 0


def test_freed_blocks_stay_reusable_until_evicted_least_recently_freed_first() -> None:
    manager = BlockManager(num_blocks=7, block_size=BLOCK)
    old = make_seq("old", list(range(9)))  # 3 blocks, 2 of them full
    manager.allocate(old)
    compute_all(manager, old)
    old_blocks = list(old.block_ids)
    manager.free(old)
    assert manager.num_free_blocks == 7 and manager.stats().num_cached_blocks == 2

    # A newcomer reuses the cached blocks even though no sequence holds them.
    again = make_seq("again", list(range(8)) + [77])
    assert manager.allocate(again) == 8 and again.block_ids[:2] == old_blocks[:2]
    manager.free(again)

    # Taking 6 of the 7 blocks for other tokens hands out never-cached blocks first, then the
    # freed prefix tail first: its second block is evicted, its head survives.
    filler = make_seq("filler", [100 + i for i in range(24)])
    manager.allocate(filler)
    assert old_blocks[1] in filler.block_ids and old_blocks[0] not in filler.block_ids
    assert manager.stats().num_cached_blocks == 1
    manager.free(filler)
    assert manager.allocate(make_seq("probe", list(range(8)) + [5])) == 4


def test_can_allocate_counts_idle_cached_blocks_against_the_free_list() -> None:
    manager = BlockManager(num_blocks=3, block_size=BLOCK)
    first = make_seq("a", list(range(9)))
    manager.allocate(first)
    compute_all(manager, first)
    manager.free(first)
    # 2 cached idle blocks + 1 new block = all 3 free blocks: fits exactly.
    assert manager.can_allocate(make_seq("b", list(range(9))))
    # 2 cached + 2 new blocks do not fit in 3.
    too_long = make_seq("c", list(range(13)))
    assert not manager.can_allocate(too_long)
    with pytest.raises(ValueError, match="not enough free blocks"):
        manager.allocate(too_long)


def test_append_slots_grows_at_block_boundaries_only() -> None:
    manager = BlockManager(num_blocks=3, block_size=BLOCK)
    seq = make_seq("a", [1, 2, 3])
    manager.allocate(seq)
    seq.num_computed_tokens = 3
    assert manager.num_blocks_to_append(seq, 1) == 0  # slot 3 is in block 0
    seq.output_token_ids.append(4)
    seq.num_computed_tokens = 4
    manager.append_slots(seq, 1)  # slot 4 needs block 1
    assert len(seq.block_ids) == 2
    manager.append_slots(seq, 8)  # slots 4..11: one more block (speculative drafts, say)
    assert len(seq.block_ids) == 3 and manager.num_free_blocks == 0
    assert not manager.can_append_slots(seq, 9)
    with pytest.raises(ValueError, match="needs 1 blocks, 0 free"):
        manager.append_slots(seq, 9)


def test_prefix_caching_off_never_shares() -> None:
    manager = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    first = make_seq("a", list(range(9)))
    manager.allocate(first)
    compute_all(manager, first)
    second = make_seq("b", list(range(9)))
    assert manager.allocate(second) == 0
    assert not set(first.block_ids) & set(second.block_ids)
    assert manager.stats().num_cached_blocks == 0


def test_allocating_twice_is_an_error() -> None:
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    seq = make_seq("a", [1, 2])
    manager.allocate(seq)
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate(seq)


def test_a_hash_collision_is_not_a_hit() -> None:
    # CPython hashes -1 and -2 alike, so these two blocks' keys collide (real token ids are
    # never negative; this only manufactures a collision). The key comparison must reject it.
    manager = BlockManager(num_blocks=8, block_size=BLOCK)
    assert hash((None, (-1, 5, 6, 7))) == hash((None, (-2, 5, 6, 7)))
    first = make_seq("a", [-1, 5, 6, 7, 8])
    manager.allocate(first)
    compute_all(manager, first)
    assert manager.allocate(make_seq("b", [-2, 5, 6, 7, 8])) == 0
    assert manager.allocate(make_seq("c", [-1, 5, 6, 7, 8])) == 4
