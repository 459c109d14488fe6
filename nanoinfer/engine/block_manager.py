"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, and prefix caching.

The KV cache is cut into blocks of `block_size` (16) token slots. A sequence owns a block table:
the list of its blocks in order, so token i lives in slot `block_table[i // 16] * 16 + i % 16`.

Prefix caching: once a block is full (all 16 of its tokens computed) it gets a hash that chains
its parent's hash with its own token ids, so equal hashes mean equal whole prefixes. A new
request looks its full prompt blocks up in `hash_to_block` and reuses the longest run of hits
(bumping `ref_count`), computing only the rest. At least one prompt token is always computed,
so the step that finishes the prompt has logits to sample from.

Freed blocks (ref_count 0) go to the back of the free queue but keep their hash: they can still
be hit until reused (lazy eviction). New blocks come from the front, so the block freed longest
ago is evicted first; a sequence frees its blocks tail first, so its prefix stays longest.
"""
from collections import OrderedDict

import numpy as np
import xxhash

from nanoinfer.engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: list[int]) -> int:
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_prefix_query_tokens = 0   # prompt tokens looked up in the prefix cache
        self.num_prefix_hit_tokens = 0     # of those, found there

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The blocks of the longest cached prefix of `seq`, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        computed, parent = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            token_ids = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = hash_block(parent, token_ids)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
                break
            computed.append(block_id)
        return computed

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens, starting with the cached
        `computed_blocks` on first admission. All or nothing: False leaves everything as it was."""
        if seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            return True   # fits in the blocks it has: most decode steps
        num_total = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = -(-num_total // self.block_size) - len(seq.block_table) - len(computed_blocks)
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if max(num_needed, 0) + num_revived > self.num_free_blocks:
            return False
        if not seq.block_table:
            self.num_prefix_query_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += len(computed_blocks) * self.block_size
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens += len(computed_blocks) * self.block_size
        seq.num_cached_tokens = max(seq.num_cached_tokens, len(computed_blocks) * self.block_size)
        for _ in range(num_needed):
            seq.block_table.append(self._pop_free_block())
        return True

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_block_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
            del self.hash_to_block[block.block_hash]   # evicted: its cached content is overwritten
        block.block_hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks of `seq` that became full of computed tokens (placeholders aside)."""
        if not self.enable_prefix_caching:
            return
        bs, num_full = self.block_size, min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        first = num_full   # hashed blocks form a prefix of the table: walk back to its end
        while first > 0 and self.blocks[seq.block_table[first - 1]].block_hash is None:
            first -= 1
        for i in range(first, num_full):
            block = self.blocks[seq.block_table[i]]
            parent = self.blocks[seq.block_table[i - 1]].block_hash if i > 0 else None
            block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block.block_hash = hash_block(parent, block.token_ids)
            self.hash_to_block.setdefault(block.block_hash, block.block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (a benchmark's fresh start); only while no block is in use."""
        if self.num_free_blocks < len(self.blocks):
            return False
        self.hash_to_block.clear()
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()
        return True

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_queue[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
