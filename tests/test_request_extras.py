"""vLLM's request extras on the server, and the errors that name the parameter at fault.

- `prompt_logprobs: N` (vLLM's extra field): a completion choice's `prompt_logprobs` (a chat's:
  the response's) is, per prompt token, None for the first and then {token id (a string key):
  {"logprob", "rank", "decoded_token"}}: the prompt token and the top N. The values are the
  offline API's (`SamplingParams.prompt_logprobs`) and transformers' log-softmax. Not streamed:
  with `stream: true` a positive N is a 400 (vLLM's rule; 0 is accepted).
- `stream_options: {"include_usage": true, "continuous_usage_stats": true}`: every chunk carries
  `usage`, its choice's prompt tokens and its tokens so far (vLLM's running counts), then the
  usage chunk (no choices) with the whole. Without `include_usage`, no usage anywhere (vLLM).
- `stream_options` and `logit_bias` are typed: a bad key or value is a 400 whose `param` names
  the field.
- The engine's validation errors are `ValidationError`s carrying their parameter's name; the
  server's `param` is that name in the request's words, never read off the message.
"""
import re
from collections import defaultdict

import pytest
import torch
from conftest import hf_logits
from hypothesis import given, settings
from hypothesis import strategies as st
from test_openai_compat import BODIES, CHAT, COMPLETIONS, openai_error, post
from test_server import KEY, start_server, stop_server

openai = pytest.importorskip("openai")
import pydantic  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from nanoinfer import LLM, SamplingParams  # noqa: E402
from nanoinfer.entrypoints.errors import api_error  # noqa: E402
from nanoinfer.entrypoints.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from nanoinfer.exceptions import ValidationError  # noqa: E402

PROMPT = "Hello world! The quick brown fox"
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def server(llama_dir):
    proc, url = start_server(llama_dir, "--api-key", KEY)
    yield url
    stop_server(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(llama_dir):
    llm = LLM(llama_dir, max_model_len=512)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


# 1. prompt_logprobs

def check_prompt_logprobs(body: list, offline_entries: list, ids: list[int], n: int, llama_dir,
                          tokenizer) -> None:
    """vLLM's shape, and the values of the offline API and of transformers."""
    assert len(body) == len(ids) and body[0] is None and offline_entries[0] is None
    ref = torch.log_softmax(hf_logits(llama_dir, ids).double(), dim=-1)
    for p in range(1, len(ids)):
        entry = body[p]
        assert all(re.fullmatch("[0-9]+", key) for key in entry)
        assert str(ids[p]) in entry and len(entry) in (n, n + 1)
        assert {int(k) for k in entry} == set(offline_entries[p])
        for key, value in entry.items():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            want = offline_entries[p][int(key)]
            assert value["logprob"] == pytest.approx(want.logprob, abs=1e-5)
            assert value["rank"] == want.rank
            assert value["decoded_token"] == want.decoded_token == tokenizer.decode([int(key)])
            assert value["logprob"] == pytest.approx(ref[p - 1, int(key)].item(), abs=1e-4)
        assert {v["rank"] for v in entry.values()} >= set(range(1, n + 1))


def test_completion_prompt_logprobs(server, offline, tokenizer, llama_dir):
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode("jumps over the lazy dog")]
    body = {"prompt": prompts, "max_tokens": 2, "temperature": 0, "n": 2, "prompt_logprobs": 3}
    response = post(server, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 4
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    for choice in choices:   # (each sample of a prompt: that prompt's)
        ids = prompts[choice["index"] // 2]
        entries = offline.generate(ids, params, use_tqdm=False)[0].prompt_logprobs
        check_prompt_logprobs(choice["prompt_logprobs"], entries, ids, 3, llama_dir, tokenizer)
    plain = post(server, COMPLETIONS, BODIES[COMPLETIONS]).json()["choices"][0]
    assert "prompt_logprobs" in plain and plain["prompt_logprobs"] is None   # (as vLLM)


def test_chat_prompt_logprobs_are_the_responses(server, offline, tokenizer, llama_dir):
    body = {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0}
    response = post(server, CHAT, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert all("prompt_logprobs" not in c for c in answer["choices"])
    prompt = offline.llm_engine.input_processor.chat_prompt(MESSAGES)
    ids = prompt["prompt_token_ids"]
    assert answer["usage"]["prompt_tokens"] == len(ids)
    entries = offline.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0].prompt_logprobs
    check_prompt_logprobs(answer["prompt_logprobs"], entries, ids, 0, llama_dir, tokenizer)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_prompt_logprobs_are_not_streamed(server, client, route):
    body = BODIES[route] | {"stream": True, "prompt_logprobs": 1}
    openai_error(post(server, route, body), 400, "prompt_logprobs")
    openai_error(post(server, route, BODIES[route] | {"prompt_logprobs": -1}), 400,
                 "prompt_logprobs")
    openai_error(post(server, route, BODIES[route] | {"prompt_logprobs": 21}), 400,
                 "prompt_logprobs")   # (more than max_logprobs)
    streamed = post(server, route, body | {"prompt_logprobs": 0})   # (0: accepted, as in vLLM)
    assert streamed.status_code == 200 and "prompt_logprobs" not in streamed.text


# 2. stream_options.continuous_usage_stats

def stream(client, route: str, **kwargs):
    kwargs |= dict(model="tiny", max_tokens=5, temperature=0, stream=True,
                   extra_body={"ignore_eos": True})
    if route == CHAT:
        return client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=0,
                                              **kwargs)
    return client.completions.create(prompt=PROMPT, logprobs=0, **kwargs)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_continuous_usage_in_every_chunk(client, route):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(stream(client, route, n=2, stream_options=options))
    prompt_tokens = chunks[-1].usage.prompt_tokens
    tokens = defaultdict(int)   # per choice, so far
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        lp = choice.logprobs
        tokens[choice.index] += len(lp.content if route == CHAT else lp.tokens)
        assert chunk.usage is not None
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens,
                chunk.usage.total_tokens) == (prompt_tokens, tokens[choice.index],
                                              prompt_tokens + tokens[choice.index])
    assert tokens == {0: 5, 1: 5}
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.total_tokens == prompt_tokens + 10


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_continuous_usage_needs_include_usage(client, route):
    for options in ({"continuous_usage_stats": True},
                    {"include_usage": False, "continuous_usage_stats": True}):
        assert all(chunk.usage is None for chunk in stream(client, route, stream_options=options))
    chunks = list(stream(client, route, stream_options={"include_usage": True}))
    assert all(chunk.usage is None for chunk in chunks[:-1]) and chunks[-1].usage is not None


# 3. Typed stream_options and logit_bias

@pytest.mark.parametrize("options", [{"continuous_usage_stats": "yes"}, {"include_usage": 1},
                                     "include_usage", [True]])
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_bad_stream_options_are_a_400(server, route, options):
    body = BODIES[route] | {"stream": True, "stream_options": options}
    assert "stream_options" in openai_error(post(server, route, body), 400,
                                            "stream_options")["message"]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_a_bad_logit_bias_names_the_field_and_the_key(server, route):
    for bias, key in (({"5": 1, "x7": 2}, "x7"), ({"5": 100.5}, "5")):
        error = openai_error(post(server, route, BODIES[route] | {"logit_bias": bias}), 400,
                             "logit_bias")
        assert error["message"].startswith(f"logit_bias.{key}")


token_keys = st.integers(0, 10**6).map(str) | st.text(max_size=4)
bias_values = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-300, 300)


@settings(max_examples=200, deadline=None)
@given(bias=st.dictionaries(token_keys, bias_values, max_size=4))
def test_logit_bias_is_a_map_of_token_id_strings_to_numbers_in_range(bias):
    """OpenAI's logit_bias: token id (a string key) -> a number in [-100, 100]."""
    good = all(re.fullmatch("[0-9]+", k) and -100 <= v <= 100 for k, v in bias.items())
    for model, route in ((CompletionRequest, COMPLETIONS), (ChatCompletionRequest, CHAT)):
        try:
            request = model.model_validate(BODIES[route] | {"logit_bias": bias})
        except pydantic.ValidationError as e:
            assert not good and {error["loc"][0] for error in e.errors()} == {"logit_bias"}
        else:
            assert good and request.logit_bias == {k: float(v) for k, v in bias.items()}


# 4. Errors that carry their parameter

def test_the_param_is_the_errors_parameter_in_the_requests_words():
    names = {"prompt": "messages", "max_tokens": "max_completion_tokens"}
    error = api_error(ValidationError("the prompt is fine; the stop strings are not",
                                      parameter="stop"), names)
    assert (error.param, str(error)) == ("stop", "the prompt is fine; the stop strings are not")
    error = api_error(ValidationError("SamplingParams.max_tokens must be an integer >= 1, got 0",
                                      parameter="max_tokens"), names)
    assert error.param == "max_completion_tokens"
    assert str(error) == "max_completion_tokens must be an integer >= 1, got 0"
    assert api_error(ValidationError("the prompt is empty", parameter="prompt"),
                     names).param == "messages"
    assert api_error(ValueError("about the prompt, but no parameter"), names).param is None


@pytest.mark.parametrize("kwargs, parameter", [
    (dict(temperature=-1), "temperature"), (dict(max_tokens=0), "max_tokens"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(stop=[""]), "stop"), (dict(seed="1"), "seed")])
def test_sampling_params_errors_carry_the_field(kwargs, parameter):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.parameter == parameter


@pytest.mark.parametrize("prompts, params, parameter", [
    (123, None, "prompt"), ([5, 512], None, "prompt"), ("", None, "prompt"),
    ([[5, 6], 3.5], None, "prompt"), ([5, 6], "greedy", "sampling_params"),
    ([5, 6], [SamplingParams()] * 2, "sampling_params"),
    ([5, 6], SamplingParams(stop_token_ids=[512]), "stop_token_ids"),
    ([5, 6], SamplingParams(logit_bias={512: 1.0}), "logit_bias"),
    ([5, 6], SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
    ([5, 6], SamplingParams(logprobs=21), "logprobs")])
def test_generate_errors_carry_the_parameter(offline, prompts, params, parameter):
    with pytest.raises(ValidationError) as e:
        offline.generate(prompts, params, use_tqdm=False)
    assert e.value.parameter == parameter
    assert not offline.llm_engine.has_unfinished_requests()


def test_a_validation_error_survives_pickling_and_copying():
    """It crosses processes (a pool's worker, an engine core) and copy.copy as any ValueError."""
    import copy
    import pickle
    error = ValidationError("temperature must be >= 0", parameter="temperature")
    for clone in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(clone) is ValidationError
        assert str(clone) == str(error)
        assert clone.parameter == "temperature"


def test_api_error_words_fields_as_the_request_named_them():
    guided = ValidationError("GuidedDecodingParams.choice must be a non-empty list of strings, "
                             "got []", parameter="guided_decoding")
    error = api_error(guided, {"guided_decoding": "guided_choice"})
    assert (error.param, str(error)) == (
        "guided_choice", "guided_choice must be a non-empty list of strings, got []")
    min_tokens = ValidationError("SamplingParams.min_tokens must be an integer in [0, "
                                 "max_tokens=2], got 5", parameter="min_tokens")
    error = api_error(min_tokens, {"max_tokens": "max_completion_tokens"})
    assert (error.param, str(error)) == (
        "min_tokens", "min_tokens must be an integer in [0, max_completion_tokens=2], got 5")


CONSTRAINTS = {"guided_json": {"type": "object"}, "guided_regex": "[ab]+", "guided_choice": ["a", "b"],
               "response_format": {"type": "json_object"}}


@settings(max_examples=40, deadline=None)
@given(st.sets(st.sampled_from(sorted(CONSTRAINTS)), max_size=4), st.booleans(),
       st.sampled_from(["json_object", "json_schema"]))
def test_two_constraints_in_one_request_are_refused_naming_both(names, chat, fmt):
    """One of response_format and vLLM's guided_* fields is a constraint; two are a 400 that names
    each, whichever they are (response_format once overwrote guided_json without a word)."""
    from nanoinfer.entrypoints.errors import APIError
    from nanoinfer.entrypoints.protocol import guided_decoding
    body = {name: CONSTRAINTS[name] for name in names}
    if "response_format" in body and fmt == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}
    request = (ChatCompletionRequest(messages=[], **body) if chat else CompletionRequest(prompt="x", **body))
    if len(names) <= 1:
        guided = guided_decoding(request)
        assert (guided is None) == (not names)
        if names:
            want = {"guided_regex": "regex", "guided_choice": "choice"}.get(*names, "json")
            assert getattr(guided, want) is not None
        return
    with pytest.raises(APIError) as refused:
        guided_decoding(request)
    assert refused.value.status == 400 and refused.value.param in names
    assert all(name in str(refused.value) for name in names), str(refused.value)
