"""Structured output: the regex DFA against Python's `re`, the token walk over byte-level tokens,
JSON schemas against `jsonschema`, and the engine keeping every constrained output in its language
(random-weight models sampling at temperature 1: the constraint must hold whatever they prefer)."""
import json
import random
import re

import numpy as np
import pytest
import torch

from conftest import random_prompts
from nanoinfer import LLM, GuidedDecodingParams, SamplingParams
from nanoinfer.structured_output.json_schema import json_schema_to_regex
from nanoinfer.structured_output.dfa import compile_regex
from nanoinfer.structured_output.token_index import TokenIndex, Vocabulary, vocabulary_bytes

jsonschema = pytest.importorskip("jsonschema")   # (in the test extra; a GPU machine may lack it)

PATTERNS = [r"abc", r"a|b|", r"(ab)*c?", r"[a-c]{2,4}x", r"\d+(\.\d+)?", r'[^"\\]*', r"(a|ab)(c|bcd)(d*)",
            r"héllo|日本+", r".{0,3}z", r"\w+@\w+\.(com|org)", r"[\u00e0-\u00ff]+é?", r"(?:ab|cd){1,3}$",
            r"^[-+]?[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$", r"a{,2}b{2,}", r"[a-]+\{x\}", r"[^a-z日]{2}", r"\W\S\D"]
ALPHABET = list("abcdxz.@-+ eE019\"\\{}") + ["é", "日", "本", "\n", "ÿ", "🙂", "à"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"},
    "email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}, "score": {"type": "number"},
    "ok": {"type": "boolean"}, "kind": {"const": "x"}, "tag": {"enum": ["a", "b\"c", "é", 3, None]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
    "nested": {"type": "object", "properties": {"z": {"type": ["integer", "null"]}, "p": {"$ref": "#/$defs/pt"}},
               "required": ["z"]},
    "any": {"anyOf": [{"type": "string", "minLength": 2, "maxLength": 3}, {"type": "null"}]}},
    "required": ["name", "age", "tags"],
    "$defs": {"pt": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}}}


def fullmatch(dfa, text: str) -> bool:
    return bool(dfa.accepting[dfa.walk(dfa.start, text.encode())])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_dfa_agrees_with_re(pattern):
    dfa, rx, rng = compile_regex(pattern), re.compile(pattern), random.Random(pattern)
    for _ in range(3000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8)))
        assert fullmatch(dfa, text) == bool(rx.fullmatch(text)), text
    for text in [m.group() for m in [rx.fullmatch(t) for t in ("abc", "aaa", "日本本", "1.5", "ab@cd.com")] if m]:
        assert fullmatch(dfa, text)


@pytest.mark.parametrize("pattern, message", [
    ("a(?=b)", "lookahead"), ("a(?!b)", "lookaround"), (r"(a)\1", "backreference"), (r"\bx", r"\\b"),
    ("(?i)a", "inline flags"), ("a++", "possessive"), ("(ab", "bad regex"), ("ab)", "bad regex"),
    ("a{3,1}", "bad regex"), ("a^b", "anchor"), ("*a", "nothing to repeat"), ("[^\\x00-\\U0010ffff]", "matches nothing"),
    ("a{4000000000}", "DFA states"), ("(a{1000}){1000}", "DFA states")])
def test_unsupported_regex(pattern, message):
    with pytest.raises(ValueError, match=message):
        compile_regex(pattern)


def walk_dfa(dfa, rng: np.random.Generator, stop: float = 0.3) -> str:
    """A random text the DFA accepts: random bytes among those that keep it alive."""
    state, out = dfa.start, bytearray()
    while True:
        targets = dfa.table[state][dfa.byte_class]
        if dfa.accepting[state] and (rng.random() < stop or len(out) > 300 or not targets.any()):
            return out.decode()
        byte = int(rng.choice(np.flatnonzero(targets)))
        out.append(byte)
        state = targets[byte]


@pytest.mark.parametrize("schema, examples", [
    (SCHEMA, [{"name": "é", "age": -3, "tag": 3, "tags": ["ab"], "nested": {"z": None, "p": [1.5, 2e-3]}}]),
    ({"anyOf": [{"type": "string", "minLength": 2}, {"type": "integer"}]}, ["ab\"", 0]),
    ({}, [{"a": [1, "x"], "b": None}, [], "s", 1.5]),   # any JSON, two levels deep
    ({"type": "object"}, [{}, {"a": {"b": [1, None]}, "d": "x"}]),   # any object, three levels (json_object)
    ({"type": "object", "properties": {k: {"type": "integer"} for k in "abc"}}, [{}, {"b": 1}, {"a": 1, "c": 2}]),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 3}, [[True] * 3, [False] * 5]),
    ({"type": "string", "pattern": "^(cat|dog).*$"}, ["cat", "dogs é"])])   # (quotes stay outside)
def test_json_schema_language(schema, examples):
    """Every text of the schema's language parses and validates; valid JSON, compact or with a space
    after ':' and ',', matches."""
    dfa, rng = compile_regex(json_schema_to_regex(schema)), np.random.default_rng(0)
    for _ in range(200):
        jsonschema.validate(json.loads(walk_dfa(dfa, rng)), schema)
    for value in examples:
        assert fullmatch(dfa, json.dumps(value, ensure_ascii=False, separators=(",", ":")))
        assert fullmatch(dfa, json.dumps(value, ensure_ascii=False))


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": 3}, "keyword 'minimum'"), ({"type": "date"}, "type 'date'"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "recursive"),
    ({"type": "object", "required": ["x"], "additionalProperties": False}, "false"),
    ("{not json", "not valid JSON"),
    ({"enum": []}, "empty list"), ({"type": "array", "minItems": 3, "maxItems": 1}, "maxItems < minItems"),
    ({"type": "string", "pattern": "a", "maxLength": 3}, "together")])
def test_unsupported_schema(schema, message):
    with pytest.raises(ValueError, match=message):
        json_schema_to_regex(schema)


def test_a_huge_repeat_is_refused_when_added(llama_dir):
    """Checked before anything is built: it never reaches the compile thread."""
    llm = LLM(llama_dir, max_model_len=256)
    with pytest.raises(ValueError, match="DFA states"):
        llm.llm_engine.add_request("r", [5, 6], SamplingParams(
            guided_decoding=GuidedDecodingParams(json={"type": "array", "maxItems": 10**9})))
    assert not llm.llm_engine.has_unfinished_requests()


def test_token_walk_over_partial_characters():
    """Tokens that are parts of a UTF-8 character, tokens that cross from one DFA transition to the
    next, and EOS only where the text so far matches."""
    tokens = [b"\xc3", b"\xa9", b"\xc3\xa9", b"a", b'a"', b'"', b"\xe6\x97", b"\xa5", b"\xe6\x97\xa5", None, b"ab"]
    eos = 9
    index = TokenIndex(compile_regex('"(é|a)+"|日+'), Vocabulary(tokens, [eos]))
    allowed = lambda state: set(np.flatnonzero(index.allowed(state)).tolist())  # noqa: E731
    start = index.dfa.start
    assert allowed(start) == {5, 6, 8}                      # '"', the first half of 日, 日
    after_quote = index.advance(start, 5)
    assert allowed(after_quote) == {0, 2, 3, 4}             # é's lead byte, é, a, 'a"'; not "ab"
    assert allowed(index.advance(after_quote, 0)) == {1}    # only é's second byte
    end = index.advance(after_quote, 4)                     # 'a"' closes the string
    assert allowed(end) == {eos}                             # a full match with no way on: EOS alone
    assert allowed(index.advance(start, 8)) == {6, 8, eos}  # 日 matched: more 日, or EOS
    bits = index.bitmask(start)
    assert bits.dtype == np.int32 and [t for t in range(len(tokens)) if bits[t // 32] >> (t % 32) & 1] == [5, 6, 8]


def test_vocabulary_bytes_of_a_byte_level_tokenizer(llama_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    token_bytes = vocabulary_bytes(tokenizer, 512)
    assert token_bytes[400:] == [None] * 112 and token_bytes[tokenizer.eos_token_id] is None   # (special)
    text = "Héllo wörld, 日本語 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes[i] for i in ids) == text.encode()
    partial = [i for i in ids if token_bytes[i].decode(errors="ignore").encode() != token_bytes[i]]
    assert partial   # some token holds part of a character


def test_bitmask_kernel_matches_torch():
    from nanoinfer.kernels.bitmask import apply_token_bitmask_triton
    from nanoinfer.layers.sampler import apply_token_bitmask as apply_token_bitmask_torch   # (CPU)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=gen)
    masks = torch.randint(-2**31, 2**31 - 1, (4, 32), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([3, 0, 1, 3, 2], dtype=torch.int32)
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_torch(want, masks, rows)
    apply_token_bitmask_triton(got, masks, rows, block=128)
    assert torch.equal(want, got) and want.isinf().any() and not want.isinf().all()
    t = 777
    assert want[2, t].isinf() == (not (int(masks[1, t // 32]) >> (t % 32)) & 1)
    assert torch.equal(want[0].isinf(), want[3].isinf())


REGEXES = [r"[a-z]{3,6}( [a-z]{2,5}){0,3}", r"(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?", r"[^ ]{2}é?\d"]
TINY_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 4}, "n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["x", "yé"]}, "maxItems": 2}}, "required": ["name", "ok"]}


def guided_requests(n: int = 12, max_tokens: int = 100):
    """Regex, choice, JSON and unconstrained requests, all sampling at temperature 1."""
    kinds = [dict(regex=r) for r in REGEXES] + [dict(choice=["yes", "no", "dunno", "日本"]), dict(json=TINY_SCHEMA), None]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                             guided_decoding=None if kinds[i % len(kinds)] is None
                             else GuidedDecodingParams(**kinds[i % len(kinds)])) for i in range(n)]
    return random_prompts([5 + 7 * i % 40 for i in range(n)], seed=9), params


def check_outputs(outs, params):
    finished = 0
    for out, p in zip(outs, params):
        c, g = out.outputs[0], p.guided_decoding
        if g is None:
            continue
        finished += c.finish_reason == "stop"
        if c.finish_reason != "stop":   # cut off by max_tokens: still on its way to a match
            continue
        if g.regex is not None:
            assert re.fullmatch(g.regex, c.text), (g.regex, c.text)
        elif g.choice is not None:
            assert c.text in g.choice
        else:
            jsonschema.validate(json.loads(c.text), g.json)
    return finished


@pytest.mark.parametrize("settings", [dict(), dict(async_scheduling=False),
                                      dict(max_num_batched_tokens=32, num_kvcache_blocks=16, max_num_seqs=8)])
def test_engine_keeps_outputs_in_their_language(llama_dir, settings):
    """Mixed constrained and unconstrained requests; also without async scheduling, and with chunked
    prompts and preemption (few blocks)."""
    prompts, params = guided_requests()
    llm = LLM(llama_dir, max_model_len=256, **settings)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert check_outputs(outs, params) >= 6
    if "num_kvcache_blocks" in settings:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_the_mask_table_starts_again_when_full(llama_dir, monkeypatch):
    """The device keeps a row per (grammar, state); when the rows run out it starts again. The
    tokens are the same as with room for every state."""
    import nanoinfer.structured_output as so
    prompts, params = guided_requests()
    roomy = LLM(llama_dir, max_model_len=256)
    want = roomy.generate(prompts, params, use_tqdm=False)
    assert len(roomy.llm_engine.structured_output.rows) > 20
    monkeypatch.setattr(so, "MAX_MASK_ROWS", 6)   # less than a step's rows: the table grows too
    got = LLM(llama_dir, max_model_len=256).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert check_outputs(got, params) >= 6


def test_grammars_that_leave_the_cache_leave_the_mask_table(llama_dir, monkeypatch):
    import nanoinfer.structured_output as so
    monkeypatch.setattr(so, "MAX_CACHED_GRAMMARS", 2)
    llm = LLM(llama_dir, max_model_len=256)
    for i in range(5):
        choices = [f"a{i}", f"b{i}c"]
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(
            choice=choices)), use_tqdm=False)
        assert out[0].outputs[0].text in choices
    manager = llm.llm_engine.structured_output
    assert len(manager.indexes) == 2 and {key[0] for key in manager.rows} <= set(manager.indexes.values())


def test_guided_with_speculative_decoding(llama_dir):
    """n-gram drafts that the grammar does not allow are never scored; the output is the same as
    without speculation (greedy), and stays in the language."""
    prompts = [[9, 8, 7, 6] * 6, random_prompts([20], seed=3)[0]]
    params = [SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(regex=r"[a-e ]{5,30}")),
              SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(json=TINY_SCHEMA))]
    want = LLM(llama_dir, max_model_len=256).generate(prompts, params, use_tqdm=False)
    llm = LLM(llama_dir, max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                 "prompt_lookup_min": 1})
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    check_outputs(got, params)
    assert llm.llm_engine.scheduler.spec_stats.num_draft_tokens > 0


def test_bad_constraints_are_refused_and_the_engine_keeps_serving(llama_dir):
    llm = LLM(llama_dir, max_model_len=256)
    with pytest.raises(ValueError, match="lookaround"):
        llm.generate([[5, 6]], SamplingParams(guided_decoding=GuidedDecodingParams(regex="a(?!b)")))
    with pytest.raises(ValueError, match="keyword 'minimum'"):
        llm.generate([[5, 6]], SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "integer",
                                                                                         "minimum": 0})))
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams(regex="a", choice=["b"])
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["ab"])),
                       use_tqdm=False)
    assert out[0].outputs[0].text == "ab"


@pytest.fixture(scope="module")
def default_model() -> str:
    from nanoinfer.default_model import default_model_path
    try:
        return default_model_path()   # (converted once from the wheel on PyPI, then cached)
    except Exception as e:   # no package index here
        pytest.skip(f"the default model is not available: {e}")


def test_default_model_outputs_parse(default_model):
    """SmolLM2 at temperature 1: JSON that validates, most of it finishing well before max_tokens;
    a date regex; a choice."""
    llm = LLM(default_model, max_model_len=512)
    tokenizer = llm.get_tokenizer()
    chat = lambda q: tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,  # noqa: E731
                                                   add_generation_prompt=True)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 30},
                                               "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                           "maxItems": 3}}, "required": ["name", "age"]}
    json_params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160, guided_decoding=GuidedDecodingParams(json=schema))
                   for i in range(5)]
    others = [SamplingParams(temperature=1.0, seed=7, max_tokens=20,
                             guided_decoding=GuidedDecodingParams(regex=r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-2]\d")),
              SamplingParams(temperature=1.0, seed=8, max_tokens=10,
                             guided_decoding=GuidedDecodingParams(choice=["Paris", "London", "Rome"]))]
    prompts = [chat("Describe a person as JSON.")] * 5 + [chat("When did the war end?"),
                                                           chat("What is the capital of France?")]
    outs = llm.generate(prompts, json_params + others, use_tqdm=False)
    assert check_outputs(outs, json_params + others) >= 5
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[5:])


def test_min_tokens_yields_to_a_finished_grammar(llama_dir):
    """EOS blocked by min_tokens, and a grammar that allows only EOS: the grammar wins."""
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20, min_tokens=10,
                            guided_decoding=GuidedDecodingParams(choice=["ab"]))
    llm = LLM(llama_dir, max_model_len=256)
    out = llm.generate([[5, 6]], params, use_tqdm=False)[0].outputs[0]
    text = llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=False)
    assert (text.removesuffix("</s>"), out.finish_reason) == ("ab", "stop")


@pytest.mark.parametrize("schema, text", [   # each allowed an invalid text, found in review
    ({"type": "string", "pattern": "^[^\\d]$"}, '"\u0663"'), ({"type": "string", "pattern": "^[^\\w]$"}, '"é"'),
    ({"type": "string", "pattern": "^[^\\s]$"}, '"\x85"'), ({"type": "string", "pattern": "^[^\\S]$"}, '"\ufeff"'),
    ({"type": "array", "items": False, "minItems": 1}, "[]"),
    ({"$defs": {"a%20b": {"type": "integer"}, "a b": {"type": "string"}}, "$ref": "#/$defs/a%20b"}, '"s"'),
    ({"$defs": {"": {"a": {"type": "integer"}}, "a": {"type": "string"}}, "$ref": "#/$defs//a"}, '"s"')])
def test_grammars_allow_only_valid_texts(schema, text):
    try:
        dfa = compile_regex(json_schema_to_regex(schema))
    except ValueError:
        return   # refused: the promise holds
    if fullmatch(dfa, text):
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "pattern": "^[\\cA]$"}, "escape \\\\c"), ({"type": "string", "pattern": "^a{,3}$"}, "syntax '{,'"),
    ({"type": "string", "pattern": "^[]a]$"}, "syntax '\\[\\]'"), ({"type": "string", "pattern": "^(?P<n>a)$"}, "'\\(\\?P'"),
    ({"$defs": {"x": {"$anchor": "it", "type": "integer"}}, "$ref": "#it"}, "only JSON pointers"),
    ({"$defs": {"A": {"$id": "http://x/a", "type": "integer"}}, "$ref": "#/$defs/A"}, "keyword '\\$id'"),
    ({"type": "object", "required": [5]}, "names must be strings"), ({"properties": []}, "must be an object"),
    ({"type": {"x": 1}}, "malformed"), ({"allOf": 5}, "malformed")])
def test_schemas_that_cannot_be_honoured_are_refused(schema, message):
    with pytest.raises(ValueError, match=message):
        compile_regex(json_schema_to_regex(schema))


def test_overlapping_repeats_are_refused_not_built_for_ever():
    """A repeat of a part that matches the empty string is built without it; parts that overlap
    are explored set by set, and past MAX_SUBSETS refused (both took up to 40 s)."""
    rx = re.compile(r"(?:a?){0,1000}")
    dfa = compile_regex(rx.pattern)
    assert all(fullmatch(dfa, "a" * n) == bool(rx.fullmatch("a" * n)) for n in (0, 1, 999, 1000, 1001))
    for pattern in (r"(?:a|aa){0,200}", r"(?:.{0,3}){0,300}"):
        with pytest.raises(ValueError, match="subset construction"):
            compile_regex(pattern)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_grammar_that_fails_to_compile_ends_its_request(llama_dir, monkeypatch, async_scheduling):
    """Its abort reaches the caller in the step that finds it, also when it is the last request
    (found in review: the output waited for a step that never came)."""
    import nanoinfer.structured_output as so

    def fails(self, regex):
        raise RuntimeError("too many states")
    monkeypatch.setattr(so.StructuredOutputManager, "token_index", fails)
    engine = LLM(llama_dir, max_model_len=256, async_scheduling=async_scheduling).llm_engine
    engine.add_request("r", [5, 6], SamplingParams(max_tokens=4,
                       guided_decoding=GuidedDecodingParams(regex="ab")))
    outputs = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        outputs += engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outputs] == \
        [("r", True, "abort")]


def test_finished_compilations_are_not_kept_beyond_the_cache(llama_dir):
    """Only MAX_CACHED_GRAMMARS compiled grammars stay alive (found in review: the manager kept
    every finished compilation's future, and with it its token index)."""
    import gc
    import weakref

    from nanoinfer.engine.front_end import load_tokenizer
    from nanoinfer.config import Config
    from nanoinfer.structured_output import MAX_CACHED_GRAMMARS, StructuredOutputManager
    manager = StructuredOutputManager(load_tokenizer(Config(llama_dir)), 512, [2])
    futures = [manager.compile(f"a{i}b") for i in range(MAX_CACHED_GRAMMARS + 8)]
    indexes = [weakref.ref(f.result()) for f in futures]
    manager.compile("c")   # (a compilation after them)
    del futures
    manager.evicted.clear()
    gc.collect()
    assert sum(ref() is not None for ref in indexes) <= MAX_CACHED_GRAMMARS
    manager.shutdown()
