"""Regular expression -> deterministic finite automaton over bytes.

A constraint on the output is a regular language: the text must `re.fullmatch` a pattern. To test
a growing text cheaply, the pattern becomes a DFA: a table `next = table[state, byte_class[b]]`
with a set of accepting states. It runs over the UTF-8 *bytes* of the text, because tokens are
byte strings and a token may hold only part of a character.

Three classic steps:
1. parse the pattern into a tree: ("set", ranges of code points), ("cat", parts),
   ("alt", options), ("repeat", part, min, max or None);
2. Thompson's construction: the tree becomes an NFA whose edges carry byte ranges (a character set
   becomes the UTF-8 byte sequences of its code points: `utf8_ranges`) or nothing (epsilon);
3. the subset construction: a DFA state is the set of NFA states the text so far can be in. Bytes
   that no edge tells apart share a class, so the table has a column per class, not per byte.
Then states from which no accepting state can be reached become the dead state 0 (a text there can
never match), and equivalent states are merged (Moore's partition refinement).

Supported: literals, escapes (\\n \\t \\xhh \\uhhhh, \\. etc.), `.` (not a newline), classes
and negated classes, \\d \\w \\s and their negations (ASCII, as `re.ASCII`), groups (`(...)`,
`(?:...)`, `(?P<name>...)`), `|`, `? * +`, `{m}`, `{m,}`, `{m,n}` (a lazy `?` after them changes
nothing for a full match), and `^`/`$` at the ends. Anything else is a ValueError naming it.
"""
import re

import numpy as np

MAX_CHAR, SURROGATES = 0x10FFFF, (0xD800, 0xDFFF)
MAX_STATES = 20000
CLASSES = {"d": [(48, 57)], "w": [(48, 57), (65, 90), (95, 95), (97, 122)], "s": [(9, 13), (32, 32)]}
REPEAT = re.compile(r"\{(\d*)(,?)(\d*)\}")
ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "0": 0}


def complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for a, b in sorted(ranges):
        if a > lo:
            out.append((lo, a - 1))
        lo = max(lo, b + 1)
    return out + ([(lo, MAX_CHAR)] if lo <= MAX_CHAR else [])


class Parser:
    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def error(self, what: str):
        return ValueError(f"unsupported regex feature at position {self.i} of {self.p!r}: {what}")

    def peek(self, n: int = 1) -> str:
        return self.p[self.i:self.i + n]

    def take(self) -> str:
        self.i += 1
        return self.p[self.i - 1]

    def parse(self):
        if self.peek() == "^":
            self.i += 1
        node = self.alternation()
        if self.i < len(self.p):
            raise self.error("unbalanced ')'") if self.peek() == ")" else self.error(repr(self.peek()))
        return node

    def alternation(self):
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self):
        parts = []
        while self.i < len(self.p) and self.peek() not in "|)":
            if self.peek() == "$" and self.i == len(self.p) - 1:
                self.i += 1
                break
            parts.append(self.quantified(self.atom()))
        return ("cat", parts)

    def quantified(self, node):
        while self.peek() and self.peek() in "?*+{":
            if self.peek() == "{":
                m = REPEAT.match(self.p, self.i)
                if m is None:   # not a repeat: a literal '{', as in Python
                    break
                self.i = m.end()
                lo, comma, hi = m.groups()
                bounds = (int(lo or 0), int(hi) if hi else (None if comma else int(lo)))
                if bounds[1] is not None and bounds[1] < bounds[0]:
                    raise self.error(f"repeat {m.group()} with max < min")
            else:
                bounds = {"?": (0, 1), "*": (0, None), "+": (1, None)}[self.take()]
            if self.peek() == "?":   # lazy: the same language
                self.i += 1
            elif self.peek() == "+":
                raise self.error("possessive quantifier")
            node = ("repeat", node, *bounds)
        return node

    def atom(self):
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                if self.peek(2) == "?:":
                    self.i += 2
                elif self.peek(3) == "?P<" and ">" in self.p[self.i:]:
                    self.i = self.p.index(">", self.i) + 1
                else:
                    raise self.error(f"group '(?{self.p[self.i + 1:self.i + 2]}' (lookaround, flags, ...)")
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')'")
            self.i += 1
            return node
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", [(0, 9), (11, MAX_CHAR)])
        if c == "\\":
            return ("set", self.escape())
        if c in "*+?" or (c == "{" and REPEAT.match(self.p, self.i - 1)):
            raise self.error(f"nothing to repeat before {c!r}")
        if c in "^$":
            raise self.error(f"anchor {c!r} inside the pattern")
        return ("set", [(ord(c), ord(c))])

    def escape(self) -> list[tuple[int, int]]:
        c = self.take() if self.i < len(self.p) else ""
        if c.lower() in CLASSES:
            return CLASSES[c] if c.islower() else complement(CLASSES[c.lower()])
        if c in ESCAPES:
            return [(ESCAPES[c], ESCAPES[c])]
        if c in "xu":
            digits = self.p[self.i:self.i + (2 if c == "x" else 4)]
            if len(digits) != (2 if c == "x" else 4) or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"bad \\{c} escape")
            self.i += len(digits)
            return [(int(digits, 16), int(digits, 16))]
        if c and not c.isalnum():
            return [(ord(c), ord(c))]
        raise self.error(f"escape '\\{c}' (backreferences, \\b, \\A, ...)")

    def char_class(self) -> list[tuple[int, int]]:
        negate = self.peek() == "^"
        self.i += negate
        ranges, first = [], True
        while first or self.peek() != "]":
            if self.i >= len(self.p):
                raise self.error("missing ']'")
            first = False
            c = self.take()
            if c == "[" and self.peek() == ":":
                raise self.error("POSIX class [:...:]")
            item = self.escape() if c == "\\" else [(ord(c), ord(c))]
            if self.peek() == "-" and self.peek(2)[1:] not in ("]", "") and item[0][0] == item[-1][1]:
                self.i += 1
                c2 = self.take()
                hi = self.escape() if c2 == "\\" else [(ord(c2), ord(c2))]
                if len(hi) != 1 or hi[0][0] != hi[0][1] or hi[0][0] < item[0][0]:
                    raise self.error("bad range in a class")
                item = [(item[0][0], hi[0][0])]
            ranges += item
        self.i += 1
        return complement(ranges) if negate else ranges


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

    def walk(self, state: int, data: bytes) -> int:
        for b in data:
            state = self.table[state, self.byte_class[b]]
        return int(state)

    def fullmatch(self, text: str) -> bool:
        return bool(self.accepting[self.walk(self.start, text.encode())])


def compile_regex(pattern: str) -> DFA:
    nfa = NFA()
    accept = nfa.build(Parser(pattern).parse(), nfa.state())
    cuts = sorted({0, 256} | {x for edges in nfa.edges for lo, hi, _ in edges for x in (lo, hi + 1)})
    byte_class = np.searchsorted(cuts, np.arange(256), side="right").astype(np.int32) - 1
    moves = [{} for _ in nfa.edges]   # per NFA state: byte class -> targets
    for s, edges in enumerate(nfa.edges):
        for lo, hi, t in edges:
            for c in range(byte_class[lo], byte_class[hi] + 1):
                moves[s].setdefault(c, set()).add(t)
    closures = {}

    def closure(states) -> frozenset:
        stack, seen = list(states), set(states)
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)

    dead, start = frozenset(), closure([0])
    index, order, rows = {dead: 0, start: 1}, [dead, start], []
    while len(rows) < len(order):
        targets = {}
        for s in order[len(rows)]:
            for c, ts in moves[s].items():
                targets.setdefault(c, set()).update(ts)
        row = [0] * (len(cuts) - 1)
        for c, ts in targets.items():
            key = frozenset(ts)
            if key not in closures:
                closures[key] = closure(ts)
            target = closures[key]
            if target not in index:
                if len(order) >= MAX_STATES:
                    raise ValueError(f"the regex {pattern[:80]!r} needs more than {MAX_STATES} DFA states")
                index[target] = len(order)
                order.append(target)
            row[c] = index[target]
        rows.append(row)
    table = np.array(rows, np.int32)
    accepting = np.array([accept in s for s in order])
    table, accepting = minimize(table, accepting)
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
