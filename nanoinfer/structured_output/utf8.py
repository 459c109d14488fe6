"""A set of code points as UTF-8 byte ranges: the DFA (dfa.py) runs over bytes, so a character
set becomes the byte sequences that encode its code points, as ranges per byte (`[a-z]` is one
range of one byte; `[^"]` is every ASCII byte but one, or a lead byte followed by continuation
bytes). Code points of one encoded length are contiguous in UTF-8's byte order, so a range of
them is a few range sequences."""
from nanoinfer.structured_output.regex import MAX_CHAR

SURROGATES = (0xD800, 0xDFFF)


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
