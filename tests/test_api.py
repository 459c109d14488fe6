"""The engine's API contracts: request ids, incremental outputs, aborts, errors inside a step, and
the defects a review found in them (each test here failed before its fix)."""
import math

import pytest
import xxhash

from conftest import VOCAB_SIZE, hf_logits, random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.worker.sampling_inputs import token_seed
from nanoinfer.engine.exceptions import EngineDeadError
from nanoinfer.exceptions import ValidationError
from nanoinfer.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=128)


def drain(engine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_logprobs_are_bounded_by_max_logprobs(llama_dir, llm):
    """logprobs larger than the vocabulary used to pass validation and break the step (and, after
    an abort, the next step too): now it is rejected when added, and the engine runs on."""
    for n, engine_max in ((21, 20), (VOCAB_SIZE + 1, 10**6)):
        with pytest.raises(ValueError, match="logprobs"):
            LLM(llama_dir, max_logprobs=engine_max).generate([5, 6], SamplingParams(logprobs=n), use_tqdm=False)
    with pytest.raises(ValueError, match=f"logprobs={VOCAB_SIZE + 1}"):
        llm.generate([[5, 6], [7, 8]], [GREEDY, SamplingParams(logprobs=VOCAB_SIZE + 1)], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([5, 6], SamplingParams(temperature=0, max_tokens=3, logprobs=20), use_tqdm=False)[0]
    assert all(len(entry) in (20, 21) for entry in out.outputs[0].logprobs)


def test_generate_collects_only_its_own_requests(llm):
    engine = llm.llm_engine
    engine.add_request("other", [9, 10, 11], SamplingParams(temperature=0, max_tokens=1))
    prompts = random_prompts([4, 6], seed=60)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8] and "other" not in [o.request_id for o in outs]
    assert outs[0].outputs[0].token_ids == llm.generate(prompts[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_request_ids_are_unique_among_live_requests(llm):
    engine = llm.llm_engine
    next_id = str(int(llm.next_request_id()) + 1)   # the id generate would take next
    engine.add_request(next_id, [5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    with pytest.raises(ValidationError, match="already in use") as error:
        engine.add_request(next_id, [5, 6], GREEDY)
    assert error.value.parameter == "request_id"
    out = llm.generate([8, 9], GREEDY, use_tqdm=False)[0]
    assert out.request_id != next_id
    assert len(drain(engine)[next_id][-1].outputs[0].token_ids) == 40   # the caller's request was not touched
    for bad in ("", 5, None):
        with pytest.raises(ValueError, match="request_id"):
            engine.add_request(bad, [5], GREEDY)


def test_abort_takes_one_id_or_many(llm):
    engine = llm.llm_engine
    for request_id in "abc":
        engine.add_request(request_id, [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("a")
    engine.abort_request(iter(["b", "c", "never-added"]))
    assert not engine.has_unfinished_requests() or not engine.scheduler.requests
    drain(engine)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_delta_and_cumulative_outputs(llama_dir, async_scheduling):
    """DELTA outputs add up to the final output; CUMULATIVE ones grow to it. Text that may be the
    start of a stop string is held back, so no output ever shows a piece of the stop string."""
    llm = LLM(llama_dir, async_scheduling=async_scheduling)
    prompt = random_prompts([10], seed=61)[0]
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    text, tokens = full[0].outputs[0].text, full[0].outputs[0].token_ids
    # a stop string across a token boundary: its first half is text before its second half is
    ends = [len(llm.get_tokenizer().decode(tokens[:k])) for k in range(1, len(tokens))]
    boundary = next(e for e in ends if e >= len(text) // 2 and text[e - 2:e + 2] not in text[:e - 2])
    stop = text[boundary - 2:boundary + 2]
    params = SamplingParams(temperature=0, max_tokens=30, stop=[stop], logprobs=1)
    final = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    engine = llm.llm_engine
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop], logprobs=1,
                                                       output_kind=kind))
        outs = drain(engine)["r"]
        assert len(outs) > 3 and [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        texts = [o.outputs[0].text for o in outs]
        if kind == RequestOutputKind.DELTA:
            texts = ["".join(texts[:i + 1]) for i in range(len(texts))]
        assert all(final.text.startswith(t) for t in texts) and texts[-1] == final.text   # never a piece of stop
        if kind == RequestOutputKind.DELTA:
            assert sum((o.outputs[0].token_ids for o in outs), []) == final.token_ids
            assert sum(len(o.outputs[0].logprobs) for o in outs) == len(final.token_ids)
        else:
            assert outs[-1].outputs[0].token_ids == final.token_ids
        assert (outs[-1].outputs[0].finish_reason, outs[-1].outputs[0].stop_reason) == ("stop", stop)


def test_include_stop_str_in_output(llm):
    prompt = random_prompts([10], seed=62)[0]
    text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = text[12:15]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=stop,
                                              include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop) + len(stop)] and out.stop_reason == stop


def test_max_tokens_none_runs_to_the_end_of_the_context(llama_dir):
    llm = LLM(llama_dir, max_model_len=40)
    out = llm.generate([5] * 10, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 30 and out[0].outputs[0].finish_reason == "length"


def test_logprob_objects_cumulative_logprob_and_metrics(llm):
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True,
                                                 logprobs=3), use_tqdm=False)[0]
    completion, tokenizer = out.outputs[0], llm.get_tokenizer()
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and sorted(lp.rank for t, lp in entry.items() if t != token)[:3] == [1, 2, 3][
            :len(entry) - 1]
        assert entry[token].decoded_token == tokenizer.decode([token])
    assert math.isclose(completion.cumulative_logprob, sum(e[t].logprob for t, e in
                                                           zip(completion.token_ids, completion.logprobs)))
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert llm.generate([5, 6], GREEDY, use_tqdm=False)[0].outputs[0].cumulative_logprob is None


def test_n_samples_share_the_prompt_blocks(llm):
    """n samples of one prompt are n sequences; admitted in one step, the later ones hit the
    first one's prompt blocks in the prefix cache (its K/V is written before any attention reads
    it), so the prompt is computed once."""
    engine, prompt = llm.llm_engine, random_prompts([40], seed=63)[0]
    engine.add_request("n", prompt, SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=6, ignore_eos=True))
    engine.step()
    tables = [seq.block_table for seq in engine.scheduler.running]
    assert len(tables) == 3 and tables[0][:2] == tables[1][:2] == tables[2][:2]
    outs = drain(engine)["n"]
    assert [c.index for c in outs[-1].outputs] == [0, 1, 2]
    for c in outs[-1].outputs:   # sample i is the request with seed 5 + i
        alone = llm.generate(prompt, SamplingParams(temperature=0.9, seed=5 + c.index, max_tokens=6,
                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert c.token_ids == alone.token_ids
    greedy = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_seeds_are_hashed_stably(llm):
    """hash((seed, index)) gave seed -1 and -2 the same draws and varies across Pythons; the
    per-token seed is now xxhash64 over the two as little-endian int64s."""
    assert token_seed(-1, 0) != token_seed(-2, 0)
    assert token_seed(12345, 7) == xxhash.xxh64_intdigest((12345).to_bytes(8, "little") + bytes([7] + [0] * 7)) \
        & (2**63 - 1)
    outs = [llm.generate([5, 6, 7], SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids for s in (-1, -2, -1)]
    assert outs[0] != outs[1] and outs[0] == outs[2]


def test_logprobs_are_the_raw_models_under_min_tokens(llama_dir, llm):
    """min_tokens used to write -inf into the logits the logprobs were taken from."""
    prompt = random_prompts([12], seed=64)[0]
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, min_tokens=2, stop_token_ids=[first],
                                              logprobs=2), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] != first   # it could not be sampled ...
    raw = hf_logits(llama_dir, prompt).log_softmax(-1)[-1]
    assert out.logprobs[0][first].rank == 1   # ... but its logprob is still the model's
    assert math.isclose(out.logprobs[0][first].logprob, raw[first].item(), abs_tol=1e-4)


def test_a_waiting_prompt_is_hashed_once(llama_dir, monkeypatch):
    """Each block of a prompt is hashed once, when its tokens become known, not on every
    schedule() while it waits."""
    llm = LLM(llama_dir, num_kvcache_blocks=8, max_model_len=128)
    engine = llm.llm_engine
    engine.add_request("long", random_prompts([100], seed=65)[0], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    calls = []
    for name in ("xxh64", "xxh3_128"):
        original = getattr(xxhash, name)
        monkeypatch.setattr(xxhash, name, lambda *a, original=original: calls.append(1) or original(*a))
    engine.add_request("waits", random_prompts([64], seed=66)[0], SamplingParams(max_tokens=2))
    assert len(calls) == 4   # its 4 full blocks
    for _ in range(5):
        engine.step()
    assert engine.scheduler.waiting and len(calls) <= 4 + 2   # the running one may fill a block or two
    engine.abort_request(["long", "waits"])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_error_in_a_step_kills_the_engine_clearly(llama_dir, async_scheduling):
    """An exception inside a step used to leave that step's requests stuck for ever: now the engine
    is dead, and every later call says so instead of looping or running on."""
    llm = LLM(llama_dir, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    execute_model, calls = engine.model_executor.execute_model, []

    def failing(sched):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the GPU fell off the bus")
        return execute_model(sched)
    engine.model_executor.execute_model = failing
    with pytest.raises(RuntimeError, match="fell off the bus"):
        llm.generate(random_prompts([5, 9], seed=67), GREEDY, use_tqdm=False)
    for call in (engine.step, engine.has_unfinished_requests, lambda: engine.add_request("x", [5], GREEDY),
                 lambda: llm.generate([5], GREEDY, use_tqdm=False)):
        with pytest.raises(EngineDeadError, match="fell off the bus"):
            call()
    engine.abort_request("x")   # a no-op, not an error: a finally block may call it


def test_ctrl_c_in_a_step_aborts_everything_and_keeps_the_engine(llama_dir):
    llm = LLM(llama_dir)
    engine, prompts = llm.llm_engine, random_prompts([5, 40], seed=68)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.reset_prefix_cache()
    execute_model, calls = engine.model_executor.execute_model, []

    def interrupted(sched):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return execute_model(sched)
    engine.model_executor.execute_model = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests() and not engine.model_executor.input_batch.rows
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.hash_to_block   # nothing half-computed is cached
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


def test_the_engine_keeps_its_own_copy_of_the_params(llm):
    engine, params = llm.llm_engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("copy", [5, 6, 7], params)
    params.max_tokens, params.stop_token_ids = 2, list(range(512))
    assert len(drain(engine)["copy"][-1].outputs[0].token_ids) == 6


def test_odd_but_valid_seeds_and_temperatures(llm):
    out = llm.generate([5, 6], SamplingParams(n=2, seed=2**63 - 1, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    greedy = llm.generate([5, 6], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tiny = llm.generate([5, 6], SamplingParams(temperature=1e-30, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert tiny[0].outputs[0].token_ids == greedy   # below 1e-5 it is greedy, as in vLLM


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_logprobs_equal_transformers(llama_dir, async_scheduling):
    """Every prompt token's logprob given the ones before (rank and top N too), over prefill chunks,
    for n > 1, and for a prompt whose prefix is cached (it is computed again: no logits otherwise)."""
    llm = LLM(llama_dir, max_model_len=128, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    prompt = random_prompts([45], seed=81)[0]
    llm.generate(prompt, GREEDY, use_tqdm=False)   # its blocks are now cached
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, n=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 45
    ref = hf_logits(llama_dir, prompt).log_softmax(-1)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        top = ref[i - 1].topk(3)
        assert list(entry)[0] == prompt[i] and set(list(entry)[1:]) <= set(top.indices.tolist())
        assert math.isclose(entry[prompt[i]].logprob, ref[i - 1, prompt[i]].item(), abs_tol=1e-4)
        assert entry[prompt[i]].rank == int((ref[i - 1] >= ref[i - 1, prompt[i]]).sum())
        assert [e.rank for t, e in entry.items() if t != prompt[i]] == \
            [r for r, t in enumerate(top.indices.tolist(), 1) if t != prompt[i]]
    delta = llm.llm_engine
    delta.add_request("d", prompt, SamplingParams(max_tokens=3, prompt_logprobs=0,
                                                  output_kind=RequestOutputKind.DELTA))
    given = [o.prompt_logprobs for o in drain(delta)["d"]]
    assert given[0] is not None and given[1:] == [None] * (len(given) - 1)   # once, in the first


def test_logit_bias(llm):
    prompt = random_prompts([10], seed=82)[0]
    greedy = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                 logit_bias={77: 100}), use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [77] * 8
    banned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logit_bias={greedy[0]: -100},
                                                 logprobs=0), use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != greedy[0]
    assert banned.logprobs[0][banned.token_ids[0]].rank == 2   # (logprobs stay the raw model's)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"5": 1.0})


def test_chat_takes_text_parts_and_names_what_it_cannot(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    joined = [{"role": "user", "content": "a\nb"}]
    assert llm.chat(parts, GREEDY, use_tqdm=False)[0].prompt_token_ids == \
        llm.chat(joined, GREEDY, use_tqdm=False)[0].prompt_token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="text only"):
        llm.chat(image, GREEDY, use_tqdm=False)
    for bad in ("a\ud800b", [{"role": "user", "content": "a\udfffb"}]):
        with pytest.raises(ValueError, match="lone surrogate at character 1"):
            llm.generate(bad, GREEDY, use_tqdm=False) if isinstance(bad, str) else llm.chat(bad, GREEDY)


def test_reading_the_core_stats_changes_nothing(llm):
    """A getter that reset counters as it read them would give a second reader other numbers."""
    engine = llm.llm_engine
    engine.add_request("stats", {"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(max_tokens=3))
    engine.step()
    assert engine.engine_core.stats() == engine.engine_core.stats()
    drain(engine)
