"""The prefix-caching study (docs/prefix_study.py), checked: its radix tree finds what a brute-force
search over the sequences it holds finds, counts each node's readers, evicts least recently used
leaves first and nothing a running request holds, evicts nothing for a request that cannot fit,
loses and leaks no slot; the block manager it runs is the engine's own, unchanged; on its
streams, with room for everything, the tree serves exactly the block hits plus what blocks lose;
and the engine itself, evicting, finds what the study's block manager finds."""
import inspect
import sys
from collections import Counter
from pathlib import Path

from hypothesis import given, settings, strategies as st

from nanoinfer.core import block_manager

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs"))
import prefix_caches  # noqa: E402
import prefix_study  # noqa: E402
from prefix_streams import Request, make_streams  # noqa: E402
from radix_cache import RadixCache, TreeNode  # noqa: E402

# Over three token ids, sequences share prefixes often and part at any position: edges split.
token_lists = st.lists(st.integers(0, 2), min_size=2, max_size=40)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def brute_force_match(sequences: list[list[int]], token_ids: list[int]) -> int:
    return max((common_prefix(s, token_ids) for s in sequences), default=0)


def cached_sequences(tree: RadixCache) -> list[list[int]]:
    """The token sequence of every root-to-leaf path."""
    found, stack = [], [(tree.root, [])]
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.key
        if not node.children and node is not tree.root:
            found.append(path)
        stack += [(child, path) for child in node.children.values()]
    return found


@settings(max_examples=60, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=25))
def test_a_match_is_the_longest_common_prefix_with_every_sequence_inserted(sequences):
    tree = RadixCache(num_slots=10_000)
    inserted = []
    for token_ids in sequences:
        assert tree.prefix_len(token_ids) == brute_force_match(inserted, token_ids)
        _, n = tree.match_prefix(token_ids)
        assert n == brute_force_match(inserted, token_ids)
        tree.insert(token_ids, tree.alloc(len(token_ids) - n), n)
        inserted.append(token_ids)
    # The tree's leaves spell the sequences inserted that are no other's prefix.
    longest = {tuple(s) for s in inserted if not any(len(t) > len(s) and t[:len(s)] == s
                                                      for t in inserted)}
    assert {tuple(s) for s in cached_sequences(tree)} == longest


def path(node: TreeNode) -> list[TreeNode]:
    """`node` and its ancestors, the root aside."""
    found = []
    while node.parent is not None:
        found.append(node)
        node = node.parent
    return found


def locked_paths(cache: prefix_caches.RadixTree) -> dict[int, int]:
    """For each node (by id), how many running requests end their prompt in its subtree."""
    readers = Counter()
    for run in cache.running.values():
        readers.update(id(node) for node in path(run.end))
    return readers


def check_tree(cache: prefix_caches.RadixTree, running: list[tuple[int, Request]]) -> None:
    tree = cache.tree
    nodes = tree.nodes()
    held = [slot for run in cache.running.values() for slot in run.slots]
    slots = [slot for node in nodes for slot in node.value] + tree.free_slots + held
    # Every slot is in exactly one place: the tree, the free list, or a running request.
    assert sorted(slots) == list(range(tree.num_slots))
    assert tree.num_cached_tokens == sum(len(node.key) for node in nodes)
    readers = locked_paths(cache)
    assert all(node.lock_ref == readers[id(node)] for node in nodes)
    assert tree.evictable_tokens == sum(len(node.key) for node in nodes if node.lock_ref == 0)
    for i, req in running:
        assert tree.prefix_len(req.prompt) == len(req.prompt)
        assert cache.running[i].end in nodes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(token_lists, st.integers(1, 6), st.booleans()), min_size=1,
                max_size=30), st.integers(40, 160))
def test_eviction_never_frees_what_a_running_request_holds(requests, num_slots):
    cache = prefix_caches.RadixTree(num_slots)
    running = []
    for i, (prompt, num_output, finish_now) in enumerate(requests):
        req = Request(prompt, [7] * num_output)
        match, _ = cache.match(i, req)
        sequences = cached_sequences(cache.tree)
        if cache.admit(i, req, match):
            running.append((i, req))
        else:   # (and nothing was evicted for it)
            assert cached_sequences(cache.tree) == sequences
        if running and (finish_now or len(running) > 3):
            cache.decode(*running[0])
            cache.finish(*running.pop(0))
        check_tree(cache, running)
        sequences = cached_sequences(cache.tree)
        assert cache.tree.prefix_len(prompt) == brute_force_match(sequences, prompt)
    # Evicting everything it can leaves exactly the paths the running requests hold.
    cache.tree.evict(num_slots)
    assert {id(node) for node in cache.tree.nodes()} == set(locked_paths(cache))
    check_tree(cache, running)


def test_eviction_takes_the_least_recently_used_leaf_first():
    tree = RadixCache(num_slots=20)
    a, b = [1] * 10, [2] * 10
    for token_ids in (a, b):
        tree.insert(token_ids, tree.alloc(10), 0)
    tree.match_prefix(a)   # a is used after b now
    tree.evict(1)
    assert cached_sequences(tree) == [a]
    assert tree.num_evicted_tokens == 10 and len(tree.free_slots) == 10


def test_a_request_that_cannot_fit_evicts_nothing():
    tree = RadixCache(num_slots=20)
    tree.insert([1] * 10, tree.alloc(10), 0)   # cached, nobody's
    assert len(tree.alloc(5)) == 5             # a running request's
    assert tree.alloc(16) is None              # 5 free and 10 evictable
    assert cached_sequences(tree) == [[1] * 10] and len(tree.free_slots) == 5
    assert len(tree.alloc(15)) == 15 and tree.num_evicted_tokens == 10


def test_the_study_runs_the_engines_block_manager_unchanged():
    assert prefix_caches.BlockManager is block_manager.BlockManager
    assert type(prefix_caches.HashedBlocks(64).block_manager) is block_manager.BlockManager
    assert inspect.getsourcefile(prefix_caches.BlockManager) == block_manager.__file__
    for name, attr in vars(block_manager.BlockManager).items():
        if inspect.isfunction(attr):
            assert attr.__module__ == "nanoinfer.core.block_manager", name


def test_with_room_for_everything_the_tree_serves_the_block_hits_and_what_blocks_lose():
    streams = make_streams(seed=0, quick=True)
    rows, _ = prefix_study.part1(streams)   # (which asserts it, request by request)
    ample = {(row.stream, row.cache): row.replay for row in rows if row.capacity == "ample"}
    for name, stream in streams.items():
        blocks, tree = ample[name, "hashed blocks"], ample[name, "radix tree"]
        assert blocks.evicted_tokens == tree.evicted_tokens == 0
        assert blocks.prompt_tokens == sum(len(r.prompt) for r in stream)
        assert all(b <= t < len(r.prompt) for b, t, r in zip(blocks.hits, tree.hits, stream))


def test_the_engine_evicting_finds_what_the_studys_block_manager_finds():
    studied = prefix_study.part3(quick=True)   # (which fails if they differ)
    assert sum(replay.evicted_tokens for replay in studied.values()) > 0
