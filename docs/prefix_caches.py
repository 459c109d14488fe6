"""The two prefix caches of the study (docs/prefix_study.py), behind one interface.

Each takes a request through the steps an engine takes it: `match` (look its prompt up: the
cached tokens, and what `admit` needs to use them), `admit` (room for every token it computes,
its matched part kept from eviction, its prompt entered in the cache as the step that computes it
is scheduled; False when it does not fit, with nothing evicted, taken or entered), `decode` (its
output tokens become known, one a step) and `finish` (its output entered, its hold released).
`cached_len` is the lookup without side effects that the cache-aware order asks of every waiting
request. A request is named by its index in the stream.

- `HashedBlocks`: the engine's `BlockManager` itself, called as core/scheduler.py calls it.
- `RadixTree`: docs/radix_cache.py's tree, with SGLang's order of operations: lock the match,
  allocate, insert the prompt and move the lock to its end; at the end insert the rest, unlock.
  Its match may split an edge and marks its path used, even when `admit` then says False.

Metadata is counted in fixed-width fields, what a compiled engine would store (Python's objects
are several times larger), per cached token; a field the engine keeps for every block or slot of
the pool (a reference count, a free list) is counted for the cached ones, as in a full cache:
- blocks, per cached block: its 16-byte hash and 4-byte id in `hash_to_block`, and again in
  `block_hash`; a 4-byte reference count and 8 bytes of free-queue links (two block ids).
- the tree, per token: its id and its slot (4 + 4 bytes), and the slot's 4-byte entry in the
  free list it returns to; per node: a parent pointer (8), its entry in the parent's children
  (first token 4, pointer 8), pointers to its tokens and its slots (8 + 8), the edge's length
  (4), a reference count (4) and a last-access time (8).

`BlockTails` measures what the blocks lose to their granularity (docs/prefix_study.py says how).
"""
from collections import defaultdict
from typing import NamedTuple

from nanoinfer.core.block_manager import BlockManager
from nanoinfer.core.sequence import Sequence
from nanoinfer.sampling_params import SamplingParams
from prefix_streams import Request
from radix_cache import RadixCache, TreeNode, shared_len

BLOCK_SIZE = 16
INDEX_ENTRY_BYTES = 16 + 4             # a hash and a block id, in either index
BLOCK_STATE_BYTES = 4 + 8              # a reference count, free-queue links
TREE_TOKEN_BYTES = 4 + 4 + 4           # a token id, its slot, a free-list entry
# A parent pointer, an entry in the parent's children, pointers to its tokens and slots, the
# edge's length, a reference count, a last-access time.
TREE_NODE_BYTES = 8 + 12 + 16 + 4 + 4 + 8


class HashedBlocks:
    """The engine's block manager, driven as the scheduler drives it (no model behind it)."""
    name = "hashed blocks"

    def __init__(self, num_slots: int, enable_prefix_caching: bool = True):
        self.block_manager = BlockManager(num_slots // BLOCK_SIZE, BLOCK_SIZE,
                                          enable_prefix_caching)
        self.seqs: dict[int, Sequence] = {}
        self.num_evicted_tokens = 0

    def seq(self, i: int, req: Request) -> Sequence:
        if i not in self.seqs:   # (hashes its prompt's full blocks, as a new request does)
            self.seqs[i] = Sequence(i, req.prompt, SamplingParams(), max_tokens=len(req.output),
                                    block_size=BLOCK_SIZE)
        return self.seqs[i]

    def cached_len(self, i: int, req: Request) -> int:
        return len(self.block_manager.get_computed_blocks(self.seq(i, req))) * BLOCK_SIZE

    def match(self, i: int, req: Request) -> tuple[list[int], int]:
        computed = self.block_manager.get_computed_blocks(self.seq(i, req))
        return computed, len(computed) * BLOCK_SIZE

    def admit(self, i: int, req: Request, computed: list[int]) -> bool:
        """Blocks for all it computes (`Scheduler.schedule_waiting`, then each decode's), and
        its prompt's full blocks entered, as the step that computes them does (`advance`)."""
        bm, seq = self.block_manager, self.seqs[i]
        num_hashed = len(bm.block_hash)
        num_new = len(req.computed) - len(computed) * BLOCK_SIZE
        if bm.allocate_slots(seq, num_new, computed_blocks=computed) is None:
            return False
        self.num_evicted_tokens += (num_hashed - len(bm.block_hash)) * BLOCK_SIZE
        seq.num_computed_tokens = len(req.prompt)
        bm.cache_full_blocks(seq)
        return True

    def decode(self, i: int, req: Request) -> None:
        """Each output token appended as its step samples it; a block it fills is hashed."""
        seq = self.seqs[i]
        for token_id in req.output:
            seq.append_token(token_id)

    def finish(self, i: int, req: Request) -> None:
        """Its output's full blocks entered, then its blocks freed, tail first."""
        seq = self.seqs[i]
        seq.num_computed_tokens = len(req.computed)
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.free(seq)

    def metadata_bytes_per_token(self) -> float:
        bm = self.block_manager
        num_bytes = INDEX_ENTRY_BYTES * len(bm.hash_to_block) \
            + (INDEX_ENTRY_BYTES + BLOCK_STATE_BYTES) * len(bm.block_hash)
        return num_bytes / max(1, len(bm.hash_to_block) * BLOCK_SIZE)


class TreeMatch(NamedTuple):
    node: TreeNode   # the end of the cached prefix
    length: int      # its tokens


class Running(NamedTuple):
    end: TreeNode      # the node that ends its prompt, which it holds locked
    slots: list[int]   # the slots of its tokens past the prompt


class RadixTree:
    """The radix tree of radix_cache.py, driven through the same steps as the block manager."""
    name = "radix tree"

    def __init__(self, num_slots: int):
        self.tree = RadixCache(num_slots)
        self.running: dict[int, Running] = {}

    @property
    def num_evicted_tokens(self) -> int:
        return self.tree.num_evicted_tokens

    def cached_len(self, i: int, req: Request) -> int:
        return self.tree.prefix_len(req.prompt[:-1])

    def match(self, i: int, req: Request) -> tuple[TreeMatch, int]:
        # (at least one prompt token is computed, as with blocks, so that there are logits)
        match = TreeMatch(*self.tree.match_prefix(req.prompt[:-1]))
        return match, match.length

    def admit(self, i: int, req: Request, match: TreeMatch) -> bool:
        """Slots for all it computes (its matched path locked first, so eviction spares it),
        then its prompt entered, and the lock moved to the prompt's end."""
        tree, num_prompt = self.tree, len(req.prompt)
        tree.inc_lock_ref(match.node)
        slots = tree.alloc(len(req.computed) - match.length)
        if slots is None:
            tree.inc_lock_ref(match.node, -1)
            return False
        num_new = num_prompt - match.length
        end = tree.insert(req.prompt, slots[:num_new], match.length)
        tree.inc_lock_ref(end)
        tree.inc_lock_ref(match.node, -1)
        self.running[i] = Running(end, slots[num_new:])
        return True

    def decode(self, i: int, req: Request) -> None:
        """Nothing: the output's slots were taken at admission, its tokens enter at `finish`."""

    def finish(self, i: int, req: Request) -> None:
        end, slots = self.running.pop(i)
        self.tree.insert(req.computed, slots, len(req.prompt))
        self.tree.inc_lock_ref(end, -1)

    def metadata_bytes_per_token(self) -> float:
        tree = self.tree
        return (TREE_TOKEN_BYTES * tree.num_cached_tokens
                + TREE_NODE_BYTES * len(tree.nodes())) / max(1, tree.num_cached_tokens)


class BlockTails:
    """For each block hash (None: the start), the tokens that earlier requests computed right
    after it, a block's worth at most: what a token-granular cache holding the same blocks would
    also serve. Only meaningful where nothing is evicted (it remembers everything)."""

    def __init__(self):
        self.after: dict[int | None, set[tuple]] = defaultdict(set)

    def lost(self, req: Request, seq: Sequence, hit: int) -> int:
        k = hit // BLOCK_SIZE
        wanted = tuple(req.prompt[hit:min(hit + BLOCK_SIZE, len(req.prompt) - 1)])
        parent = seq.block_hashes[k - 1] if k else None
        # (a whole block equal to the one wanted was evicted: that is not granularity's loss)
        return max((n for tail in self.after[parent]
                    if (n := shared_len(tail, wanted, 0)) < BLOCK_SIZE), default=0)

    def record(self, req: Request, seq: Sequence) -> None:
        computed = req.computed
        for start in range(0, len(computed), BLOCK_SIZE):
            k = start // BLOCK_SIZE
            parent = seq.block_hashes[k - 1] if k else None
            self.after[parent].add(tuple(computed[start:start + BLOCK_SIZE]))
