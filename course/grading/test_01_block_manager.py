"""Assignment 1: prefix-cache hashing and the block manager.

Graded: the hash chain of a sequence's full blocks; prefix-cache lookups; allocation all or
nothing; the order in which blocks are handed out and evicted; reference counts; no leaks over
random workloads (a property test against a model of the rules); and the engine, with its
prefix cache on, giving transformers' tokens while it hits the cache.
"""
import itertools

from conftest import hf_greedy, random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoinfer import LLM, SamplingParams
from nanoinfer.core.block_manager import BlockManager
from nanoinfer.core.sequence import Sequence, hash_block

BS = 4
seq_ids = itertools.count()


def seq_of(token_ids) -> Sequence:
    return Sequence(next(seq_ids), list(token_ids), SamplingParams(), max_tokens=64,
                    block_size=BS)


def admit(bm: BlockManager, seq: Sequence) -> bool:
    """What the scheduler does with a waiting sequence: start from its cached prefix, allocate
    the rest, compute it all (here: say so) and enter its full blocks in the cache."""
    computed = bm.get_computed_blocks(seq)
    num_new = seq.num_tokens - len(computed) * BS
    if bm.allocate_slots(seq, num_new, computed_blocks=computed) is None:
        return False
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return True


def test_hash_chain():
    """Each full block's hash chains its parent's: equal hashes mean equal whole prefixes"""
    seq = seq_of(range(10))
    assert seq.block_hashes == [hash_block(None, [0, 1, 2, 3]),
                                hash_block(hash_block(None, [0, 1, 2, 3]), [4, 5, 6, 7])]
    # A partial block has no hash until it fills, token by token.
    seq.append_token(10)
    assert len(seq.block_hashes) == 2
    seq.append_token(11)
    assert seq.block_hashes[2] == hash_block(seq.block_hashes[1], [8, 9, 10, 11])
    # The same second block after a different first one hashes differently.
    other = seq_of([9, 1, 2, 3, 4, 5, 6, 7])
    assert other.block_hashes[1] != seq.block_hashes[1]


def test_prefix_hits():
    """A new request reuses the longest cached prefix, from its first block on"""
    bm = BlockManager(16, BS)
    first = seq_of(range(10))   # two full blocks and a partial one
    assert admit(bm, first)
    second = seq_of(list(range(8)) + [99, 98, 97])
    assert bm.get_computed_blocks(second) == first.block_table[:2]
    assert admit(bm, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    # Only a prefix counts: the same blocks after a different first block are no hit.
    assert bm.get_computed_blocks(seq_of([42] + list(range(1, 12)))) == []
    # The prefix cache off: never a hit.
    off = BlockManager(16, BS, enable_prefix_caching=False)
    assert admit(off, seq_of(range(10)))
    assert off.get_computed_blocks(seq_of(range(10))) == []


def test_one_token_left_to_compute():
    """A prompt entirely in the cache still computes its last token"""
    bm = BlockManager(16, BS)
    assert admit(bm, seq_of(range(8)))
    assert len(bm.get_computed_blocks(seq_of(range(8)))) == 1
    assert len(bm.get_computed_blocks(seq_of(range(9)))) == 2


def test_allocate_all_or_nothing():
    """allocate_slots gives just the blocks needed, or None and changes nothing"""
    bm = BlockManager(4, BS)
    seq = seq_of(range(6))
    new = bm.allocate_slots(seq, 6)
    assert len(new) == 2 and seq.block_table == new and bm.num_free_blocks == 2
    seq.num_computed_tokens = 6
    # Two more tokens fit in the second block: no new block.
    assert bm.allocate_slots(seq, 2) == [] and bm.num_free_blocks == 2
    seq.num_computed_tokens = 8
    big = seq_of(range(100, 113))   # 13 tokens: 4 blocks, only 2 free
    assert bm.allocate_slots(big, 13) is None
    assert big.block_table == [] and bm.num_free_blocks == 2
    assert len(bm.allocate_slots(seq, 1)) == 1 and bm.num_free_blocks == 1


def test_block_order():
    """Blocks never used come first, then the oldest freed; a sequence frees its last block first
    (the never-used ones in the order of their ids)"""
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    a, b = seq_of(range(8)), seq_of(range(20, 28))
    assert bm.allocate_slots(a, 8) == [0, 1]
    assert bm.allocate_slots(b, 8) == [2, 3]
    bm.free(a)   # its tail first: 1, then 0
    bm.free(b)   # then 3, 2
    c = seq_of(range(40, 64))   # 6 blocks: the two never used, then the freed ones in order
    assert bm.allocate_slots(c, 24) == [4, 5, 1, 0, 3, 2], \
        "the never-used 4, 5, then the freed ones, oldest first: free releases a sequence's " \
        "last block first (a's 1 before its 0, then b's 3 before its 2)"
    assert bm.num_free_blocks == 0


def test_lazy_eviction():
    """Freed blocks stay cached until they are reused, and are evicted then"""
    bm = BlockManager(4, BS)
    a, b = seq_of(range(8)), seq_of(range(100, 108))
    assert admit(bm, a) and admit(bm, b)
    a_blocks = list(a.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4
    assert bm.get_computed_blocks(seq_of(range(9))) == a_blocks   # still a hit after free
    c = seq_of(range(200, 208))   # takes a's blocks, freed first
    assert admit(bm, c)
    assert sorted(c.block_table) == sorted(a_blocks)
    assert bm.get_computed_blocks(seq_of(range(9))) == []   # evicted: their content is gone
    assert len(bm.get_computed_blocks(seq_of(range(100, 109)))) == 2


def test_ref_counts():
    """A shared block is freed only by its last user; a cached free block is revived"""
    bm = BlockManager(4, BS)
    a = seq_of(range(9))   # two full blocks and a partial one
    assert admit(bm, a)
    b = seq_of(list(range(8)) + [50])
    assert admit(bm, b)   # shares a's two full blocks, and takes the last free one
    assert bm.num_free_blocks == 0
    assert [bm.ref_counts[i] for i in b.block_table] == [2, 2, 1]
    shared = b.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 1   # only a's last block: the shared ones are still b's
    bm.free(b)
    assert bm.num_free_blocks == 4
    c = seq_of(list(range(8)) + [60])   # revives both cached blocks, and takes one more
    assert admit(bm, c)
    assert c.block_table[:2] == shared
    assert bm.num_free_blocks == 1
    assert not admit(bm, seq_of(range(300, 313)))   # needs 4: nothing changes
    assert bm.num_free_blocks == 1


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(1, 14)),
                min_size=1, max_size=60))
def test_no_leaks(ops):
    """Over random admissions and frees, every block is either free or held, and counted right"""
    prefixes = [list(range(p * 10, p * 10 + 9)) for p in range(4)]
    bm, live = BlockManager(24, BS), []
    for i, (free_one, prefix, length) in enumerate(ops):
        if free_one and live:
            bm.free(live.pop(length % len(live)))
        else:
            seq = seq_of(prefixes[prefix] + [1000 + i] * length)
            if admit(bm, seq):
                live.append(seq)
        held = {b for s in live for b in s.block_table}
        assert bm.num_free_blocks == bm.num_blocks - len(held)
        for block_id in held:
            assert bm.ref_counts[block_id] == sum(s.block_table.count(block_id) for s in live)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks and not bm.ref_counts.any()


def test_engine_with_prefix_cache(llama_dir):
    """End to end: with the prefix cache on, the engine gives transformers' tokens and hits it"""
    shared = random_prompts([40], seed=1)[0]
    prompts = [shared + tail for tail in random_prompts([5, 9, 3], seed=2)]
    llm = LLM(llama_dir, enforce_eager=True, num_kvcache_blocks=64, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    for prompt, out in zip(prompts, [first, *rest]):
        assert out.outputs[0].token_ids == hf_greedy(llama_dir, prompt, 12)
    # The later prompts share 40 tokens (two full blocks of 16) with the first.
    assert [out.num_cached_tokens for out in rest] == [32, 32]
