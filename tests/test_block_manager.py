"""The block manager: hash chain, prefix hits, reference counts, lazy LRU eviction, no leaks."""
import itertools
import random

from nanoinfer.core.block_manager import BlockManager
from nanoinfer.core.sequence import Sequence, hash_block
from nanoinfer.sampling_params import SamplingParams

BS = 4
seq_ids = itertools.count()


def seq_of(token_ids):
    return Sequence(next(seq_ids), list(token_ids), SamplingParams(), max_tokens=16, block_size=BS)


def admit(bm: BlockManager, seq: Sequence) -> bool:
    """What the scheduler does for a waiting sequence: reuse the cached prefix, compute the rest."""
    computed = bm.get_computed_blocks(seq)
    num_new = seq.num_tokens - len(computed) * BS
    if bm.allocate_slots(seq, num_new, computed_blocks=computed) is None:
        return False
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return True


def test_hash_chains_parent():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])


def test_a_sequence_hashes_each_block_once_as_it_fills():
    seq = seq_of(range(9))
    assert seq.block_hashes == [hash_block(None, [0, 1, 2, 3]), hash_block(seq.block_hashes[0], [4, 5, 6, 7])]
    for token in (9, 10):
        seq.append_token(token)
    assert len(seq.block_hashes) == 2
    seq.append_token(11)
    assert seq.block_hashes[2] == hash_block(seq.block_hashes[1], [8, 9, 10, 11])


def test_full_blocks_only_are_cached_and_hit():
    bm = BlockManager(8, BS)
    first = seq_of(range(10))              # 2 full blocks + a partial one
    assert admit(bm, first)
    assert len(bm.hash_to_block) == 2
    second = seq_of(list(range(8)) + [99, 98])
    assert bm.get_computed_blocks(second) == first.block_table[:2]
    assert admit(bm, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert [bm.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (20, 8)


def test_reset_prefix_cache_only_when_idle():
    bm = BlockManager(8, BS)
    seq = seq_of(range(10))
    assert admit(bm, seq)
    assert not bm.reset_prefix_cache() and len(bm.hash_to_block) == 2   # blocks in use: refused
    bm.free(seq)
    assert bm.reset_prefix_cache()
    assert bm.get_computed_blocks(seq_of(range(10))) == [] and not bm.hash_to_block


def test_prefix_must_match_from_the_start():
    bm = BlockManager(8, BS)
    admit(bm, seq_of(range(8)))
    assert bm.get_computed_blocks(seq_of([42] + list(range(1, 9)))) == []


def test_at_least_one_token_is_computed():
    bm = BlockManager(8, BS)
    admit(bm, seq_of(range(8)))
    # an identical 8-token prompt: only the first block may be reused, the last token is recomputed
    assert len(bm.get_computed_blocks(seq_of(range(8)))) == 1
    assert len(bm.get_computed_blocks(seq_of(range(9)))) == 2


def test_freed_blocks_stay_cached_until_reused_oldest_first():
    bm = BlockManager(4, BS)
    a, b = seq_of(range(8)), seq_of(range(100, 108))
    admit(bm, a)
    admit(bm, b)
    a_blocks = list(a.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 4
    assert len(bm.get_computed_blocks(seq_of(range(9)))) == 2   # still hit after free
    # new blocks come from the front of the free queue: a was freed first, tail block first
    c = seq_of(range(200, 208))
    admit(bm, c)
    assert c.block_table == [a_blocks[1], a_blocks[0]]
    assert bm.get_computed_blocks(seq_of(range(9))) == []
    assert len(bm.get_computed_blocks(seq_of(range(100, 109)))) == 2


def test_revived_block_leaves_free_queue():
    bm = BlockManager(3, BS)
    a = seq_of(range(8))
    admit(bm, a)
    bm.free(a)
    b = seq_of(range(9))
    assert admit(bm, b)   # 2 revived + 1 new = all 3 blocks
    assert bm.num_free_blocks == 0
    assert [bm.ref_counts[i] for i in b.block_table] == [1, 1, 1]
    assert not admit(bm, seq_of([7]))   # all or nothing: nothing changed
    assert bm.num_free_blocks == 0


def test_random_streams_leak_nothing():
    rng = random.Random(0)
    bm = BlockManager(32, BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    live = []
    for _ in range(500):
        if live and rng.random() < 0.4:
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            seq = seq_of(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))])
            if admit(bm, seq):
                live.append(seq)
        held = {b for s in live for b in s.block_table}
        assert bm.num_free_blocks == 32 - len(held)
        for block_id in range(bm.num_blocks):
            assert bm.ref_counts[block_id] == sum(s.block_table.count(block_id) for s in live)
        for block_hash, block_id in bm.hash_to_block.items():
            assert bm.block_hash[block_id] == block_hash
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == 32 and not bm.ref_counts.any()


def test_only_the_scheduler_moves_num_computed_tokens():
    bm = BlockManager(8, BS)
    first = seq_of(range(10))
    admit(bm, first)
    second = seq_of(range(10))
    computed = bm.get_computed_blocks(second)
    new_blocks = bm.allocate_slots(second, 2, computed_blocks=computed)
    assert new_blocks == computed + [second.block_table[-1]]
    assert second.num_computed_tokens == 0
    second.num_computed_tokens = 10
    bm.free(second)
    assert second.num_computed_tokens == 10 and second.block_table == []
