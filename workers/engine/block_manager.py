"""The paged KV cache's bookkeeping: which blocks each sequence owns (plain Python, no torch).

The cache is `num_blocks` blocks of `block_size` token slots. A sequence's token i lives in
slot `block_ids[i // block_size] * block_size + i % block_size`.

Prefix reuse: once every token of a full block is computed, the block is registered under
a hash of its token ids chained with the previous block's hash (so a hash names the whole
prefix, as in vLLM and nano-vllm). A later sequence whose prompt starts with the same full
blocks takes them instead of computing them (reference count + 1). Only full, computed
blocks are shared, so a shared block is never written again. A block whose count drops to
0 keeps its hash and stays reusable until it is handed out for new tokens: free blocks are
handed out least recently freed first (LRU), and a sequence's blocks are freed tail first,
so a prefix's head outlives its tail.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from specd.workers.engine.sequence import Sequence

# A registered block's identity: (previous block's hash or None, this block's token ids).
BlockKey = tuple[int | None, tuple[int, ...]]


class Block:
    """One block's state. `key`/`hash` are set once its tokens are computed and registered."""

    __slots__ = ("block_id", "ref_count", "key", "hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: BlockKey | None = None
        self.hash: int | None = None


@dataclass(frozen=True)
class BlockManagerStats:
    num_blocks: int
    num_free_blocks: int  # includes cached blocks no sequence holds (reusable until evicted)
    num_cached_blocks: int  # blocks registered for prefix reuse, held or not
    usage: float  # fraction of blocks held by sequences
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache, cumulative
    prefix_hit_tokens: int  # of those, found cached

    @property
    def prefix_hit_rate(self) -> float:
        if self.prefix_query_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens


class BlockManager:
    """Fixed-size blocks, a free list, reference counts and hash-based prefix reuse."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first (the order values are handed out).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        # How many leading blocks of each holding sequence are registered (by request id).
        self.num_registered: dict[str, int] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether `allocate(seq)` would find blocks for all of seq's tokens."""
        hits = self._find_cached(seq)
        return self._fits(hits, self.num_blocks_for(seq.num_tokens) - len(hits))

    def allocate(self, seq: Sequence) -> int:
        """Give a sequence with no blocks blocks for all its tokens; return how many leading
        tokens are already cached (a multiple of block_size, always < seq.num_tokens so that
        the last token is computed and gives logits). Sets `seq.block_ids`."""
        if seq.block_ids:
            raise ValueError(f"request {seq.request_id} already holds blocks {seq.block_ids}")
        hits = self._find_cached(seq)
        num_new = self.num_blocks_for(seq.num_tokens) - len(hits)
        if not self._fits(hits, num_new):
            raise ValueError(f"request {seq.request_id}: not enough free blocks "
                             f"({self.num_free_blocks}) for {seq.num_tokens} tokens")
        for block_id in hits:
            self._take(block_id)
        seq.block_ids = hits + [self._take_free() for _ in range(num_new)]
        self.num_registered[seq.request_id] = len(hits)
        if self.enable_prefix_caching:
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def num_blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_ids))

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether slots for tokens [num_computed_tokens, + num_new_tokens) can be found."""
        return self.num_blocks_to_append(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend `seq.block_ids` to cover tokens [num_computed_tokens, + num_new_tokens)."""
        num_blocks = self.num_blocks_to_append(seq, num_new_tokens)
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"request {seq.request_id}: needs {num_blocks} blocks, "
                             f"{self.num_free_blocks} free")
        seq.block_ids.extend(self._take_free() for _ in range(num_blocks))

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register seq's full blocks whose tokens are all computed, for reuse by others."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        start = self.num_registered.get(seq.request_id, 0)
        if num_full <= start:
            return
        token_ids = seq.all_token_ids
        prev_hash = self.blocks[seq.block_ids[start - 1]].hash if start else None
        for i in range(start, num_full):
            block = self.blocks[seq.block_ids[i]]
            key = self._block_key(token_ids, i, prev_hash)
            block.key, block.hash = key, hash(key)
            # Another sequence may have registered the same content first; keep that one.
            self.hash_to_block_id.setdefault(block.hash, block.block_id)
            prev_hash = block.hash
        self.num_registered[seq.request_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks (tail first, so a prefix's tail is evicted before its head)."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_ids = []
        self.num_registered.pop(seq.request_id, None)

    def stats(self) -> BlockManagerStats:
        return BlockManagerStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=len(self.hash_to_block_id),
            usage=1.0 - self.num_free_blocks / self.num_blocks,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
        )

    def _find_cached(self, seq: Sequence) -> list[int]:
        """Block ids of seq's longest cached prefix of full blocks, leaving its last token out
        (none for a request that wants its prompt's log-probabilities: every prompt row must
        be computed)."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        token_ids = seq.all_token_ids
        hits: list[int] = []
        prev_hash: int | None = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            key = self._block_key(token_ids, i, prev_hash)
            block_id = self.hash_to_block_id.get(hash(key))
            # Compare the key, not only its hash: a hash collision must not serve wrong KV.
            if block_id is None or self.blocks[block_id].key != key:
                break
            hits.append(block_id)
            prev_hash = hash(key)
        return hits

    def _fits(self, hits: list[int], num_new: int) -> bool:
        # Cached blocks no one holds sit in the free list too: taking them uses it up as well.
        num_idle_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return num_new + num_idle_hits <= self.num_free_blocks

    def _block_key(self, token_ids: list[int], index: int, prev_hash: int | None) -> BlockKey:
        start = index * self.block_size
        return prev_hash, tuple(token_ids[start:start + self.block_size])

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        """Hand out the least recently freed block, evicting its cached content if any."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.key, block.hash = None, None
        block.ref_count = 1
        return block_id
