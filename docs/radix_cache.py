"""A radix tree over token sequences: the prefix cache of SGLang's RadixAttention, for the study.

This follows the description in the SGLang paper (Zheng et al., "SGLang: Efficient Execution of
Structured Language Model Programs", arXiv 2312.07104, section 3), not SGLang's code of today
(which adds pages of several tokens, other eviction policies, a host-memory tier):

- The cached KV entries form a tree. An edge holds a run of tokens of any length, and the slots of
  the KV cache that hold their keys and values, one slot per token (the paper's page size of one).
  The path from the root to a node spells a prefix that some request computed. Children are found
  by their first token, so no two edges out of a node start alike.
- A new request walks down from the root as far as its tokens match (`match_prefix`): token by
  token, so a match may end inside an edge, which is then split in two. Everything along the
  path is served from the cache; the request computes only the rest.
- A request that runs holds a reference (`lock_ref`) on every node of its path, so nothing it
  reads can be evicted. When it finishes, its tokens are inserted (`insert`): what the tree
  lacks becomes a new leaf, and its references are dropped.
- When the cache is full, `evict` frees the least recently used leaf that nobody references,
  then the next, and so on; a node whose last child was evicted becomes a leaf itself and may go
  next. A node is "used" when a match passes through it or it is inserted.

Invariant (checked by tests/test_prefix_study.py): the slots of the tree, those held by running
requests and the free ones add up to the capacity; a node's `lock_ref` is the number of running
requests whose path passes through it, and a node with `lock_ref` > 0 is never evicted. Since a
child's readers all read its parent too, every node nobody references can be evicted (its
subtree first): `evictable_tokens` counts their tokens, so `alloc` knows whether a request fits
before it evicts anything. `match_prefix` finds the longest common prefix of the tokens with any
sequence the tree holds, as a brute-force search over those sequences would.
"""
import heapq


class TreeNode:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: list[int], parent: "TreeNode | None"):
        # The edge's tokens, and the KV slot of each of them.
        self.key = key
        self.value = value
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        # Running requests whose path passes through this node.
        self.lock_ref = 0
        self.last_access = 0


def shared_len(key: list[int], token_ids: list[int], start: int) -> int:
    """How many leading tokens of `key` equal `token_ids[start:]` (slices compare in C, so the
    common case, a whole edge that matches, costs one comparison)."""
    n = min(len(key), len(token_ids) - start)
    if key[:n] == token_ids[start:start + n]:
        return n
    lo, hi = 0, n   # key[:lo] matches, key[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[lo:mid] == token_ids[start + lo:start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache:

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.root = TreeNode([], [], None)
        self.root.lock_ref = 1   # (the root is never evicted)
        self.free_slots = list(range(num_slots))
        self.clock = 0
        # Tokens of the tree: cached, whether or not a running request uses them.
        self.num_cached_tokens = 0
        # Of those, the tokens of nodes no running request references.
        self.evictable_tokens = 0
        self.num_evicted_tokens = 0

    def _walk(self, token_ids: list[int]) -> tuple[TreeNode, int, int]:
        """The deepest node whose whole path matches `token_ids`, the tokens up to it, and how
        many more match inside the edge below it."""
        node, n = self.root, 0
        while n < len(token_ids) and (child := node.children.get(token_ids[n])) is not None:
            c = shared_len(child.key, token_ids, n)
            if c < len(child.key):
                return node, n, c
            node, n = child, n + c
        return node, n, 0

    def prefix_len(self, token_ids: list[int]) -> int:
        """The tokens of `token_ids` the tree holds, looked up without changing anything (the
        cache-aware scheduler asks this of every waiting request)."""
        _, n, c = self._walk(token_ids)
        return n + c

    def match_prefix(self, token_ids: list[int]) -> tuple[TreeNode, int]:
        """The node that ends the longest cached prefix of `token_ids` (splitting the edge where
        the match ends inside one), and its length; its path counts as used now."""
        node, n, c = self._walk(token_ids)
        if c:
            node = self._split(node.children[token_ids[n]], c)
            n += c
        self.clock += 1
        up = node
        while up is not None:
            up.last_access = self.clock
            up = up.parent
        return node, n

    def _split(self, child: TreeNode, c: int) -> TreeNode:
        """Cut `child`'s edge after `c` tokens; the new upper node, which has the same readers."""
        upper = TreeNode(child.key[:c], child.value[:c], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.children[child.key[c]] = child
        child.parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[c:], child.value[c:], upper
        return upper

    def inc_lock_ref(self, node: TreeNode, delta: int = 1) -> None:
        """A running request takes (+1) or drops (-1) its hold on `node`'s whole path."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= len(node.key)
            node.lock_ref += delta
            if node.lock_ref == 0:
                self.evictable_tokens += len(node.key)
            node = node.parent

    def alloc(self, num_tokens: int) -> list[int] | None:
        """Slots for `num_tokens` new tokens, evicting what must go; None, with nothing taken
        and nothing evicted, if even eviction would not make room."""
        if num_tokens > len(self.free_slots) + self.evictable_tokens:
            return None
        if num_tokens > len(self.free_slots):
            self.evict(num_tokens - len(self.free_slots))
        slots = self.free_slots[len(self.free_slots) - num_tokens:]
        del self.free_slots[len(self.free_slots) - num_tokens:]
        return slots

    def insert(self, token_ids: list[int], slots: list[int], start: int) -> TreeNode:
        """Enter `token_ids` whose first `start` tokens the tree already holds (the caller's
        locked match) and whose others sit in `slots`; the node that ends them. Tokens another
        request entered meanwhile are the tree's already: this request's slots for them are
        freed."""
        node, n = self.match_prefix(token_ids)
        self.free_slots += slots[:n - start]
        if n < len(token_ids):
            leaf = TreeNode(token_ids[n:], slots[n - start:], node)
            leaf.last_access = self.clock
            node.children[token_ids[n]] = leaf
            self.num_cached_tokens += len(leaf.key)
            self.evictable_tokens += len(leaf.key)
            node = leaf
        return node

    def evict(self, num_tokens: int) -> None:
        """Free at least `num_tokens` slots, least recently used unreferenced leaves first, or as
        many as there are."""
        leaves = [(n.last_access, id(n), n) for n in self.nodes() if not n.children
                  and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.free_slots += leaf.value
            freed += len(leaf.key)
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        self.num_cached_tokens -= freed
        self.evictable_tokens -= freed
        self.num_evicted_tokens += freed

    def nodes(self) -> list[TreeNode]:
        """Every node but the root."""
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack += node.children.values()
        return found
