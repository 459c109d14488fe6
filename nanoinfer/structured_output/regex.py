"""Regular expression -> deterministic finite automaton over bytes.

A constraint on the output is a regular language: the text must `re.fullmatch` a pattern. To test
a growing text cheaply, the pattern becomes a DFA: a table `next = table[state, byte_class[b]]`
with a set of accepting states. It runs over the UTF-8 *bytes* of the text, because tokens are
byte strings and a token may hold only part of a character.

Three classic steps:
1. parse the pattern (with Python's own parser, then into our tree: ("set", ranges of code
   points), ("cat", parts), ("alt", options), ("repeat", part, min, max or None));
2. Thompson's construction: the tree becomes an NFA whose edges carry byte ranges (a character set
   becomes the UTF-8 byte sequences of its code points: `utf8_ranges`) or nothing (epsilon);
3. the subset construction: a DFA state is the set of NFA states the text so far can be in. Bytes
   that no edge tells apart share a class, so the table has a column per class, not per byte.
Then states from which no accepting state can be reached become the dead state 0 (a text there can
never match), and equivalent states are merged (Moore's partition refinement).

Supported: everything that describes a regular language: literals and escapes, `.` (not a
newline), classes and negated classes, \\d \\w \\s and their negations (ASCII, as `re.ASCII`),
groups, `|`, `? * +`, `{m}`, `{m,}`, `{m,n}` (lazy or not: the same language for a full match),
and `^`/`$` at the ends. Lookaround, backreferences, \\b, inline flags and possessive repeats are
a ValueError naming them, and so is a pattern whose repeats unroll into more than `MAX_SIZE`
parts (checked when it is parsed, before anything is built) or whose DFA has more than
`MAX_STATES` states.
"""
import functools
import re

import numpy as np

try:
    from re import _parser as sre   # Python >= 3.11
except ImportError:
    import sre_parse as sre

MAX_CHAR, SURROGATES = 0x10FFFF, (0xD800, 0xDFFF)
MAX_STATES, MAX_SIZE = 20000, 50000
UNSUPPORTED = {sre.ASSERT: "lookahead/lookbehind", sre.ASSERT_NOT: "negative lookaround",
               sre.GROUPREF: "backreference", sre.GROUPREF_EXISTS: "conditional group", sre.AT: "anchor or \\b"}


def complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for a, b in sorted(ranges):
        if a > lo:
            out.append((lo, a - 1))
        lo = max(lo, b + 1)
    return out + ([(lo, MAX_CHAR)] if lo <= MAX_CHAR else [])


DIGIT, WORD, SPACE = [(48, 57)], [(48, 57), (65, 90), (95, 95), (97, 122)], [(9, 13), (32, 32)]
CATEGORIES = {sre.CATEGORY_DIGIT: DIGIT, sre.CATEGORY_NOT_DIGIT: complement(DIGIT), sre.CATEGORY_WORD: WORD,
              sre.CATEGORY_NOT_WORD: complement(WORD), sre.CATEGORY_SPACE: SPACE,
              sre.CATEGORY_NOT_SPACE: complement(SPACE)}


def parse(pattern: str):
    """The pattern as a tree, read by Python's own regex parser (so the syntax is exactly `re`'s)."""
    try:
        parsed = sre.parse(pattern)
    except re.error as e:
        raise ValueError(f"bad regex {pattern!r}: {e}") from None
    if parsed.state.flags & ~(re.UNICODE | re.ASCII):
        raise ValueError(f"unsupported regex feature in {pattern!r}: inline flags such as (?i)")
    items = list(parsed)
    if items and items[0] == (sre.AT, sre.AT_BEGINNING):   # a full match anyway
        items = items[1:]
    if items and items[-1] in ((sre.AT, sre.AT_END), (sre.AT, sre.AT_END_STRING)):
        items = items[:-1]
    node = tree(items, pattern)
    if size(node) > MAX_SIZE:   # checked before anything is built: a repeat is unrolled
        raise ValueError(f"the regex {pattern[:80]!r} is too large: its repeats unroll to over {MAX_SIZE} parts")
    return node


def size(node) -> int:
    if node[0] == "set":
        return 1
    if node[0] != "repeat":
        return 1 + sum(map(size, node[1]))
    return 1 + size(node[1]) * max(node[2], node[3] or 0, 1)


def to_regex(node, excluded: list[tuple[int, int]] = ()) -> str:
    """A tree written back as a regex, its sets without the code points `excluded`."""
    if node[0] == "set":
        ranges = complement(complement(node[1]) + list(excluded))
        return "[" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges) + "]" if ranges else "[^\\x00-\\U0010ffff]"
    if node[0] != "repeat":
        return "(?:" + ("" if node[0] == "cat" else "|").join(to_regex(p, excluded) for p in node[1]) + ")"
    return f"(?:{to_regex(node[1], excluded)}){{{node[2]},{'' if node[3] is None else node[3]}}}"


def tree(items, pattern: str):
    parts = []
    for op, arg in items:
        if op == sre.LITERAL:
            parts.append(("set", [(arg, arg)]))
        elif op == sre.NOT_LITERAL:
            parts.append(("set", complement([(arg, arg)])))
        elif op == sre.ANY:
            parts.append(("set", [(0, 9), (11, MAX_CHAR)]))
        elif op == sre.IN:
            parts.append(("set", char_class(arg)))
        elif op == sre.BRANCH:
            parts.append(("alt", [tree(branch, pattern) for branch in arg[1]]))
        elif op == sre.SUBPATTERN and not (arg[1] or arg[2]):   # (a group without flags)
            parts.append(tree(arg[3], pattern))
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):   # (lazy or not: the same language)
            parts.append(("repeat", tree(arg[2], pattern), arg[0], None if arg[1] == sre.MAXREPEAT else arg[1]))
        else:
            raise ValueError(f"unsupported regex feature in {pattern!r}: {UNSUPPORTED.get(op, str(op).lower())}")
    return ("cat", parts)


def char_class(items) -> list[tuple[int, int]]:
    """The code point ranges of a class: \\d, \\w and \\s are ASCII's (as with re.ASCII)."""
    ranges = []
    for op, arg in items:
        if op == sre.LITERAL:
            ranges.append((arg, arg))
        elif op == sre.RANGE:
            ranges.append(arg)
        elif op == sre.CATEGORY:
            ranges += CATEGORIES[arg]
    return complement(ranges) if items and items[0][0] == sre.NEGATE else ranges


def utf8_ranges(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The UTF-8 encodings of code points lo..hi as sequences of byte ranges."""
    out = []
    for a, b in ((0, 0x7F), (0x80, 0x7FF), (0x800, SURROGATES[0] - 1), (SURROGATES[1] + 1, 0xFFFF),
                 (0x10000, MAX_CHAR)):   # ranges of one encoded length, surrogates left out
        if max(lo, a) <= min(hi, b):
            out += byte_ranges(list(chr(max(lo, a)).encode()), list(chr(min(hi, b)).encode()))
    return out


def byte_ranges(first: list[int], last: list[int]) -> list[list[tuple[int, int]]]:
    """All byte strings from `first` to `last` (same length, UTF-8 order) as range sequences."""
    n = len(first) - 1
    if first[1:] == [0x80] * n and last[1:] == [0xBF] * n:
        return [[(first[0], last[0])] + [(0x80, 0xBF)] * n]
    if first[0] == last[0]:
        return [[(first[0], first[0])] + r for r in byte_ranges(first[1:], last[1:])]
    out = [[(first[0], first[0])] + r for r in byte_ranges(first[1:], [0xBF] * n)]
    if first[0] + 1 < last[0]:
        out.append([(first[0] + 1, last[0] - 1)] + [(0x80, 0xBF)] * n)
    return out + [[(last[0], last[0])] + r for r in byte_ranges([0x80] * n, last[1:])]


class NFA:
    def __init__(self):
        self.edges: list[list[tuple[int, int, int]]] = []   # per state: (lo byte, hi byte, target)
        self.eps: list[list[int]] = []

    def state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.eps) - 1

    def build(self, node, start: int) -> int:
        """Add `node` from state `start`; returns its end state."""
        kind = node[0]
        if kind == "set":
            end = self.state()
            for lo, hi in node[1]:
                for seq in utf8_ranges(lo, hi):
                    s = start
                    for i, (a, b) in enumerate(seq):
                        t = end if i == len(seq) - 1 else self.state()
                        self.edges[s].append((a, b, t))
                        s = t
            return end
        if kind == "cat":
            for part in node[1]:
                start = self.build(part, start)
            return start
        if kind == "alt":
            end = self.state()
            for option in node[1]:
                self.eps[self.build(option, start)].append(end)
            return end
        _, part, lo, hi = node
        for _ in range(lo):
            start = self.build(part, start)
        if hi is None:   # a loop: the part's end leads back to its start
            loop = self.state()
            self.eps[start].append(loop)
            self.eps[self.build(part, loop)].append(loop)
            return loop
        end = self.state()
        for _ in range(hi - lo):
            self.eps[start].append(end)
            start = self.build(part, start)
        self.eps[start].append(end)
        return end


class DFA:
    def __init__(self, table: np.ndarray, byte_class: np.ndarray, accepting: np.ndarray):
        self.table, self.byte_class, self.accepting = table, byte_class, accepting
        self.start = 1
        # walk's copies: Python lists index faster than numpy does one item at a time
        self.walk_table, self.byte_classes = table.tolist(), byte_class.tolist()

    def walk(self, state: int, data: bytes) -> int:
        for b in data:
            state = self.walk_table[state][self.byte_classes[b]]
        return state


def compile_regex(pattern: str) -> DFA:
    nfa = NFA()
    accept = nfa.build(parse(pattern), nfa.state())
    cuts = sorted({0, 256} | {x for edges in nfa.edges for lo, hi, _ in edges for x in (lo, hi + 1)})
    byte_class = np.searchsorted(cuts, np.arange(256), side="right").astype(np.int32) - 1
    moves = [{} for _ in nfa.edges]   # per NFA state: byte class -> targets
    for s, edges in enumerate(nfa.edges):
        for lo, hi, t in edges:
            for c in range(byte_class[lo], byte_class[hi] + 1):
                moves[s].setdefault(c, set()).add(t)

    @functools.cache
    def closure(states: frozenset) -> frozenset:
        stack, seen = list(states), set(states)
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)

    dead, start = frozenset(), closure(frozenset([0]))
    index, order, rows = {dead: 0, start: 1}, [dead, start], []
    while len(rows) < len(order):
        targets = {}
        for s in order[len(rows)]:
            for c, ts in moves[s].items():
                targets.setdefault(c, set()).update(ts)
        row = [0] * (len(cuts) - 1)
        for c, ts in targets.items():
            target = closure(frozenset(ts))
            if target not in index:
                if len(order) >= MAX_STATES:
                    raise ValueError(f"the regex {pattern[:80]!r} needs more than {MAX_STATES} DFA states")
                index[target] = len(order)
                order.append(target)
            row[c] = index[target]
        rows.append(row)
    table, accepting = minimize(np.array(rows, np.int32), np.array([accept in s for s in order]))
    return DFA(table, byte_class, accepting)


def live_states(table: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """The states from which an accepting state can be reached."""
    live = accepting.copy()
    while True:
        grown = live | live[table].any(1)
        if (grown == live).all():
            return live
        live = grown


def minimize(table: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dead-end states into state 0, then equivalent states merged; the start stays state 1."""
    live = live_states(table, accepting)
    if not live[1]:
        raise ValueError("the regex matches nothing")
    table = np.where(live[table], table, 0)
    live[0] = False
    block = np.where(live, 1 + accepting, 0)   # dead, live, accepting
    while True:   # split blocks whose states lead to different blocks, until none splits
        rows = np.ascontiguousarray(np.concatenate([block[:, None], block[table]], 1), dtype=np.int64)
        new = np.unique(rows.view(np.dtype((np.void, rows.shape[1] * 8))).ravel(), return_inverse=True)[1]
        if new.max() + 1 == len(np.unique(block)):   # (each row as one opaque value: fast to sort)
            break
        block = new.reshape(-1)
    order = list(dict.fromkeys([block[0], block[1], *block]))   # the dead block first, then the start's
    rank = np.empty(block.max() + 1, np.int64)
    rank[order] = np.arange(len(order))
    block = rank[block]
    first = np.unique(block, return_index=True)[1]
    return block[table[first]].astype(np.int32), accepting[first]
