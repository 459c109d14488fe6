"""Regular expression -> a tree of sets, concatenations, alternations and repeats (then dfa.py
builds the automaton).

A constraint on the output is a regular language: the text must `re.fullmatch` a pattern. The
pattern is read by Python's own regex parser (so the syntax is exactly `re`'s), then turned into
our tree: ("set", code point ranges), ("cat", parts), ("alt", options), ("repeat", part, min,
max or None). Character classes become explicit code point ranges, in the dialect's meaning:
- Python's `re` (str patterns, the dialect of `regex=` constraints): `\\d`, `\\w`, `\\s` are
  Unicode's classes, or ASCII's under `(?a)`; `.` is any character but a newline (any under
  `(?s)`);
- ECMAScript's (JSON Schema's `pattern`, `parse(pattern, ecmascript=True)`): `\\d` and `\\w` are
  ASCII's, `\\s` is ECMAScript's white space and line terminators, `.` leaves out the four line
  terminators (as with its `u` flag, which JSON Schema asks for), and what it does not have or
  reads otherwise than Python (`\\A`, `\\Z`, `\\a`, `\\cX`, `{,n}`, `[]`, `(?P<...>)`) is
  refused. Where ECMAScript and Python's `re` (which `jsonschema` uses) differ, a class holds
  only what both put in it (`\\s` leaves out U+FEFF; `\\W` every Unicode letter; `[^\\d]` every
  Unicode digit).
Supported: literals and escapes, `.`, classes and negated classes, groups, `|`, `? * +`, `{m}`,
`{m,}`, `{m,n}` (lazy or not: the same language for a full match), and `^`/`$` at the ends.
Lookaround, backreferences, `\\b`, other inline flags (case-insensitive matching) and
possessive repeats are a ValueError naming them.
"""
import functools
import re

try:
    from re import _parser as sre   # Python >= 3.11
except ImportError:
    import sre_parse as sre

MAX_CHAR = 0x10FFFF
UNSUPPORTED = {sre.ASSERT: "lookahead/lookbehind", sre.ASSERT_NOT: "negative lookaround",
               sre.GROUPREF: "backreference", sre.GROUPREF_EXISTS: "conditional group",
               sre.AT: "anchor or \\b"}
ASCII_CLASSES = {"d": [(48, 57)], "w": [(48, 57), (65, 90), (95, 95), (97, 122)],
                 "s": [(9, 13), (32, 32)]}
ES_CLASSES = {**ASCII_CLASSES, "s": [(9, 13), (32, 32), (0xA0, 0xA0), (0x1680, 0x1680),
              (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
              (0x3000, 0x3000), (0xFEFF, 0xFEFF)]}   # ECMAScript's (JSON Schema's patterns)
ES_ESCAPES = set("dDwWsSbBtnvfr0xu")   # the letters and digits ECMAScript escapes (and Python)
CATEGORIES = {sre.CATEGORY_DIGIT: ("d", False), sre.CATEGORY_NOT_DIGIT: ("d", True),
              sre.CATEGORY_WORD: ("w", False), sre.CATEGORY_NOT_WORD: ("w", True),
              sre.CATEGORY_SPACE: ("s", False), sre.CATEGORY_NOT_SPACE: ("s", True)}


def complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    lo = 0
    for a, b in sorted(ranges):
        if a > lo:
            out.append((lo, a - 1))
        lo = max(lo, b + 1)
    return out + ([(lo, MAX_CHAR)] if lo <= MAX_CHAR else [])


@functools.cache
def category_ranges(category, classes: str) -> list[tuple[int, int]]:
    """The code points of `\\d`, `\\w`, `\\s` or a negation, as `classes` ("unicode": Python's
    re, found by `re` itself over every code point; "ascii"; "ecmascript") have them."""
    name, negated = CATEGORIES[category]
    if classes == "unicode":
        every = "".join(map(chr, range(MAX_CHAR + 1)))
        ranges = [(m.start(), m.end() - 1) for m in re.finditer(f"\\{name}+", every)]
    else:
        ranges = (ES_CLASSES if classes == "ecmascript" else ASCII_CLASSES)[name]
    return complement(ranges) if negated else ranges


def check_ecmascript(pattern: str) -> None:
    """A ValueError for what ECMAScript does not have, or reads otherwise than Python's re:
    escapes such as `\\A`, `\\Z`, `\\a`, `\\c` (which Python refuses), `\\0` and a digit, `{,n}`,
    `[]` and `[^]`, `(?P...)` and `(?#...)`."""
    for m in re.finditer(r"\\(.)(?=(.?))", pattern, flags=re.S):
        c = m.group(1)
        if (c.isalnum() and c not in ES_ESCAPES) or (c == "0" and m.group(2).isdigit()):
            raise ValueError(f"unsupported regex escape \\{c} in {pattern!r} (JSON Schema's "
                             "patterns are ECMAScript regexes)")
    if m := re.search(r"\(\?[P#]|(?<!\\)\{,|(?<!\\)\[\^?\]", pattern):
        raise ValueError(f"unsupported regex syntax {m.group()!r} in {pattern!r} (JSON Schema's "
                         "patterns are ECMAScript regexes)")


def parse(pattern: str, ecmascript: bool = False):
    """The pattern as a tree, read by Python's own regex parser."""
    if ecmascript:
        check_ecmascript(pattern)
    try:
        parsed = sre.parse(pattern)
    except re.error as e:
        raise ValueError(f"bad regex {pattern!r}: {e}") from None
    if parsed.state.flags & ~(re.UNICODE if ecmascript else re.UNICODE | re.ASCII | re.DOTALL):
        raise ValueError(f"unsupported regex feature in {pattern!r}: inline flags such as (?i)")
    items = list(parsed)
    if items and items[0] == (sre.AT, sre.AT_BEGINNING):   # a full match anyway
        items = items[1:]
    if items and items[-1] in ((sre.AT, sre.AT_END), (sre.AT, sre.AT_END_STRING)):
        items = items[:-1]
    line_ends = [(10, 10), (13, 13), (0x2028, 0x2029)] if ecmascript else [(10, 10)]
    # the classes a text must satisfy: ECMAScript's and Python's (jsonschema's), or Python's
    classes = ["unicode", "ecmascript"] if ecmascript else \
        ["ascii" if parsed.state.flags & re.ASCII else "unicode"]
    return tree(items, pattern, (classes, [] if parsed.state.flags & re.DOTALL else line_ends))


def to_regex(node, excluded: list[tuple[int, int]] = ()) -> str:
    """A tree written back as a regex, its sets without the code points `excluded`."""
    if node[0] == "set":
        ranges = complement(complement(node[1]) + list(excluded))
        if not ranges:
            return "[^\\x00-\\U0010ffff]"
        return "[" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges) + "]"
    if node[0] != "repeat":
        sep = "" if node[0] == "cat" else "|"
        return "(?:" + sep.join(to_regex(p, excluded) for p in node[1]) + ")"
    return f"(?:{to_regex(node[1], excluded)}){{{node[2]},{'' if node[3] is None else node[3]}}}"


def tree(items, pattern: str, dialect):
    parts = []
    for op, arg in items:
        if op == sre.LITERAL:
            parts.append(("set", ((arg, arg),)))
        elif op == sre.NOT_LITERAL:
            parts.append(("set", tuple(complement([(arg, arg)]))))
        elif op == sre.ANY:
            parts.append(("set", tuple(complement(dialect[1]))))
        elif op == sre.IN:   # (in every dialect the text must satisfy)
            ranges = [char_class(arg, classes) for classes in dialect[0]]
            parts.append(("set", tuple(complement([r for c in ranges for r in complement(c)]))))
        elif op == sre.BRANCH:
            parts.append(("alt", tuple(tree(branch, pattern, dialect) for branch in arg[1])))
        elif op == sre.SUBPATTERN and not (arg[1] or arg[2]):   # (a group without flags)
            parts.append(tree(arg[3], pattern, dialect))
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):   # (lazy or not: the same language)
            hi = None if arg[1] == sre.MAXREPEAT else arg[1]
            parts.append(("repeat", tree(arg[2], pattern, dialect), arg[0], hi))
        else:
            feature = UNSUPPORTED.get(op, str(op).lower())
            raise ValueError(f"unsupported regex feature in {pattern!r}: {feature}")
    return ("cat", tuple(parts))


def char_class(items, classes: str) -> list[tuple[int, int]]:
    """The code point ranges of a class, its categories as `classes` has them."""
    ranges = []
    for op, arg in items:
        if op == sre.LITERAL:
            ranges.append((arg, arg))
        elif op == sre.RANGE:
            ranges.append(arg)
        elif op == sre.CATEGORY:
            ranges += category_ranges(arg, classes)
    return complement(ranges) if items and items[0][0] == sre.NEGATE else ranges
