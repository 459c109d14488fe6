"""A regex's tree (regex.py) -> a deterministic finite automaton over bytes.

To test a growing text cheaply, the pattern becomes a DFA: a table `next = table[state,
byte_class[b]]` with a set of accepting states. It runs over the UTF-8 *bytes* of the text,
because tokens are byte strings and a token may hold only part of a character. State 0 is dead:
every wrong byte leads there, and only there, because every other state can still reach a match.

The DFA is built bottom-up, one tree node at a time, each node's automaton from its children's:
- a set is a trie over the UTF-8 byte ranges of its code points (`é` is `C3 A9`, `[^"]` is every
  ASCII byte but one, or a lead byte followed by continuation bytes);
- a cat, alt or repeat puts its children's tables side by side and joins them with epsilon links
  (from the accepting states of one part to the start of the next; from the end of a repeated
  part back to its start), then makes that deterministic by the subset construction: a state is
  the set of the parts' states that the text so far can be in. Most such sets hold a single
  state, the parts being deterministic already: those keep the part's own row, renumbered in
  one vectorised step, and only sets of several states (where parts overlap: `a*ab`) are
  explored one by one. A part whose end has no way on (a character, a quoted string) leaves no
  such set behind, so `x{0,1000}` costs a thousand copies of x's table, not a thousand subset
  constructions (a repeated part that matches the empty string is repeated without it: `(a?){n}`
  is `a{0,n}`). Parts that do overlap (`(\\w+ ){0,20}\\w+`: is a word the last?) are explored set
  by set, some ten thousand a second on a small CPU: more than `MAX_SUBSETS` is a ValueError;
- each node's result of at most `MINIMIZE_MAX` states is minimised (Moore's partition
  refinement, when it settles within `MAX_ROUNDS` rounds), so that the parts a repeat copies are
  as small as they can be. A set of no characters is the empty language (None), which a cat
  takes on and an alt drops; so every state that is built can still reach a match.
Bytes that no row tells apart share a class: the table has a column per class. A DFA of more
than `MAX_STATES` states is a ValueError, found before the table that would pass it is made.
"""
import functools
import threading

import numpy as np

from nanoinfer.structured_output.regex import complement, parse
from nanoinfer.structured_output.utf8 import utf8_ranges

MAX_STATES = 50_000
MAX_ROUNDS = 24
MINIMIZE_MAX = 4096
MAX_SUBSETS = 10_000   # sets of several states a pattern may explore (each costs Python work)
budget = threading.local()   # this thread's pattern's: the sets it may still explore
# An automaton while it is built: (table int32 [states, classes], accepting bool [states],
# byte_class int32 [256]); state 0 is dead, state 1 the start. None is the empty language.
EMPTY_STRING = (np.zeros((2, 1), np.int32), np.array([False, True]), np.zeros(256, np.int32))


@functools.lru_cache(4096)
def set_automaton(ranges: tuple[tuple[int, int], ...]):
    """A trie of the set's UTF-8 byte sequences, whose state is the set of byte-range sequences
    still to read (so equal rests share a state)."""
    rests = frozenset(tuple(seq) for lo, hi in complement(complement(ranges))
                      for seq in utf8_ranges(lo, hi))
    if not rests:
        return None
    ids = {}
    rows = [np.zeros(256, np.int32)]

    def state(rest: frozenset) -> int:
        if rest not in ids:
            ids[rest] = len(rows)
            rows.append(np.zeros(256, np.int32))
            by_first = {}
            for seq in rest:
                if seq:
                    by_first.setdefault(seq[0], set()).add(seq[1:])
            for (lo, hi), tails in by_first.items():
                rows[ids[rest]][lo:hi + 1] = state(frozenset(tails))
        return ids[rest]
    state(rests)
    table = np.stack(rows)
    changes = np.concatenate([[False], (table[:, 1:] != table[:, :-1]).any(0)])   # new classes
    accepting = np.array([False] + [() in rest for rest in ids])
    return table[:, np.flatnonzero(changes | (np.arange(256) == 0))], accepting, \
        np.cumsum(changes, dtype=np.int32)


@functools.lru_cache(4096)
def build(node):
    """The automaton of a tree node (None: the empty language); cached while a pattern is
    built, since a JSON schema's regex repeats its parts (strings, numbers, nested values)."""
    kind = node[0]
    if kind == "set":
        return set_automaton(node[1])
    if kind in ("alt", "cat"):
        parts = [build(part) for part in node[1]]
        if kind == "alt":
            parts = [p for p in parts if p is not None]
        elif None in parts:
            return None
        if len(parts) < 2:
            return parts[0] if parts else (None if kind == "alt" else EMPTY_STRING)
        if kind == "alt":
            return combine(parts, [], range(len(parts)), range(len(parts)))
        return combine(parts, [(i, i + 1) for i in range(len(parts) - 1)], [0], [len(parts) - 1])
    _, part, lo, hi = node
    part = build(part)
    if part is None or hi == 0:
        return EMPTY_STRING if lo == 0 else None
    # x accepts the empty string: x{lo,hi} is x'{0,hi}, x' = x without it, whose copies then need
    # no subset construction.
    if part[1][1]:
        part = without_empty_string(part)
        lo = 0
    copies = max(lo, 1) if hi is None else hi
    if copies * len(part[0]) > MAX_STATES:
        raise ValueError(f"the regex needs more than {MAX_STATES:,} DFA states (a repeat of "
                         f"{copies:,} copies of a part of {len(part[0]) - 1} states)")
    links = [(i, i + 1) for i in range(copies - 1)]
    if hi is None:   # (x{lo,}: the last copy repeats)
        links.append((copies - 1, copies - 1))
    # x{0,hi}: one more part, the empty string, which is a start too.
    parts = [part] * copies + ([EMPTY_STRING] if lo == 0 else [])
    starts = [0, copies] if lo == 0 else [0]
    return combine(parts, links, starts, range(max(lo, 1) - 1, len(parts)))


def without_empty_string(automaton):
    """The language less the empty string: a new start (a copy of the old one's row) that does
    not accept; what led back to the start leads to the old start, which does."""
    table, accepting, byte_class = automaton
    moved = len(table)   # the old start's new number
    table = np.where(table == 1, moved, table)
    table = np.concatenate([table, table[1:2]])
    return table, np.concatenate([accepting[:1], [False], accepting[2:], [True]]), byte_class


def combine(parts: list, links: list[tuple[int, int]], first, final):
    """The parts side by side, starting in the parts `first`, accepting in the accepting states
    of the parts `final`; a link (i, j): each accepting state of part i also starts part j."""
    offsets = np.cumsum([1] + [len(p[0]) - 1 for p in parts])   # part i's states from offsets[i]
    if offsets[-1] > MAX_STATES:
        raise ValueError(f"the regex needs more than {MAX_STATES:,} DFA states")
    distinct = list({id(p): p for p in parts}.values())   # (a repeat's copies are one part)
    cuts = np.unique(np.concatenate([[0]] + [np.flatnonzero(np.diff(p[2])) + 1 for p in distinct]))
    columns = {id(p): p[0][1:, p[2][cuts]] for p in distinct}   # over the classes of them all
    # part i's states renumbered from offsets[i]; the dead state stays 0
    table = np.concatenate([np.zeros((1, len(cuts)), np.int32)] + [
        np.where(columns[id(p)] == 0, 0, columns[id(p)] + (off - 1))
        for p, off in zip(parts, offsets)])
    accepts = [np.flatnonzero(p[1]) + (off - 1) for p, off in zip(parts, offsets)]
    is_final = np.zeros(len(table), bool)
    is_final[np.concatenate([accepts[i] for i in final])] = True
    eps: dict[int, list[int]] = {}
    for i, j in links:
        for q in accepts[i].tolist():
            eps.setdefault(q, []).append(int(offsets[j]))
    table, accepting = determinize(table, is_final, eps, [int(offsets[i]) for i in first])
    if len(table) <= MINIMIZE_MAX:
        table, accepting = minimize(table, accepting)
    byte_class = np.searchsorted(cuts, np.arange(256), side="right").astype(np.int32) - 1
    return table, accepting, byte_class


def determinize(table: np.ndarray, is_final: np.ndarray, eps: dict[int, list[int]],
                starts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The subset construction over deterministic parts joined by epsilon links `eps`.

    `table` (int32 [n, classes]) holds the parts side by side, as `combine` numbers them: row 0
    is the dead state (all 0), and `table[s, c]` is the state s goes to on a byte of class c (0:
    none). `is_final` (bool [n]) marks the states where the text may end; `eps[s]` lists the
    states that s is as well (the starts of the parts that follow where s ends a part), to be
    followed transitively; `starts` lists the states the text begins in. Every state but 0 can
    reach a final state, by its row or its links.
    Returns the DFA of that language, (table int32 [m, classes], accepting bool [m]), over the
    same classes: state 0 dead (a row of 0s, not accepting), state 1 the start (`renumber` puts
    them first), and every other state able to reach an accepting one (a state is a non-empty
    set of the input's states; the empty set is 0). More than MAX_STATES states, or more than
    `budget.subsets` sets of several states (compile_regex allows MAX_SUBSETS), is a ValueError.
    """
    useless = ~is_final & ~table.any(1)   # no way on and not accepting: left out of every set
    useless[0] = True

    def closure(states) -> frozenset:
        stack, seen = list(states), set(states)
        while stack:
            new = [t for t in eps.get(stack.pop(), ()) if t not in seen]
            seen.update(new)
            stack += new
        return frozenset(s for s in seen if not useless[s])

    sets: dict[frozenset, int] = {}   # the states that are sets of several, by their ids
    members_of: list[frozenset] = []  # ... and their members, in id order

    def state_of(members: frozenset) -> int:
        if len(members) == 1 and (m := next(iter(members))) not in eps:
            return m   # a part's own state
        if not members:
            return 0
        if members not in sets:
            budget.subsets -= 1
            if len(table) + len(sets) >= MAX_STATES or budget.subsets < 0:
                raise ValueError(f"the regex needs more than {MAX_STATES:,} DFA states, or more "
                                 f"than {MAX_SUBSETS:,} built by the subset construction")
            sets[members] = len(table) + len(sets)
            members_of.append(members)
        return sets[members]

    remap = np.arange(len(table), dtype=np.int32)   # a state with links: its closure's
    for q in eps:
        remap[q] = state_of(closure([q]))
    start = state_of(closure(starts))
    rows = [remap[table]]
    accepting = [is_final]
    for members in members_of:   # the sets of several states, explored as they appear
        targets = table[sorted(members)]
        live = (targets != 0).sum(0)
        row = np.where(live == 1, remap[targets].max(0), 0)   # one member goes on: its closure
        several = np.flatnonzero(live > 1)
        if len(several):   # (each distinct column of targets once)
            columns = np.ascontiguousarray(targets[:, several].T)
            keys = columns.view(np.dtype((np.void, columns.shape[1] * columns.itemsize))).ravel()
            _, first, which = np.unique(keys, return_index=True, return_inverse=True)
            ids = [state_of(closure(set(columns[i].tolist()) - {0})) for i in first]
            row[several] = np.array(ids, np.int32)[which.reshape(-1)]
        rows.append(row[None])
        accepting.append(is_final[sorted(members)].any(keepdims=True))
    return renumber(np.concatenate(rows), np.concatenate(accepting), start)


def renumber(table: np.ndarray, accepting: np.ndarray, start: int):
    """Dead state 0, the start 1, then the states some row leads to (the ends that links
    replaced are left out)."""
    kept = np.bincount(table.reshape(-1), minlength=len(table)) > 0
    kept[0] = kept[start] = False
    order = np.concatenate([[0, start], np.flatnonzero(kept)])
    new_id = np.zeros(len(table), np.int32)
    new_id[order] = np.arange(len(order), dtype=np.int32)
    return new_id[table[order]], accepting[order]


def minimize(table: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Equivalent states merged, if the partition settles within MAX_ROUNDS rounds (else the
    table as it is); the dead state stays 0, the start 1."""
    block = np.where(accepting, 2, 1)
    block[0] = 0   # dead, live, accepting
    block = np.unique(block, return_inverse=True)[1].reshape(-1)
    for _ in range(MAX_ROUNDS):   # split blocks whose states lead to different blocks
        rows = np.ascontiguousarray(np.concatenate([block[:, None], block[table]], 1), np.int64)
        new = np.unique(rows.view(np.dtype((np.void, rows.shape[1] * 8))).ravel(),
                        return_inverse=True)[1].reshape(-1)   # (each row as one opaque value)
        if new.max() == block.max():
            break
        block = new
    else:
        return table, accepting
    order = list(dict.fromkeys([block[0], block[1], *block]))   # dead's block, the start's, ...
    rank = np.empty(block.max() + 1, np.int64)
    rank[order] = np.arange(len(order))
    block = rank[block]
    first = np.unique(block, return_index=True)[1]
    return block[table[first]].astype(np.int32), accepting[first]


class DFA:
    def __init__(self, table: np.ndarray, accepting: np.ndarray, byte_class: np.ndarray):
        self.table = table
        self.accepting = accepting
        self.byte_class = byte_class
        self.start = 1
        # walk's copies: Python lists index faster than numpy does one item at a time
        self.walk_table = table.tolist()
        self.byte_classes = byte_class.tolist()

    def walk(self, state: int, data: bytes) -> int:
        """The state after reading `data` from `state`: `table[state, byte_class[b]]` for each
        byte b in turn (`walk_table` and `byte_classes` are the same as lists). The dead state 0
        leads only to itself. A text may come in pieces, `walk(walk(s, a), b) == walk(s, a + b)`,
        also when a piece ends inside a character."""
        for b in data:
            state = self.walk_table[state][self.byte_classes[b]]
        return state


@functools.lru_cache(32)
def compile_regex(pattern: str) -> DFA:
    """The DFA of a Python regex; a ValueError says what is not supported. Cached: the front end
    compiles a request's constraint to check it, the core to use it."""
    budget.subsets = MAX_SUBSETS
    try:
        automaton = build(parse(pattern))
    finally:
        build.cache_clear()   # (what it holds is this pattern's parts)
    if automaton is None:
        raise ValueError(f"the regex {pattern[:80]!r} matches nothing")
    return DFA(*automaton)
