"""Assignment 10: regex to DFA to token mask.

Graded: `DFA.walk` against a table walk written here, on random automata; `determinize` on
random epsilon-linked parts against a simulation of the sets of states they can be in, and
through `compile_regex` on random patterns (literals, classes, alternation, `* + ?`, `{m,n}`,
non-ASCII characters) against Python's `re.fullmatch`, with every state but the dead one able to
reach a match; `TokenIndex.next_states`, `allowed` and `bitmask` on random automata and small
hand-made vocabularies; and the engine keeping sampled text inside a regex.
"""
import re
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import nanoinfer.structured_output.dfa as dfa_module
from nanoinfer import LLM, GuidedDecodingParams, SamplingParams
from nanoinfer.structured_output.dfa import DFA, compile_regex, determinize
from nanoinfer.structured_output.token_index import TokenIndex, Vocabulary


def examples(n: int) -> settings:
    """n examples, the same ones each run; a failure is shrunk to a small one (one failure, and
    no "explain" phase: both cost minutes when every example fails)."""
    return settings(max_examples=n, deadline=None, derandomize=True, report_multiple_bugs=False,
                    phases=[Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def table_walk(dfa: DFA, state: int, data: bytes) -> int:
    """The oracle for DFA.walk: one row lookup per byte."""
    for b in data:
        state = int(dfa.table[state, dfa.byte_class[b]])
    return state


def random_dfa(seed: int, num_states: int, num_classes: int) -> DFA:
    """Any table whose row 0 is all 0 (the dead state), random classes and accepting states."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, num_states, (num_states, num_classes)).astype(np.int32)
    table[0] = 0
    accepting = rng.random(num_states) < 0.4
    accepting[0] = False
    return DFA(table, accepting, rng.integers(0, num_classes, 256).astype(np.int32))


# criterion 1: DFA.walk

@examples(150)
@given(seed=st.integers(0, 2**32 - 1), num_states=st.integers(1, 8),
       num_classes=st.integers(1, 5), data=st.binary(max_size=12),
       cut=st.integers(0, 12), start=st.integers(0, 7))
def walk_follows_the_table(seed, num_states, num_classes, data, cut, start):
    dfa = random_dfa(seed, num_states, num_classes)
    state = start % num_states
    assert dfa.walk(state, b"") == state
    assert dfa.walk(state, data) == table_walk(dfa, state, data)
    assert dfa.walk(dfa.walk(state, data[:cut]), data[cut:]) == table_walk(dfa, state, data)
    assert dfa.walk(0, data) == 0   # the dead state stays dead


def test_walk():
    """DFA.walk reads bytes one table lookup each, and a text may come in pieces"""
    walk_follows_the_table()   # on random tables
    dfa = compile_regex("[é日🙂]")   # (one class: a trie, made without determinize)
    for char in "é日🙂":
        data = char.encode()
        for cut in range(1, len(data)):   # a token may end inside a character
            middle = dfa.walk(dfa.start, data[:cut])
            assert middle != 0 and not dfa.accepting[middle]
            assert dfa.accepting[dfa.walk(middle, data[cut:])]
    assert dfa.walk(dfa.start, "e".encode()) == 0


# criterion 2: determinize on its own

@st.composite
def linked_parts(draw):
    """determinize's input: a table whose row 0 is dead, the final states, epsilon links, and
    the start states."""
    n = draw(st.integers(2, 7))
    k = draw(st.integers(1, 3))
    rows = draw(st.lists(st.lists(st.integers(0, n - 1), min_size=k, max_size=k),
                         min_size=n - 1, max_size=n - 1))
    table = np.array([[0] * k] + rows, np.int32)
    is_final = np.array([False] + draw(st.lists(st.booleans(), min_size=n - 1,
                                                max_size=n - 1)))
    live = st.integers(1, n - 1)
    eps = draw(st.dictionaries(live, st.lists(live, min_size=1, max_size=2, unique=True),
                               max_size=3))
    starts = draw(st.lists(live, min_size=1, max_size=2, unique=True))
    # As in combine's input, every state but 0 can reach a final state (by its row or a link):
    # those that cannot are made final.
    is_final[1:] |= ~can_reach_a_final(table, is_final, eps)[1:]
    return table, is_final, eps, starts


def can_reach_a_final(table, is_final, eps) -> np.ndarray:
    reaches = is_final.copy()
    for _ in range(len(table)):
        for s in range(1, len(table)):
            targets = [t for t in table[s].tolist() if t != 0] + eps.get(s, [])
            reaches[s] |= any(reaches[t] for t in targets)
    return reaches


def nfa_accepts(table, is_final, eps, starts, word: list[int]) -> bool:
    """The oracle: the set of states the input so far can be in, links followed."""
    def closure(states):
        seen, todo = set(states), list(states)
        while todo:
            for t in eps.get(todo.pop(), []):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen
    current = closure(starts)
    for c in word:
        current = closure({int(table[s, c]) for s in current} - {0})
    return any(is_final[s] for s in current)


def words(num_classes: int, max_len: int) -> list[list[int]]:
    out, level = [[]], [[]]
    for _ in range(max_len):
        level = [w + [c] for w in level for c in range(num_classes)]
        out += level
    return out


@examples(150)
@given(parts=linked_parts())
def test_determinize_links_parts(parts):
    """determinize makes linked parts one DFA: dead state 0, start 1, the same language"""
    # (compile_regex sets the thread's budget of subsets; called alone, determinize needs it)
    dfa_module.budget.subsets = dfa_module.MAX_SUBSETS
    table, is_final, eps, starts = parts
    out, accepting = determinize(table.copy(), is_final.copy(), eps, starts)
    assert out.ndim == 2 and out.shape[1] == table.shape[1] and len(accepting) == len(out)
    assert not out[0].any() and not accepting[0], "state 0 must be dead"
    for word in words(table.shape[1], 5):
        state = 1
        for c in word:
            state = int(out[state, c])
        assert bool(accepting[state]) == nfa_accepts(table, is_final, eps, starts, word), word


# criteria 3 and 4: compile_regex (determinize through build and combine) against re

ATOMS = ["a", "b", "é", "日", "🙂", r"\.", "[ab]", "[^a]", "[a-c]", "[à-ê]", r"\d", "."]
REPEATS = ["*", "+", "?", "{2}", "{0,2}", "{1,3}", "{2,}"]
ALPHABET = ["a", "b", "c", "é", "ê", "日", "🙂", "1", ".", "\n"]


def extend(inner):
    return st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner | st.just(""), min_size=2, max_size=3).map(
            lambda options: "(?:" + "|".join(options) + ")"),
        st.tuples(inner, st.sampled_from(REPEATS)).map(lambda t: f"(?:{t[0]}){t[1]}"))


PATTERNS = st.recursive(st.sampled_from(ATOMS), extend, max_leaves=7)


def random_texts(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(ALPHABET, rng.integers(0, 8))) for _ in range(n)]


@examples(120)
@given(pattern=PATTERNS, seed=st.integers(0, 2**32 - 1), data=st.data())
def test_dfa_matches_re(pattern, seed, data):
    """The DFA accepts a text exactly when re.fullmatch matches it"""
    dfa, rx = compile_regex(pattern), re.compile(pattern)
    for text in random_texts(seed, 60):
        got = bool(dfa.accepting[table_walk(dfa, 1, text.encode())])
        assert got == bool(rx.fullmatch(text)), (pattern, text)
    for _ in range(3):   # texts that match, drawn from the pattern
        text = data.draw(st.from_regex(rx, fullmatch=True, alphabet=st.sampled_from(ALPHABET)))
        assert dfa.accepting[table_walk(dfa, 1, text.encode())], (pattern, text)


def reachable(dfa: DFA) -> dict[int, bytes]:
    """Each state reachable from the start, with the shortest bytes that reach it."""
    byte_of_class = {int(c): bytes([b]) for b, c in reversed(list(enumerate(dfa.byte_class)))}
    path, todo = {1: b""}, deque([1])
    while todo:
        state = todo.popleft()
        for c, b in byte_of_class.items():
            target = int(dfa.table[state, c])
            if target not in path:
                path[target] = path[state] + b
                todo.append(target)
    return path


def way_to_a_match(dfa: DFA, state: int) -> bytes | None:
    """The shortest bytes that lead from `state` to an accepting state (None: there are none)."""
    byte_of_class = {int(c): bytes([b]) for b, c in reversed(list(enumerate(dfa.byte_class)))}
    path, todo = {state: b""}, deque([state])
    while todo:
        s = todo.popleft()
        if dfa.accepting[s]:
            return path[s]
        for c, b in byte_of_class.items():
            target = int(dfa.table[s, c])
            if target not in path:
                path[target] = path[s] + b
                todo.append(target)
    return None


@examples(100)
@given(pattern=PATTERNS)
def test_only_state_0_is_dead(pattern):
    """State 0 is dead, and every other state can still reach a match"""
    dfa = compile_regex(pattern)
    assert not dfa.table[0].any() and not dfa.accepting[0]
    for state, prefix in reachable(dfa).items():
        if state == 0:
            continue
        rest = way_to_a_match(dfa, state)
        assert rest is not None, f"{pattern!r}: state {state} (after {prefix!r}) is a dead end"
        assert re.fullmatch(pattern, (prefix + rest).decode()), (pattern, prefix + rest)


# criteria 5-7: the token index

# The worked example of docs/ARCHITECTURE.md section 11: (yes|no), states 1-5, 5 accepting.
YES_NO = {1: {"y": 2, "n": 3}, 2: {"e": 4}, 3: {"o": 5}, 4: {"s": 5}, 5: {}}
YES_NO_VOCAB = [b"y", b"ye", b"yes", b"e", b"s", b"n", b"no", b"o", b"yo", None]   # 9: EOS


def yes_no_dfa() -> DFA:
    letters = "yesno"
    byte_class = np.zeros(256, np.int32)   # class 0: every other byte
    for i, letter in enumerate(letters):
        byte_class[ord(letter)] = i + 1
    table = np.zeros((6, len(letters) + 1), np.int32)
    for state, moves in YES_NO.items():
        for letter, target in moves.items():
            table[state, letters.index(letter) + 1] = target
    return DFA(table, np.array([False] * 5 + [True]), byte_class)


def token_index(dfa: DFA, token_bytes: list, eos: list[int]) -> TokenIndex:
    return TokenIndex(dfa, Vocabulary(token_bytes, eos))


def allowed_set(index: TokenIndex, state: int) -> set[int]:
    allowed = index.allowed(state)
    assert allowed.dtype == np.bool_ and allowed.shape == (index.vocab.size,)
    return set(np.flatnonzero(allowed).tolist())


BYTES = [0x61, 0x62, 0x63, 0xC3, 0xA9, 0x20]
# A token without bytes is None (a special token) or b"" (an empty text).
vocabularies = st.lists(st.none() | st.just(b"") | st.lists(st.sampled_from(BYTES), min_size=1,
                                                            max_size=4).map(bytes),
                        min_size=1, max_size=70)


@examples(150)
@given(seed=st.integers(0, 2**32 - 1), num_states=st.integers(1, 6),
       num_classes=st.integers(1, 4), token_bytes=vocabularies, start=st.integers(0, 5))
def test_next_states(seed, num_states, num_classes, token_bytes, start):
    """next_states gives the state each token's bytes end in (0: it dies or has no bytes)"""
    dfa = random_dfa(seed, num_states, num_classes)
    state = start % num_states
    ends = token_index(dfa, token_bytes, []).next_states(state)
    assert ends.shape == (len(token_bytes),)
    want = [table_walk(dfa, state, b) if b else 0 for b in token_bytes]
    assert ends.tolist() == want


@examples(150)
@given(seed=st.integers(0, 2**32 - 1), num_states=st.integers(1, 6),
       num_classes=st.integers(1, 4), token_bytes=vocabularies, start=st.integers(0, 5))
def allowed_follows_the_walk(seed, num_states, num_classes, token_bytes, start):
    dfa = random_dfa(seed, num_states, num_classes)
    eos = len(token_bytes)   # (a special token: no bytes)
    index = token_index(dfa, token_bytes + [None], [eos])
    state = start % num_states
    want = {t for t, b in enumerate(token_bytes) if b and table_walk(dfa, state, b) != 0}
    if state == 0 or dfa.accepting[state] or not want:
        want.add(eos)
    assert allowed_set(index, state) == want, \
        f"token {eos} is EOS; state {state}, accepting: {bool(dfa.accepting[state])}"


def test_allowed(monkeypatch):
    """A token is allowed iff it ends in a live state; EOS where the text matches or is stuck"""
    allowed_follows_the_walk()   # on random tables and vocabularies
    index = token_index(yes_no_dfa(), YES_NO_VOCAB, [9])
    assert allowed_set(index, 1) == {0, 1, 2, 5, 6}   # "yo" dies on its "o"; no EOS
    assert allowed_set(index, 2) == {3}
    assert allowed_set(index, 5) == {9}   # a full match with no way on: EOS alone
    assert allowed_set(index, 0) == {9}   # dead (after an EOS that ignore_eos let pass): EOS
    # Without "e" and "s" in the vocabulary no token leaves state 2: EOS ends the request.
    lacking = token_index(yes_no_dfa(), [b"y", b"n", b"o", None], [3])
    assert allowed_set(lacking, 2) == {3}
    # A match that can go on (state 2 of a+, after "a"): its tokens and EOS.
    byte_class = (np.arange(256) == ord("a")).astype(np.int32)
    a_plus = DFA(np.array([[0, 0], [0, 2], [0, 2]], np.int32), np.array([False, False, True]),
                 byte_class)
    plus = token_index(a_plus, [b"a", b"aa", b"ab", None], [3])
    assert allowed_set(plus, 2) == {0, 1, 3}
    # Given `ends` (next_states(state), computed already), allowed uses them.
    ends = index.next_states(1)
    monkeypatch.setattr(index, "next_states", lambda state: pytest.fail("walked again"))
    assert set(np.flatnonzero(index.allowed(1, ends)).tolist()) == {0, 1, 2, 5, 6}


def bits_of(mask: np.ndarray, size: int) -> list[int]:
    return [t for t in range(size) if (int(mask[t // 32]) >> (t % 32)) & 1]


@examples(100)
@given(seed=st.integers(0, 2**32 - 1), num_states=st.integers(1, 6),
       num_classes=st.integers(1, 4), token_bytes=vocabularies, start=st.integers(0, 5))
def bitmask_packs_allowed(seed, num_states, num_classes, token_bytes, start):
    dfa = random_dfa(seed, num_states, num_classes)
    eos = len(token_bytes)
    index = token_index(dfa, token_bytes + [None], [eos])
    state = start % num_states
    mask = index.bitmask(state)
    size = len(token_bytes) + 1
    assert mask.dtype == np.int32 and mask.shape == (-(-size // 32),)
    assert bits_of(mask, 32 * len(mask)) == sorted(allowed_set(index, state))


def test_bitmask(monkeypatch):
    """bitmask packs token t into bit t % 32 of word t // 32 (int32), once per state"""
    bitmask_packs_allowed()   # on random tables and vocabularies
    index = token_index(yes_no_dfa(), YES_NO_VOCAB, [9])
    words = {state: index.bitmask(state).tolist() for state in range(1, 6)}
    assert words == {1: [103], 2: [8], 3: [128], 4: [16], 5: [512]}   # ARCHITECTURE.md's table
    # Token 31 is the top bit of word 0: the word is negative as an int32.
    vocab = [b"q"] * 31 + [b"y", b"n"] + [None] * 7
    assert token_index(yes_no_dfa(), vocab, [39]).bitmask(1).tolist() == [-2**31, 1]
    # A state's mask is computed once, kept in `masks`, and served from there.
    monkeypatch.setattr(index, "next_states", lambda state: pytest.fail("walked again"))
    assert index.masks[1].tolist() == [103] and index.bitmask(1).tolist() == [103]


# criterion 8: end to end

REGEXES = [r"[a-z]{2,5}( [0-9]{1,3}){1,2}", r"(yes|no|maybe)!?", r"é{1,3}日?-\d\d",
           r"\([a-z]{1,4}, [^a-z ]{2}\)"]


def test_engine_keeps_text_in_the_regex(llama_dir):
    """End to end: guided decoding's sampled text fully matches its regex"""
    llm = LLM(llama_dir, max_model_len=128, num_kvcache_blocks=32, enforce_eager=True)
    prompts = [[5 + i, 17, 9, 30 + 3 * i] for i in range(2 * len(REGEXES))]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, guided_decoding=(
        GuidedDecodingParams(regex=REGEXES[i % len(REGEXES)]))) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, p in zip(outputs, params):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (p.guided_decoding.regex, completion.text)
        assert re.fullmatch(p.guided_decoding.regex, completion.text), \
            (p.guided_decoding.regex, completion.text)
