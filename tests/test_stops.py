"""Stop conditions: EOS (lists too), stop token ids, stop strings, max_tokens, max_model_len,
min_tokens; and incremental detokenization across multi-byte characters."""
import dataclasses

from conftest import copy_model, make_tokenizer, random_prompts
from nanoinfer import LLM, RequestOutputKind, SamplingParams
from nanoinfer.engine.detokenizer import IncrementalDetokenizer

PROMPT = random_prompts([10], seed=11)[0]


def free_run(llm: LLM, n: int = 20):
    """The greedy continuation with nothing stopping it."""
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]


def test_max_tokens_is_length(llama_dir):
    out = free_run(LLM(llama_dir), 7).outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_max_model_len_is_length(llama_dir):
    out = LLM(llama_dir, max_model_len=14).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_stop_token_ids(llama_dir):
    llm = LLM(llama_dir)
    tokens = free_run(llm).outputs[0].token_ids
    stop_at = next(i for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tokens[stop_at]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:stop_at + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", tokens[stop_at])


def test_eos_from_generation_config_list(llama_dir, tmp_path):
    tokens = free_run(LLM(llama_dir)).outputs[0].token_ids
    stop_at = next(i for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    llm = LLM(copy_model(llama_dir, tmp_path / "m", eos_token_id=[2, tokens[stop_at]]))
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:stop_at + 1] and out.finish_reason == "stop" and out.stop_reason is None
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert ignored[0].outputs[0].token_ids == tokens
    # min_tokens: EOS cannot be sampled before that many tokens are out
    late = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, min_tokens=stop_at + 2), use_tqdm=False)
    assert len(late[0].outputs[0].token_ids) >= stop_at + 2


def test_stop_string_cuts_text(llama_dir):
    llm = LLM(llama_dir)
    full = free_run(llm).outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full[:full.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < 20


def test_text_equals_decoded_tokens(llama_dir):
    llm = LLM(llama_dir)
    out = free_run(llm, 30).outputs[0]
    assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)


def test_detokenization_across_multibyte_characters():
    tokenizer = make_tokenizer()
    text = "Héllo wörld! 日本語 🙂 ça va"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)   # some character really is split across tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("The"), SamplingParams())
    for token in ids:
        detok.update([token], finished=False)
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == text


def test_tokens_without_text_do_not_grow_the_window():
    """A long run of skipped special tokens (EOS with ignore_eos) leaves the decoded window short."""
    tokenizer = make_tokenizer()
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("The"), SamplingParams())
    for token in tokenizer.encode(" end") + [eos] * 50 + tokenizer.encode(" ça"):
        detok.update([token], finished=False)
        assert len(detok.token_ids) - detok.prefix_offset < 8
    assert detok.output_text == " end ça"


def stream(llm: LLM, params: SamplingParams) -> list[str]:
    """The texts a DELTA stream returns, step by step, joined up to each step."""
    engine, texts = llm.llm_engine, [""]
    engine.add_request("s", PROMPT, dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
    while engine.has_unfinished_requests():
        texts += [texts[-1] + out.outputs[0].text for out in engine.step()]
    return texts


def test_a_stream_never_shows_text_that_a_stop_string_cuts(llama_dir):
    """While a request runs, text that may be the start of a stop string is held back, also when
    the text so far is shorter than the stop string."""
    llm = LLM(llama_dir)
    text = free_run(llm, 30).outputs[0].text
    for stops in ([text[:k]] + ["q" * n] * bool(n) for k in range(3, 10) for n in (0, 2 * k - 3)):
        params = SamplingParams(temperature=0, max_tokens=30, stop=stops)
        final = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
        texts = stream(llm, params)
        assert texts[-1] == final and all(final.startswith(t) for t in texts)


def test_each_stop_string_is_searched_only_where_new_text_completes_it(llama_dir):
    """A short stop string that appeared while min_tokens held the stops back is not found later
    because a longer stop string widens the search."""
    llm = LLM(llama_dir)
    text = free_run(llm, 30).outputs[0].text
    for min_tokens in range(1, 8):
        params = SamplingParams(temperature=0, max_tokens=30, min_tokens=min_tokens, stop=[text[1:3]])
        alone = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        with_long = llm.generate(PROMPT, dataclasses.replace(params, stop=[text[1:3], "qqqqqqqqqqqq"]),
                                 use_tqdm=False)[0].outputs[0]
        assert (with_long.token_ids, with_long.text) == (alone.token_ids, alone.text)
        assert all(t.startswith(with_long.text[:len(t)]) or with_long.text.startswith(t)
                   for t in stream(llm, dataclasses.replace(params, stop=[text[1:3], "qqqqqqqqqqqq"])))
