"""JSON schema grammars held to their promise: every text a grammar allows is valid JSON that
`jsonschema` (Draft 2020-12, formats not checked) validates under the schema, and whatever
cannot be honoured is refused with a ValueError.

Three sources of schemas:
1. the official JSON-Schema-Test-Suite (draft 2020-12), which the sdist of `jsonschema` on PyPI
   ships: each schema either compiles or is refused; a suite instance the grammar allows (in its
   canonical form) must be valid, and so must random texts walked from the DFA;
2. a corpus of hand-written schemas, one or more for each supported keyword: instances that
   hypothesis-jsonschema generates are allowed where the grammar is meant to be complete, and
   random walks that hypothesis draws are valid;
3. known defects, one test each (they must hold once fixed).

Only the public interface is used: `json_schema_to_regex` (schema -> regex) and `compile_regex`
(regex -> DFA: `start`, `table`, `byte_class`, `accepting`, `walk`).
"""
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from nanoinfer.structured_output.json_schema import json_schema_to_regex
from nanoinfer.structured_output.dfa import compile_regex

jsonschema = pytest.importorskip("jsonschema")
hypothesis = pytest.importorskip("hypothesis")
# (hypothesis-jsonschema 0.23.1 needs hypothesis < 6.170.10: its objects use an internal of
# hypothesis that later releases changed, an AttributeError: 'many' object has no attribute 'more')
hypothesis_jsonschema = pytest.importorskip("hypothesis_jsonschema")
st = hypothesis.strategies

SUITE_VERSION = "4.26.0"   # the jsonschema release whose sdist holds the suite
SUITE_WALKS = 20           # random texts per compiled suite schema
COMPILE_SECONDS = 10       # a suite schema whose grammar takes longer is skipped (and counted)
REPORT_SCHEMAS = 25        # schemas named in the failure report (3 lines each)
HYPOTHESIS = hypothesis.settings(max_examples=40, deadline=None, database=None, derandomize=True,
                                 suppress_health_check=[hypothesis.HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# helpers: compiling, judging a text, canonical texts, random walks of a DFA


def grammar(schema):
    """The schema's DFA (a ValueError where the schema is refused)."""
    return compile_regex(json_schema_to_regex(schema))


def allows(dfa, text: str | bytes) -> bool:
    data = text.encode() if isinstance(text, str) else text
    return bool(dfa.accepting[dfa.walk(dfa.start, data)])


def validator(schema):
    return jsonschema.Draft202012Validator(schema, format_checker=None)


def no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def problem(data: bytes, check) -> str | None:
    """Why `data` breaks the promise (not UTF-8, not JSON, invalid under the schema), or None.
    NaN and Infinity, which Python's json takes, are not JSON."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError) as e:
        return f"not JSON: {e}"
    try:
        error = jsonschema.exceptions.best_match(check.iter_errors(value))
    except Exception as e:   # (e.g. a $ref jsonschema cannot resolve)
        return f"jsonschema raised {type(e).__name__}: {e}"
    return None if error is None else f"invalid: {error.message[:200]}"


def resolve(root, ref: str):
    """The subschema a local JSON pointer ("#/$defs/x") names, or None."""
    if not ref.startswith("#/"):
        return root if ref == "#" else None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def ordered(value, schema, check, depth: int = 0):
    """`value` with each object's keys in its schema's `properties` order (the others after, as
    they came), following `items`, local `$ref`s and the first `anyOf` branch that fits."""
    if not isinstance(schema, dict) or depth > 50:
        return value
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        props = schema["properties"]
        keys = [k for k in props if k in value] + [k for k in value if k not in props]
        return {k: ordered(value[k], props.get(k), check, depth + 1) for k in keys}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [ordered(v, schema["items"], check, depth + 1) for v in value]
    if isinstance(schema.get("$ref"), str) and (target := resolve(check.schema, schema["$ref"])):
        return ordered(value, target, check, depth + 1)
    for branch in schema.get("anyOf", []) if isinstance(schema.get("anyOf"), list) else []:
        try:
            fits = check.evolve(schema=branch).is_valid(value)
        except Exception:   # (a branch jsonschema cannot use: try the next)
            fits = False
        if fits:
            return ordered(value, branch, check, depth + 1)
    return value


def canonical(value, schema, check=None) -> bytes:
    """The text the grammar is meant to take for `value`: compact, properties in the schema's
    order, non-ASCII raw (escaped where a lone surrogate cannot be raw)."""
    value = ordered(value, schema, check or validator(schema))
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()


class Walker:
    """Random texts a DFA allows. Each step takes a random live column (a byte class from which
    an accepting state can still be reached), then a random byte of it; at an accepting state it
    stops with probability `stop`, and past `cap` bytes it follows a shortest way to acceptance."""

    def __init__(self, dfa, stop: float = 0.15, cap: int = 80):
        self.dfa, self.stop, self.cap = dfa, stop, cap
        self.table, self.accepting = np.asarray(dfa.table), np.asarray(dfa.accepting, bool)
        byte_class = np.asarray(dfa.byte_class)
        self.bytes_of = [np.flatnonzero(byte_class == c).tolist()
                         for c in range(self.table.shape[1])]
        self.dist = self.distances()
        self.moves = {}

    def distances(self) -> np.ndarray:
        """Bytes from each state to the nearest accepting one (-1: none), by a breadth-first
        search from the accepting states over the reversed table."""
        n, width = self.table.shape
        targets = self.table.ravel()
        order = np.argsort(targets, kind="stable")
        sources = order // width                                   # edges sorted by target
        bounds = np.searchsorted(targets[order], np.arange(n + 1))
        dist = np.full(n, -1, np.int64)
        frontier = np.flatnonzero(self.accepting)
        dist[frontier], step = 0, 0
        while frontier.size:
            step += 1
            preds = np.concatenate([sources[bounds[t]:bounds[t + 1]] for t in frontier])
            frontier = np.unique(preds[dist[preds] < 0])
            dist[frontier] = step
        return dist

    def live_moves(self, state: int) -> list[tuple[int, int]]:
        """(column, next state) of the columns that keep the text completable."""
        if state not in self.moves:
            row = self.table[state]
            self.moves[state] = [(c, int(t)) for c, t in enumerate(row)
                                 if t != 0 and self.dist[t] >= 0 and self.bytes_of[c]]
        return self.moves[state]

    def text(self, rng) -> bytes:
        state, out = self.dfa.start, bytearray()
        assert self.dist[state] >= 0, "the DFA's start state reaches no accepting state"
        while True:
            moves = self.live_moves(state)
            if self.accepting[state] and (not moves or len(out) >= self.cap
                                          or rng.random() < self.stop):
                return bytes(out)
            assert moves, f"a live state without a way on, after {bytes(out)!r}"
            if len(out) >= self.cap:
                nearest = min(self.dist[t] for _, t in moves)
                moves = [(c, t) for c, t in moves if self.dist[t] == nearest]
            column, state = rng.choice(moves)
            out.append(rng.choice(self.bytes_of[column]))


def walks_sound(dfa, schema, count: int = 200, seed: int = 0) -> None:
    """`count` seeded random texts of the DFA are all valid under the schema."""
    walker, check, rng = Walker(dfa), validator(schema), random.Random(seed)
    for _ in range(count):
        text = walker.text(rng)
        why = problem(text, check)
        assert why is None, f"allows the random text {text!r}: {why}"


# ---------------------------------------------------------------------------------------------
# 1. the official JSON-Schema-Test-Suite


def cache_dir() -> Path:
    return Path(os.environ.get("NANOINFER_CACHE") or Path.home() / ".cache" / "nanoinfer")


def fetch_suite(folder: Path) -> None:
    """Download jsonschema's sdist with pip and keep only json/tests/draft2020-12/*.json, written
    under a temporary name and renamed when complete (an interrupted run leaves no folder)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"jsonschema=={SUITE_VERSION}",
               "--no-binary", ":all:", "--no-deps", "--disable-pip-version-check", "-d", tmp]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot download the JSON-Schema-Test-Suite (jsonschema's sdist): {e}")
        sdist = Path(tmp) / f"jsonschema-{SUITE_VERSION}.tar.gz"
        if run.returncode or not sdist.is_file():
            why = (run.stderr.strip().splitlines() or ["pip failed"])[-1]
            pytest.skip(f"cannot download the JSON-Schema-Test-Suite (jsonschema=={SUITE_VERSION}"
                        f" sdist from PyPI; no network?): {why}")
        staged = Path(tmp) / "draft2020-12"
        staged.mkdir()
        prefix = f"jsonschema-{SUITE_VERSION}/json/tests/draft2020-12/"
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name[len(prefix):]
                if (member.isfile() and member.name.startswith(prefix) and "/" not in name
                        and name.endswith(".json")):   # (not optional/)
                    (staged / name).write_bytes(tar.extractfile(member).read())
        found = len(list(staged.glob("*.json")))
        if found <= 30:   # (not cached: the next run tries again)
            pytest.fail(f"{sdist.name} holds {found} files under {prefix}, not the suite")
        try:
            staged.rename(folder)
        except OSError:   # another run got there first
            if not folder.is_dir():
                raise


@pytest.fixture(scope="session")
def suite_files() -> list[Path]:
    """The suite's draft 2020-12 files, downloaded on first use into the cache, then reused."""
    folder = cache_dir() / "json-schema-test-suite" / SUITE_VERSION / "draft2020-12"
    if not folder.is_dir():
        fetch_suite(folder)
    files = sorted(folder.glob("*.json"))
    assert len(files) > 30, f"only {len(files)} suite files in {folder}"
    return files


class CompileTimeout(BaseException):
    """A compile over its time (a BaseException: engine code catching Exception keeps it)."""


def timed_grammar(schema, cache: dict):
    """`grammar`, cached by regex, interrupted after COMPILE_SECONDS where a timer can be set
    (SIGALRM, in the main thread); the previous timer and handler are put back."""
    regex = json_schema_to_regex(schema)
    if regex in cache:
        return cache[regex]
    main = threading.current_thread() is threading.main_thread()
    use_alarm, armed = main and hasattr(signal, "setitimer"), [True]
    if use_alarm:
        def expire(signum, frame):
            if armed[0]:   # (not once the compile is over: the finally below is not cut short)
                raise CompileTimeout

        previous = signal.signal(signal.SIGALRM, expire)
        before = signal.setitimer(signal.ITIMER_REAL, COMPILE_SECONDS)
        started = time.monotonic()
    try:
        cache[regex] = compile_regex(regex)
    except ValueError as e:
        cache[regex] = e
    finally:
        armed[0] = False
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if before[0]:   # (another timer was running: it goes on, less the time spent)
                signal.setitimer(signal.ITIMER_REAL,
                                 max(before[0] - (time.monotonic() - started), 1e-3), before[1])
    return cache[regex]


def short(value, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


def suite_promises(dfa, group: dict, counts: collections.Counter) -> list[str]:
    """How one compiled suite schema breaks its promise: the invalid suite instances it allows
    (in canonical form), its random texts that are not valid JSON or not valid."""
    schema, broken = group["schema"], []
    check = validator(schema)
    for test in group["tests"]:
        text = canonical(test["data"], schema, check)
        valid, accepted = problem(text, check) is None, allows(dfa, text)
        counts["valid" if valid else "invalid", accepted] += 1
        if accepted and not valid:
            broken.append(f"allows the invalid suite instance {test['description']!r}: "
                          f"{short(text.decode('utf-8', 'replace'))}")
    walker, rng = Walker(dfa), random.Random(json.dumps(schema))
    for _ in range(SUITE_WALKS):
        try:
            text = walker.text(rng)
        except AssertionError as e:
            return broken + [f"the random walk failed: {e}"]
        counts["walked"] += 1
        if why := problem(text, check):
            counts["walked invalid"] += 1
            broken.append(f"allows the random text {short(repr(text))} ({why})")
    return broken


def test_official_suite(suite_files):
    """Each suite schema compiles or is refused (ValueError, nothing else); a compiled one allows
    no invalid suite instance in canonical form, and its random texts are valid JSON, valid."""
    counts, refusals, cache = collections.Counter(), collections.Counter(), {}
    failures: dict[str, list[str]] = {}   # per schema ("file #n 'description': schema")
    for path in suite_files:
        for number, group in enumerate(json.loads(path.read_text("utf-8"))):
            where = f"{path.name} #{number} {group['description']!r}: {short(group['schema'])}"
            counts["schemas"] += 1
            try:
                dfa = timed_grammar(group["schema"], cache)
            except CompileTimeout:
                counts["slow"] += 1
                continue
            except ValueError as e:
                dfa = e
            except Exception as e:   # a crash is a bug, not a refusal
                counts["errors"] += 1
                failures[where] = [f"raised {type(e).__name__} (not ValueError): {e}"]
                continue
            if isinstance(dfa, ValueError):
                counts["refused"] += 1
                refusals[str(dfa)[:70]] += 1
                continue
            counts["compiled"] += 1
            if broken := suite_promises(dfa, group, counts):
                failures[where] = broken
    print(f"\nJSON-Schema-Test-Suite draft2020-12 (jsonschema {SUITE_VERSION}): "
          f"{len(suite_files)} files, {counts['schemas']} schemas: {counts['compiled']} compiled,"
          f" {counts['refused']} refused, {counts['slow']} skipped (compile over "
          f"{COMPILE_SECONDS} s), {counts['errors']} errors")
    print(f"  suite instances of compiled schemas: valid {counts['valid', True]} accepted / "
          f"{counts['valid', False]} rejected (incomplete); invalid {counts['invalid', True]} "
          f"accepted (unsound) / {counts['invalid', False]} rejected")
    print(f"  random texts walked: {counts['walked']}, invalid: {counts['walked invalid']}")
    print("  most common refusals: " + "; ".join(f"{n} x {m}" for m, n in refusals.most_common(8)))
    assert counts["compiled"] > 20 and counts["walked"] > 0, counts   # (not vacuous)
    report = []
    for where, broken in list(failures.items())[:REPORT_SCHEMAS]:
        report += [where] + [f"    {line}" for line in broken[:3]]
        report += [f"    ... and {len(broken) - 3} more"] if len(broken) > 3 else []
    if len(failures) > REPORT_SCHEMAS:
        report.append(f"... and {len(failures) - REPORT_SCHEMAS} more schemas")
    if failures:   # (pytest.fail: the report alone, without the dict's repr)
        pytest.fail(f"{len(failures)} suite schemas break their promise:\n" + "\n".join(report),
                    pytrace=False)


# ---------------------------------------------------------------------------------------------
# 2. a corpus of hand-written schemas, with hypothesis


def ascii_only(value) -> bool:
    """ECMAScript's \\d and \\w are ASCII (Python's re, which jsonschema uses, takes Unicode
    digits and letters too): a grammar of ECMAScript's classes is complete on ASCII strings."""
    return value.isascii()


SPACES = " \t\n\v\f\r\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009" \
         "\u200a\u2028\u2029\u202f\u205f\u3000"   # \s in both ECMAScript and Python's re


def both_spaces(value) -> bool:
    """The \\s of `^a\\sb$` is white space in both ECMAScript and Python's re (\\x1c-\\x1f and
    \\x85 are Python's only, \\ufeff ECMAScript's only) and JSON writes it raw (not \\t, \\n,
    ..., which a pattern's grammar may leave out): there the grammar is complete."""
    return value[1] in SPACES and value[1] >= " "


POINT = {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}
NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}
# (name, schema, complete): True where every valid instance (canonical form) must be allowed,
# False where only soundness is asked, or a test of the instances on which it is complete
CORPUS = [
    ("integer", {"type": "integer"}, True),
    ("number", {"type": "number"}, True),
    ("boolean or null", {"type": ["boolean", "null"]}, True),
    ("type list", {"type": ["string", "integer", "null"]}, True),
    ("string", {"type": "string"}, True),
    ("string lengths", {"type": "string", "minLength": 2, "maxLength": 4}, True),
    ("string empty only", {"type": "string", "maxLength": 0}, True),
    ("string long", {"type": "string", "minLength": 5}, True),
    ("type list with lengths", {"type": ["string", "array"], "maxLength": 2, "maxItems": 2,
                                "items": {"type": "integer"}}, True),
    ("const unicode", {"const": "héllo 日本 🙂"}, True),
    ("const object", {"const": {"a": [1, 2, {"b": None}], "c": "d\"e"}}, True),
    ("const false", {"const": False}, True),
    ("enum mixed", {"enum": ["a", "b\"c", "é", 3, None, True, [1, 2], {"k": "v"}]}, True),
    ("enum unicode", {"enum": ["日本", "🙂", "naïve", "tab\there", "back\\slash"]}, True),
    ("pattern anchored", {"type": "string", "pattern": "^[a-z]{2,5}$"}, True),
    ("pattern alternation", {"type": "string", "pattern": "^(cat|dog)s?$"}, True),
    ("pattern unicode", {"type": "string", "pattern": "^[à-ÿ]+é?$"}, True),
    ("pattern digits", {"type": "string", "pattern": "^\\d{3}-\\d{2}$"}, ascii_only),
    ("pattern words", {"type": "string", "pattern": "^\\w+@\\w+\\.com$"}, ascii_only),
    ("pattern space", {"type": "string", "pattern": "^a\\sb$"}, both_spaces),
    ("pattern negated classes", {"type": "string", "pattern": "^\\D\\W\\S$"}, False),
    ("pattern unanchored", {"type": "string", "pattern": "[0-9]"}, False),
    ("object required", {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"],
        "additionalProperties": False}, True),
    ("object all optional", {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "null"}},
        "additionalProperties": False}, True),
    ("object unicode keys", {"type": "object", "properties": {
        "clé": {"type": "number"}, "日本": {"type": "string", "maxLength": 2},
        "q\"k": {"const": 1}},
        "required": ["日本"], "additionalProperties": False}, True),
    ("object open", {"type": "object", "properties": {"a": {"type": "integer"}}}, False),
    ("object any", {"type": "object"}, False),
    ("array items", {"type": "array", "items": {"type": "integer"}}, True),
    ("array bounds", {"type": "array", "items": {"type": "string", "maxLength": 3},
                      "minItems": 1, "maxItems": 3}, True),
    ("array exact", {"type": "array", "items": {"type": "boolean"}, "minItems": 2,
                     "maxItems": 2}, True),
    ("array min only", {"type": "array", "items": {"type": "null"}, "minItems": 3}, True),
    ("array of enum", {"type": "array", "items": {"enum": [1, 2, "x"]}, "maxItems": 4}, True),
    ("anyOf scalars", {"anyOf": [{"type": "string", "minLength": 2, "maxLength": 3},
                                 {"type": "null"}, {"type": "integer"}]}, True),
    ("anyOf objects", {"anyOf": [
        {"type": "object", "properties": {"x": {"type": "integer"}, "z": {"type": "boolean"}},
         "required": ["x"], "additionalProperties": False},
        {"type": "object", "properties": {"y": {"type": "string"}}, "required": ["y"],
         "additionalProperties": False}]}, True),
    ("ref", {"$defs": {"point": POINT}, "type": "object", "properties": {
        "p": {"$ref": "#/$defs/point"}, "q": {"$ref": "#/$defs/point"}}, "required": ["p"],
        "additionalProperties": False}, True),
    ("ref chain", {"$defs": {"name": NAME, "person": {"type": "object", "properties": {
        "first": {"$ref": "#/$defs/name"}, "last": {"$ref": "#/$defs/name"}},
        "required": ["first", "last"], "additionalProperties": False}},
        "type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 3}, True),
    ("nested", {"type": "object", "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                 "maxItems": 3},
        "owner": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8},
            "emails": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
            "required": ["name"], "additionalProperties": False},
        "points": {"type": "array", "items": POINT, "maxItems": 2}},
        "required": ["id", "owner"], "additionalProperties": False}, True),
    ("any value", {}, False),
]
NAMES = [name for name, _, _ in CORPUS]
DFAS: dict[str, object] = {}


def corpus_grammar(name: str, schema):
    """The corpus schema's DFA, compiled once: a refusal fails (only supported keywords here)."""
    if name not in DFAS:
        DFAS[name] = grammar(schema)
    return DFAS[name]


@pytest.mark.parametrize("name, schema, complete", [c for c in CORPUS if c[2]],
                         ids=[c[0] for c in CORPUS if c[2]])
def test_corpus_complete(name, schema, complete):
    """Valid instances from hypothesis-jsonschema, in canonical form, are allowed."""
    dfa, check, checked = corpus_grammar(name, schema), validator(schema), []

    @HYPOTHESIS
    @hypothesis.given(hypothesis_jsonschema.from_schema(schema))
    def holds(instance):
        if not check.is_valid(instance) or (complete is not True and not complete(instance)):
            return   # (not an instance the grammar promises to allow)
        text = canonical(instance, schema, check)
        checked.append(text)
        assert allows(dfa, text), f"a valid instance is not allowed: {text.decode()!r}"

    holds()
    assert checked, "no instance was checked"


@pytest.mark.parametrize("name, schema, complete", CORPUS, ids=NAMES)
def test_corpus_sound(name, schema, complete):
    """Random walks of the DFA (hypothesis drawing each choice) give valid JSON, valid."""
    dfa, check, texts = corpus_grammar(name, schema), validator(schema), []
    walker = Walker(dfa)

    @HYPOTHESIS
    @hypothesis.given(st.randoms(use_true_random=False))
    def holds(rng):
        text = walker.text(rng)
        texts.append(text)
        why = problem(text, check)
        assert why is None, f"{text!r}: {why}"

    holds()
    assert texts, "no text was walked"


# ---------------------------------------------------------------------------------------------
# 3. known defects (each must hold once fixed)


def honoured(schema, invalid: list[str], valid: list[str] = (), may_refuse: bool = True):
    """Refused (where `may_refuse`: a schema beyond the supported keywords, or a combination the
    engine may decline), or: none of the `invalid` texts allowed, all of the `valid` ones, and
    only valid random texts."""
    try:
        dfa = grammar(schema)
    except ValueError:
        if may_refuse:
            return
        raise
    check = validator(schema)
    for text in invalid:
        assert problem(text.encode(), check) is not None, f"the test's {text!r} is valid"
        assert not allows(dfa, text), f"allows the invalid {text!r}"
    for text in valid:
        assert problem(text.encode(), check) is None, f"the test's {text!r} is invalid"
        assert allows(dfa, text), f"does not allow the valid {text!r}"
    walks_sound(dfa, schema)


def supported(schema, invalid: list[str], valid: list[str]) -> None:
    """`honoured` for a schema of supported keywords only: a refusal fails."""
    honoured(schema, invalid, valid, may_refuse=False)


def test_properties_without_type():
    """`properties` apply to objects even without "type": "object"."""
    supported({"properties": {"a": {"type": "integer"}}, "required": ["a"]},
              ['{"a":"x"}', "{}"], ['{"a":1}'])


def test_min_length_without_type():
    supported({"minLength": 3}, ['"ab"'], ['"abc"'])


def test_items_without_type():
    supported({"items": {"type": "integer"}}, ['[1,"x"]'], ["[1,2]"])


def test_not_is_refused_or_honoured():
    """`not` is not supported: refused, or never an invalid text (`not: {}` allows no value)."""
    honoured({"properties": {"a": {"not": {}}}}, ['{"a":1}', '{"a":null}'])


def test_enum_beside_type():
    """"type" still holds beside "enum": 1 is not a string."""
    supported({"type": "string", "enum": ["a", 1]}, ["1"], ['"a"'])


def test_const_beside_type():
    """A const of the wrong type: refused (nothing would match) or nothing invalid allowed."""
    honoured({"type": "integer", "const": "x"}, ['"x"'])


def test_required_beside_any_of():
    """`required` holds beside `anyOf` (or the combination is refused)."""
    schema = {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}],
              "required": ["a"]}
    honoured(schema, ["{}", '{"b":1}'], ['{"a":1}'])


def test_max_length_beside_ref():
    """`maxLength` holds beside `$ref`, as 2020-12 has it (or the combination is refused)."""
    schema = {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}
    honoured(schema, ['"abc"'], ['"ab"'])


def test_string_length_counts_code_points():
    """JSON Schema counts code points: an escaped surrogate pair is one, as a raw emoji is."""
    dfa = grammar({"type": "string", "minLength": 2, "maxLength": 2})
    assert allows(dfa, '"\\ud83d\\ude00\\ud83d\\ude00"')
    assert allows(dfa, '"😀😀"')
    assert not allows(dfa, '"\\ud83d\\ude00"'), "one code point is too short"
    assert not allows(dfa, '"😀"')
    walks_sound(dfa, {"type": "string", "minLength": 2, "maxLength": 2})


def test_pattern_non_space_excludes_no_break_space():
    """JSON Schema patterns are ECMAScript regexes, where \\s includes U+00A0 (as in Python's
    re, which jsonschema uses): `^\\S$` does not match a no-break space, raw or escaped."""
    schema = {"type": "string", "pattern": "^\\S$"}
    dfa = grammar(schema)
    assert not allows(dfa, '"\u00a0"')
    assert not allows(dfa, '"\\u00a0"')
    assert allows(dfa, '"a"')
    walks_sound(dfa, schema)


def test_infinite_const_is_refused():
    """1e400 is infinity in Python: no JSON text stands for it (json.dumps writes Infinity)."""
    for schema in ({"const": 1e400}, '{"const": 1e400}', {"enum": [1, 1e400]}):
        with pytest.raises(ValueError):
            grammar(schema)


def test_float_enum_takes_equal_integer():
    """1 and 1.0 are the same JSON Schema number: the grammar allows json.dumps of both (1.0 as
    written, and 1, which generators such as hypothesis-jsonschema make of it)."""
    schema = {"enum": [1.0]}
    dfa = grammar(schema)
    assert [text for text in ("1", "1.0") if not allows(dfa, text)] == []
    assert not allows(dfa, "2") and not allows(dfa, "1.5")
    walks_sound(dfa, schema)


def test_pattern_with_quote_is_refused():
    """A raw '"' cannot be inside a JSON string: such a pattern is refused."""
    with pytest.raises(ValueError):
        grammar({"type": "string", "pattern": '^a"b$'})
