"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, and prefix caching.

The KV cache is cut into blocks of `block_size` (16) token slots. A sequence owns a block table:
the list of its blocks in order, so token i lives in slot `block_table[i // 16] * 16 + i % 16`.

Prefix caching: once a block is full (all 16 of its tokens computed) it takes the sequence's hash
of that block (`Sequence.block_hashes`: its parent's hash chained with its own token ids, so equal
hashes mean equal whole prefixes) and is entered in `hash_to_block`. A new request looks its full
prompt blocks up there and reuses the longest run of hits (bumping `ref_count`), computing only
the rest. At least one prompt token is always computed, so the step that finishes the prompt has
logits to sample from. A block is entered as soon as the step that computes it is scheduled, so
a request admitted later in the same step (another sample of the same prompt, say) shares it: the
forward writes each layer's K/V before any attention of that layer reads them.

Freed blocks (ref_count 0) go to the back of the free queue but keep their hash: they can still
be hit until reused (lazy eviction). New blocks come from the front, so the block freed longest
ago is evicted first; a sequence frees its blocks tail first, so its prefix stays longest.
Blocks never used yet come before all freed ones, in order of their ids.
"""
from collections import OrderedDict

import numpy as np

from nanoinfer.core.sequence import Sequence
from nanoinfer.utils import cdiv


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None):
        self.block_size = block_size
        # No slot is allocated past max_model_len (EAGLE's lookahead would reach there).
        self.max_model_len = max_model_len or num_blocks * block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        # One number per block, not one object: a small model on a large GPU has tens of millions.
        self.ref_counts = np.zeros(num_blocks, np.int32)
        # The hash of each full block's content, and the other way round.
        self.block_hash: dict[int, int] = {}
        self.hash_to_block: dict[int, int] = {}
        # Blocks next_unused.. have never been used and go first, in order; then the freed ones,
        # oldest first.
        self.next_unused = 0
        self.free_block_queue: OrderedDict[int, None] = OrderedDict()
        # Prompt tokens looked up in the prefix cache, and of those, found there.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.next_unused + len(self.free_block_queue)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The blocks of the longest cached prefix of `seq`, leaving at least one token to
        compute."""
        if not self.enable_prefix_caching:
            return []
        computed = []
        for block_hash in seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]:
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            computed.append(block_id)
        return computed

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, *, computed_blocks: list[int] = (),
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Give `seq` blocks for `num_new_tokens` more tokens, starting with the cached
        `computed_blocks` on first admission, and for `num_lookahead_tokens` slots past them
        (EAGLE's drafts write there) within max_model_len. Returns the blocks appended to its
        table (often none: a decode usually fits in the blocks it has), or None when they do not
        fit; then nothing has changed."""
        num_needed = self.num_blocks_needed(seq, num_new_tokens, num_lookahead_tokens,
                                            computed_blocks)
        if num_needed <= 0 and not computed_blocks:
            return []
        # Cached blocks nobody uses sit in the free queue: taking them costs free blocks too.
        num_revived = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        if max(num_needed, 0) + num_revived > self.num_free_blocks:
            return None
        if not seq.block_table:
            self.num_prefix_query_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += len(computed_blocks) * self.block_size
        for block_id in computed_blocks:
            if self.ref_counts[block_id] == 0:
                del self.free_block_queue[block_id]
            self.ref_counts[block_id] += 1
        new_blocks = list(computed_blocks) + [self._pop_free_block() for _ in range(num_needed)]
        seq.block_table += new_blocks
        return new_blocks

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0
                     ) -> bool:
        """Would `allocate_slots` find room for these tokens of running `seq`?"""
        return self.num_blocks_needed(seq, num_new_tokens, num_lookahead_tokens) \
            <= self.num_free_blocks

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0,
                          computed_blocks: list[int] = ()) -> int:
        """The blocks `seq` lacks for these tokens (negative: it has more than enough)."""
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size \
            + num_new_tokens
        num_slots = max(min(num_tokens + num_lookahead_tokens, self.max_model_len), num_tokens)
        return cdiv(num_slots, self.block_size) - len(seq.block_table) - len(computed_blocks)

    def _pop_free_block(self) -> int:
        """Take the next free block, with ref_count 1: a never-used one while any is left, else
        the one at the front of the free queue (freed longest ago), whose cached content, if any,
        is evicted: it leaves `block_hash`, and `hash_to_block` if the index names this block
        (for a duplicate, the index names the first block with that content)."""
        if self.next_unused < self.num_blocks:
            block_id = self.next_unused
            self.next_unused += 1
        else:
            block_id, _ = self.free_block_queue.popitem(last=False)
            block_hash = self.block_hash.pop(block_id, None)
            # (another block may hold the same content, entered first: that one stays cached)
            if block_hash is not None and self.hash_to_block.get(block_hash) == block_id:
                # Evicted: its cached content is about to be overwritten.
                del self.hash_to_block[block_hash]
        self.ref_counts[block_id] = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Enter the blocks of `seq` that became full of computed, known tokens in the cache:
        each in `block_hash`, and in `hash_to_block` unless the index has its hash already (a
        duplicate: the first block with that content stays the index's)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        # The cached blocks form a prefix of the table: walk back to its end.
        first = num_full
        while first > 0 and seq.block_table[first - 1] not in self.block_hash:
            first -= 1
        for i in range(first, num_full):
            self.block_hash[seq.block_table[i]] = seq.block_hashes[i]
            self.hash_to_block.setdefault(seq.block_hashes[i], seq.block_table[i])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (a benchmark's fresh start); only while no block is in use."""
        if self.num_free_blocks < self.num_blocks:
            return False
        self.hash_to_block.clear()
        self.block_hash.clear()
        return True

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks, last block first, and give it a new, empty table. A
        block no one holds any more goes to the back of the free queue, keeping its hash: it can
        still be hit until it is reused."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_queue[block_id] = None
        seq.block_table = []
