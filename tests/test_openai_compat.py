"""OpenAI compatibility of the server, point by point, tested the way vLLM's own server tests
(tests/entrypoints/openai/) test each behaviour, through the official client where it can say it.

Errors have OpenAI's body {"error": {"message", "type", "param", "code"}}: type
"invalid_request_error" for a 400, "not_found_error" for a 404, param naming the field at fault.

/metrics follows vLLM V1 (vllm/v1/metrics/loggers.py, PrometheusStatLogger). Every metric has the
labels model_name (the served name) and engine (the core's index); counters are exposed with a
"_total" suffix, histograms as _bucket/_count/_sum:
  gauges      vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc,
              vllm:engine_sleep_state (+ sleep_state), vllm:cache_config_info (info: a gauge at 1
              labelled with the cache config), vllm:lora_requests_info (labels max_lora,
              waiting_lora_adapters, running_lora_adapters; with LoRA only);
              hidden (deprecated): vllm:gpu_cache_usage_perc
  counters    vllm:prompt_tokens, vllm:generation_tokens, vllm:num_preemptions,
              vllm:request_success (+ finished_reason: stop, length, abort, error, repetition),
              vllm:prefix_cache_queries, vllm:prefix_cache_hits,
              vllm:external_prefix_cache_queries, vllm:external_prefix_cache_hits (KV connector),
              vllm:mm_cache_queries, vllm:mm_cache_hits, vllm:corrupted_requests (NaN checks on);
              speculative decoding: vllm:spec_decode_num_drafts, vllm:spec_decode_num_draft_tokens,
              vllm:spec_decode_num_accepted_tokens, vllm:spec_decode_num_accepted_tokens_per_pos
              (+ position)
  histograms  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
              vllm:request_time_per_output_token_seconds, vllm:e2e_request_latency_seconds,
              vllm:request_queue_time_seconds, vllm:request_inference_time_seconds,
              vllm:request_prefill_time_seconds, vllm:request_decode_time_seconds,
              vllm:iteration_tokens_total (tokens per engine step), vllm:request_prompt_tokens,
              vllm:request_generation_tokens, vllm:request_max_num_generation_tokens,
              vllm:request_params_n, vllm:request_params_max_tokens;
              with --kv-cache-metrics: vllm:kv_block_lifetime_seconds,
              vllm:kv_block_idle_before_evict_seconds, vllm:kv_block_reuse_gap_seconds;
              hidden (deprecated): vllm:time_per_output_token_seconds
"""
import contextlib
import io
import json
import re
import time
from collections import defaultdict

import httpx
import pytest
import torch
from conftest import hf_logits
from test_server import KEY, start_server, stop_server

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from nanoinfer import LLM, SamplingParams  # noqa: E402

HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
MAX_REQUEST_BYTES = 1_000_000
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error"}
ANY = object()
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BODIES = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          COMPLETIONS: {"prompt": "hi", "max_tokens": 2}}
ECHO_PROMPT = "Hello world! The quick brown fox"


def serve_has(flag: str) -> bool:
    """Whether `python -m nanoinfer.serve` takes this flag (with a value)."""
    from nanoinfer.serve import parse_args
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parse_args([flag, "1"])
    except SystemExit:
        return False
    return True


@pytest.fixture(scope="module")
def server(llama_dir):
    limit = ["--max-request-bytes", str(MAX_REQUEST_BYTES)]   # (once serve has the flag)
    proc, url = start_server(llama_dir, "--api-key", KEY,
                             *(limit if serve_has("--max-request-bytes") else []))
    yield url
    stop_server(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def post(url: str, route: str, body) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(url + route, content=content, headers=HEADERS, timeout=60)


def openai_error(response: httpx.Response, status: int, param=ANY) -> dict:
    """Check that the response is OpenAI's error body with this status; return its "error"."""
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= error.keys(), error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str), error
    assert error["type"] == ERROR_TYPES.get(status, error["type"]), error
    if param is not ANY:
        assert error["param"] == param, error
    return error


def assert_still_serves(url: str) -> None:
    ok = post(url, COMPLETIONS, {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def collect(stream, chat: bool = False):
    """A stream's text and finish reasons per choice index, and its usage."""
    texts, finished, usage = defaultdict(str), defaultdict(list), None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
            if c.finish_reason is not None:
                finished[c.index].append(c.finish_reason)
    return dict(texts), dict(finished), usage


def create(client, route: str, **kwargs):
    if route == CHAT:
        return client.chat.completions.create(model="tiny", messages=BODIES[CHAT]["messages"],
                                              **kwargs)
    return client.completions.create(model="tiny", prompt="hi", **kwargs)


# 1. Chat content as a list of parts

def test_chat_content_parts_are_the_parts_joined_by_newlines(client):
    """Text parts are joined by "\\n"; the reply is the plain string's."""
    kwargs = dict(model="tiny", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})

    def reply(system, user):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        out = client.chat.completions.create(messages=messages, **kwargs)
        return out.choices[0].message.content, out.usage.prompt_tokens
    plain = reply("Hello world", "The quick brown fox\njumps over")
    parts = reply([{"type": "text", "text": "Hello world"}],
                  [{"type": "text", "text": "The quick brown fox"},
                   {"type": "text", "text": "jumps over"}])
    assert parts == plain
    assert reply("Hello world", "ça va?")[0] != plain[0]   # (the answer depends on the prompt)


def test_chat_image_part_is_a_400(client):
    content = [{"type": "text", "text": "what is this?"},
               {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", max_tokens=2,
                                       messages=[{"role": "user", "content": content}])
    openai_error(e.value.response, 400, "messages")


# 2. n > 1

def test_n_choices_greedy_streamed_and_not(client):
    kwargs = dict(model="tiny", prompt="Hello world", max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    one = client.completions.create(**kwargs)
    text = one.choices[0].text
    many = client.completions.create(n=3, **kwargs)
    assert [(c.index, c.text, c.finish_reason) for c in many.choices] == \
        [(i, text, "length") for i in range(3)]
    assert many.usage.prompt_tokens == one.usage.prompt_tokens   # counted once
    assert many.usage.completion_tokens == 3 * 8
    texts, finished, usage = collect(client.completions.create(
        n=3, stream=True, stream_options={"include_usage": True}, **kwargs))
    assert texts == {i: text for i in range(3)} and finished == {i: ["length"] for i in range(3)}
    assert usage.prompt_tokens == one.usage.prompt_tokens and usage.completion_tokens == 3 * 8


def test_n_choices_chat(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                  temperature=0, n=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    text = whole.choices[0].message.content
    assert whole.choices[1].message.content == text and whole.usage.completion_tokens == 2 * 6
    texts, finished, _ = collect(client.chat.completions.create(stream=True, **kwargs), chat=True)
    assert texts == {0: text, 1: text} and finished == {0: ["length"], 1: ["length"]}


def test_n_seeded_samples_differ_and_repeat(client):
    kwargs = dict(model="tiny", prompt="Hello world", max_tokens=12, temperature=1, seed=1234, n=3,
                  extra_body={"ignore_eos": True})
    first = [c.text for c in client.completions.create(**kwargs).choices]
    assert len(first) == 3 and len(set(first)) == 3
    assert [c.text for c in client.completions.create(**kwargs).choices] == first


# 3. A list of prompts

@pytest.mark.parametrize("prompts", [["Hello world", "The quick brown fox"],
                                     [[5, 6, 7], [40, 41, 42, 43]]], ids=["strings", "token-ids"])
def test_a_list_of_prompts(client, prompts):
    """One choice per prompt (times n), index = prompt_index * n + j, each the prompt's alone."""
    kwargs = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    texts = [a.choices[0].text for a in alone]
    assert texts[0] != texts[1]
    prompt_tokens = sum(a.usage.prompt_tokens for a in alone)
    batch = client.completions.create(prompt=prompts, **kwargs)
    assert [(c.index, c.text) for c in batch.choices] == list(enumerate(texts))
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (prompt_tokens, 2 * 6)
    batch = client.completions.create(prompt=prompts, n=2, **kwargs)
    assert [(c.index, c.text) for c in batch.choices] == [(i, texts[i // 2]) for i in range(4)]
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (prompt_tokens, 4 * 6)
    streamed, finished, usage = collect(client.completions.create(
        prompt=prompts, n=2, stream=True, stream_options={"include_usage": True}, **kwargs))
    assert streamed == {i: texts[i // 2] for i in range(4)}
    assert finished == {i: ["length"] for i in range(4)}
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 4 * 6)


# 4. logit_bias

def test_logit_bias_100_forces_a_token(client, tokenizer):
    quick = tokenizer.encode(" quick")
    assert len(quick) == 1
    kwargs = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt=[5, 6, 7], **kwargs).choices[0].text
    assert plain != " quick" * 8
    out = client.completions.create(prompt=[5, 6, 7], logit_bias={str(quick[0]): 100}, **kwargs)
    assert out.choices[0].text == " quick" * 8
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                          logit_bias={str(quick[0]): 100}, **kwargs)
    assert chat.choices[0].message.content == " quick" * 8


def test_logit_bias_minus_100_removes_the_greedy_token(client, tokenizer, llama_dir):
    def text(token):
        s = tokenizer.decode([token])
        return s if s and "\ufffd" not in s else None
    for prompt in ([k, k + 1, k + 2] for k in range(3, 380, 5)):
        first, second = hf_logits(llama_dir, prompt)[-1].argsort(descending=True)[:2].tolist()
        if text(first) and text(second) and text(first) != text(second):
            break
    else:
        pytest.fail("no prompt whose two most likely tokens have distinct texts")
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    assert client.completions.create(**kwargs).choices[0].text == text(first)
    out = client.completions.create(logit_bias={str(first): -100}, **kwargs)
    assert out.choices[0].text == text(second)


@pytest.mark.parametrize("bias", [{"abc": 5}, {"99999": 5}, {"512": 5}, {"-1": 5}, {"5": 101},
                                  {"5": -100.5}])
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_bad_logit_bias_is_a_400(server, route, bias):
    """Keys: token ids of the vocabulary (512 here); values: in [-100, 100]."""
    openai_error(post(server, route, BODIES[route] | {"logit_bias": bias}), 400, "logit_bias")


# 5. echo with logprobs

def echo(client, prompt):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                     echo=True, logprobs=1).choices[0]


def test_echo_logprobs_cover_the_prompt(client, tokenizer):
    ids = tokenizer.encode(ECHO_PROMPT)
    for prompt, prompt_text in ((ECHO_PROMPT, ECHO_PROMPT), (ids, tokenizer.decode(ids))):
        choice = echo(client, prompt)
        lp, text = choice.logprobs, choice.text
        assert text.startswith(prompt_text)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.tokens[:len(ids)] == [tokenizer.decode([i]) for i in ids]
        assert "".join(lp.tokens) == text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
        assert all(text[o:o + len(t)] == t for t, o in zip(lp.tokens, lp.text_offset))


def test_echo_logprobs_equal_transformers(client, tokenizer, llama_dir):
    """log_softmax of transformers' float32 logits at i-1, at prompt token i."""
    ids = tokenizer.encode(ECHO_PROMPT)
    lp = echo(client, ECHO_PROMPT).logprobs
    ref = torch.log_softmax(hf_logits(llama_dir, ids).double(), dim=-1)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
    assert lp.token_logprobs[len(ids)] == pytest.approx(ref[-1].max().item(), abs=1e-4)   # (greedy)


def test_echo_logprobs_equal_offline_prompt_logprobs(client, tokenizer, llama_dir):
    ids = tokenizer.encode(ECHO_PROMPT)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    llm = LLM(llama_dir, max_model_len=512)
    try:
        offline = llm.generate(ids, params, use_tqdm=False)[0].prompt_logprobs
    finally:
        llm.shutdown()
    assert len(offline) == len(ids) and offline[0] is None
    want = [offline[i][ids[i]].logprob for i in range(1, len(ids))]
    lp = echo(client, ECHO_PROMPT).logprobs
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)


# 6. /v1/models/{id}

def test_retrieve_a_model(client, server):
    model = client.models.retrieve("tiny")
    assert (model.id, model.object) == ("tiny", "model")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert "nope" in openai_error(e.value.response, 404)["message"]
    openai_error(post(server, COMPLETIONS, BODIES[COMPLETIONS] | {"model": "nope"}), 404, "model")


# 7. stream_options needs stream

@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": None}])
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_stream_options_without_stream_is_a_400(client, route, options):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, route, max_tokens=2, stream_options=options)
    openai_error(e.value.response, 400, "stream_options")


# 8. vLLM's metrics

GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
COUNTERS = ["vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"]   # (+ _total)
PER_REQUEST = ["vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
               "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
               "vllm:request_decode_time_seconds"]
HISTOGRAMS = PER_REQUEST + ["vllm:inter_token_latency_seconds", "vllm:iteration_tokens_total"]


def scrape(url: str) -> dict:
    """{family: (type, its samples labelled model_name="tiny")}"""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {f.name: (f.type, [s for s in f.samples if s.labels.get("model_name") == "tiny"])
            for f in text_string_to_metric_families(text)}


def total(families: dict, family: str, sample: str, **labels) -> float:
    """The sum of a family's samples of this name with these labels (0 where there are none)."""
    _, samples = families.get(family, (None, []))
    return sum(s.value for s in samples if s.name == sample and labels.items() <= s.labels.items())


def settled(url: str) -> dict:
    """A scrape after the last request's counts have landed (two scrapes agree)."""
    families = scrape(url)
    for _ in range(20):
        time.sleep(0.1)
        again = scrape(url)
        if all(total(again, c, c + "_total") == total(families, c, c + "_total") for c in COUNTERS):
            return again
        families = again
    return families


def test_vllm_metrics_count_a_request(server, client):
    before = settled(server)
    out = client.completions.create(model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=7,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 7)

    def grew(family, sample, **labels):
        return total(after, family, sample, **labels) - total(before, family, sample, **labels)
    for _ in range(100):   # (recorded as the engine's outputs arrive: maybe after the answer)
        after = scrape(server)
        if "vllm:request_success" not in after or grew("vllm:request_success",
                                                        "vllm:request_success_total") >= 1:
            break
        time.sleep(0.1)
    kinds = [(g, "gauge") for g in GAUGES] + [(c, "counter") for c in COUNTERS] + \
        [(h, "histogram") for h in HISTOGRAMS]
    for name, kind in kinds:
        assert name in after, f"{name} is not exported"
        assert after[name][0] == kind, f"{name} is a {after[name][0]}, not a {kind}"
        assert after[name][1], f'{name} has no sample with model_name="tiny"'
    assert grew("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 5
    assert grew("vllm:generation_tokens", "vllm:generation_tokens_total") == 7
    assert grew("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 1
    assert grew("vllm:request_success", "vllm:request_success_total") == 1   # (no other reason)
    for name in PER_REQUEST:
        assert grew(name, name + "_count") == 1, name
    e2e, ttft = "vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds"
    assert grew(e2e, e2e + "_sum") >= grew(ttft, ttft + "_sum") > 0
    itl = "vllm:inter_token_latency_seconds"
    assert 1 <= grew(itl, itl + "_count") <= 6   # (vLLM: one per token after the first)
    assert grew("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") >= 1
    steps = "vllm:iteration_tokens_total"
    assert grew(steps, steps + "_sum") >= 5 + 6   # (the prompt, then at least a token a step)


def test_vllm_gauges_follow_a_running_request(server):
    """Running and KV-cache usage are up while a request streams, back to 0 after."""
    body = {"prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + COMPLETIONS, json=body, headers=HEADERS,
                      timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        during = scrape(server)
        for _ in lines:
            pass
    assert total(during, "vllm:num_requests_running", "vllm:num_requests_running") == 1
    assert 0 < total(during, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") <= 1
    for _ in range(50):
        after = scrape(server)
        if total(after, "vllm:num_requests_running", "vllm:num_requests_running") == 0:
            break
        time.sleep(0.1)
    for name in GAUGES:
        assert total(after, name, name) == 0, name


# 9. Fields: refused where honouring them would change the answer, else honoured or ignored

@pytest.mark.parametrize("route, fields, param", [
    (CHAT, {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}]}, "tools"),
    (COMPLETIONS, {"suffix": " the end"}, "suffix"),
    (COMPLETIONS, {"best_of": 3}, "best_of"),
    (COMPLETIONS, {"best_of": 3, "n": 2}, "best_of"),
    (COMPLETIONS, {"extra_body": {"guided_grammar": 'root ::= "a"'}}, "guided_grammar"),
    (CHAT, {"extra_body": {"guided_grammar": 'root ::= "a"'}}, "guided_grammar"),
    (COMPLETIONS, {"extra_body": {"allowed_token_ids": [5, 6]}}, "allowed_token_ids"),
], ids=["tools", "suffix", "best_of", "best_of>n", "guided_grammar", "guided_grammar-chat",
        "allowed_token_ids"])
def test_fields_that_would_change_the_answer_are_refused(client, route, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, route, max_tokens=2, **fields)
    openai_error(e.value.response, 400, param)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_unknown_fields_are_accepted(client, route):
    out = create(client, route, max_tokens=3, extra_body={"some_new_field": 1, "ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_best_of_equal_to_n_is_accepted(client):
    out = create(client, COMPLETIONS, max_tokens=3, best_of=1, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_guided_choice_and_regex_are_honoured(client):
    for seed in range(3):
        kwargs = dict(model="tiny", prompt="Answer:", max_tokens=10, temperature=1, seed=seed)
        plain = client.completions.create(**kwargs).choices[0].text
        assert plain not in ("yes", "no") and not re.fullmatch("[a-c]{3}", plain)   # (unguided)
        out = client.completions.create(extra_body={"guided_choice": ["yes", "no"]}, **kwargs)
        assert out.choices[0].text in ("yes", "no")
        out = client.completions.create(extra_body={"guided_regex": "[a-c]{3}"}, **kwargs)
        assert re.fullmatch("[a-c]{3}", out.choices[0].text), out.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "?"}],
                                          max_tokens=10,
                                          extra_body={"guided_choice": ["yes", "no"]})
    assert chat.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("field, value", [("stream", "yes"), ("seed", "5")])
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_types_are_strict(server, route, field, value):
    openai_error(post(server, route, BODIES[route] | {field: value}), 400, field)


# 10. Error bodies

def test_too_many_logprobs_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, logprobs=True, top_logprobs=10000)
    error = openai_error(e.value.response, 400, "top_logprobs")
    assert "top_logprobs" in error["message"] and "SamplingParams" not in error["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=10000)
    error = openai_error(e.value.response, 400, "logprobs")
    assert "logprobs" in error["message"] and "SamplingParams" not in error["message"]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_a_negative_temperature_names_the_field(client, route):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, route, max_tokens=2, temperature=-1)
    openai_error(e.value.response, 400, "temperature")


@pytest.mark.parametrize("route, raw", [
    (COMPLETIONS, '{"prompt": "ab\\ud800cd", "max_tokens": 2}'),
    (CHAT, '{"messages": [{"role": "user", "content": "ab\\ud800"}], "max_tokens": 2}'),
])
def test_a_lone_surrogate_is_a_400(server, route, raw):
    openai_error(post(server, route, raw), 400)
    assert_still_serves(server)


def test_an_oversized_body_is_refused(server):
    assert serve_has("--max-request-bytes"), "python -m nanoinfer.serve has no --max-request-bytes"
    response = post(server, COMPLETIONS, {"prompt": "hello " * (2_000_000 // 6), "max_tokens": 2})
    assert response.status_code in (413, 400), response.text[:300]
    error = openai_error(response, response.status_code)
    assert error["param"] != "prompt"   # refused for its size, not tokenized and found too long
    padded = BODIES[CHAT] | {"padding": "x" * 2_000_000}
    response = post(server, CHAT, padded)
    assert response.status_code in (413, 400), response.text[:300]
    openai_error(response, response.status_code)
    under = post(server, COMPLETIONS, BODIES[COMPLETIONS] | {"padding": "x" * 900_000})
    assert under.status_code == 200, under.text[:300]
    assert_still_serves(server)


# 11. SIGTERM with a stream in flight: tests/test_server.py, test_a_signal_stops_everything_the_server_started


# Found in review

@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_prompt_among_several_is_a_400_and_aborts_the_others(server, stream):
    body = {"model": "tiny", "prompt": [[5, 6, 7], [5, 9999]], "max_tokens": 50, "ignore_eos": True,
            "stream": stream}
    openai_error(post(server, COMPLETIONS, body), 400, "prompt")
    for _ in range(50):
        if total(scrape(server), "vllm:num_requests_running", "vllm:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert total(scrape(server), "vllm:num_requests_running", "vllm:num_requests_running") == 0
    assert_still_serves(server)


def test_streamed_echo_gives_every_choice_the_prompts_logprobs(client, tokenizer):
    ids = tokenizer.encode(ECHO_PROMPT)
    kwargs = dict(model="tiny", prompt=ECHO_PROMPT, max_tokens=3, temperature=0, echo=True,
                  logprobs=1, n=2, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs)
    streamed = defaultdict(list)
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index].append(c.logprobs)
    for i in (0, 1):
        tokens = [t for lp in streamed[i] for t in lp.tokens]
        offsets = [o for lp in streamed[i] for o in lp.text_offset]
        assert len(tokens) == len(ids) + 3 and tokens == plain.choices[i].logprobs.tokens
        assert offsets == plain.choices[i].logprobs.text_offset   # (the same, streamed or not)


def test_text_offsets_are_the_same_streamed_or_not(client):
    kwargs = dict(model="tiny", prompt="Héllo 🙂 wörld", max_tokens=4, temperature=0, echo=True,
                  logprobs=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].logprobs.text_offset
    streamed = [o for chunk in client.completions.create(stream=True, **kwargs)
                for c in chunk.choices for o in c.logprobs.text_offset]
    assert streamed == plain and plain == sorted(plain)


@pytest.mark.parametrize("route, fields, param", [
    (COMPLETIONS, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (COMPLETIONS, {"guided_regex": "("}, "guided_regex"),
    (COMPLETIONS, {"guided_choice": []}, "guided_choice"),
    (COMPLETIONS, {"prompt": [5, 99999]}, "prompt"),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages")])
def test_more_fields_named_at_fault(server, route, fields, param):
    openai_error(post(server, route, BODIES[route] | fields), 400, param)


def test_a_message_without_content_is_empty_text(client):
    out = client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
        {"role": "user", "content": "again"}])
    assert out.usage.completion_tokens >= 1


def test_a_chunked_body_over_the_limit_is_a_413(server):
    assert serve_has("--max-request-bytes")

    def chunks():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100_000
        yield b'", "max_tokens": 2}'
    response = httpx.post(server + COMPLETIONS, content=chunks(), headers=HEADERS, timeout=60)
    openai_error(response, 413)
    assert_still_serves(server)
