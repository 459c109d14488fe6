"""Bad input is rejected before anything runs, with a message that says what is wrong, and the
engine stays usable. Also: the prompt forms generate() accepts, and chat()."""
import json
import os
import re
import shutil

import pytest

from conftest import random_prompts
from nanoinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=64)


@pytest.mark.parametrize("prompt, message", [
    ("", "empty"),
    ([], "empty"),
    ({"prompt_token_ids": []}, "empty"),
    (list(range(3, 67)), "64 tokens but max_model_len is 64"),
    ([5, 512, 7], "the prompt holds token id 512, outside the vocabulary [0, 512)"),
    ([5, -1], "token id -1, outside"),
    ([5, "x"], "list of integers"),
    (3.5, "must be a str"),
])
def test_bad_prompts_are_rejected_and_engine_still_works(llm, prompt, message):
    good = random_prompts([6], seed=12)[0]
    before = llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError) as e:
        llm.generate([good, prompt], GREEDY, use_tqdm=False)   # the good one is not queued either
    assert message in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=20, max_tokens=5), "min_tokens"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(logprobs=-1), "logprobs"),
    (dict(temperature="0.5"), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop=5), "stop"), (dict(max_tokens=2.5), "max_tokens"), (dict(top_k=True), "top_k"),
    (dict(n=0), "n"), (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty="x"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(seed=2**64), "seed"), (dict(seed="1"), "seed"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(output_kind=7), "output_kind"), (dict(logprobs=1.0), "logprobs"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kwargs)


def test_sampling_params_are_keyword_only():
    with pytest.raises(TypeError):
        SamplingParams(0.5)
    assert SamplingParams(stop="x", stop_token_ids=(3,), top_k=-1).stop == ["x"]


@pytest.mark.parametrize("prompts, sampling_params, message", [
    (123, GREEDY, "prompts must be"), (None, GREEDY, "prompts must be"), ([[5, 6], 3.5], GREEDY, "must be a str"),
    ([5, 6], {"temperature": 0}, "sampling_params must be a SamplingParams"),
    ([5, 6], "greedy", "sampling_params must be a SamplingParams"),
    ([5, 6], SamplingParams(stop_token_ids=[512]), "stop_token_ids holds token id 512, outside the vocabulary"),
    ([5, 6], SamplingParams(logit_bias={512: 1.0}), "logit_bias holds token id 512, outside the vocabulary"),
    ([5, 6], SamplingParams(prompt_logprobs=21), "prompt_logprobs=21 is more than"),
])
def test_bad_generate_arguments_name_what_is_wrong(llm, prompts, sampling_params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, sampling_params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("messages", [[{"content": "hi"}], [{"role": "user"}], ["hi"], [[{"role": "user"}]]])
def test_chat_messages_need_role_and_content(llm, messages):
    with pytest.raises(ValueError, match="must be a dict with 'role' and 'content'"):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_max_model_len_beyond_the_models_context(llama_dir, monkeypatch):
    with pytest.raises(ValueError, match="max_position_embeddings=512.*NANOINFER_ALLOW_LONG_MAX_MODEL_LEN"):
        LLM(llama_dir, max_model_len=1024)
    monkeypatch.setenv("NANOINFER_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert LLM(llama_dir, max_model_len=1024).llm_engine.config.max_model_len == 1024


@pytest.mark.parametrize("settings, message", [
    (dict(max_model_len=0), "max_model_len must be an integer >= 1, got 0"),
    (dict(num_kvcache_blocks=0), "num_kvcache_blocks must be None or an integer >= 1, got 0"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization must be in"),
])
def test_engine_settings_out_of_range_name_themselves(llama_dir, settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(llama_dir, **settings)


def test_impossible_max_model_len_is_rejected_before_the_weights_load(llama_dir, monkeypatch):
    import nanoinfer.worker.model_runner as model_runner
    monkeypatch.setattr(model_runner, "load_model", lambda *a: pytest.fail("the weights were loaded"))
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(llama_dir, num_kvcache_blocks=2, max_model_len=64)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(llama_dir, cpu_kvcache_space_gb=1e-6, max_model_len=64)


def test_sampling_params_count_must_match(llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(random_prompts([3, 4, 5]), [GREEDY, GREEDY], use_tqdm=False)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="cannot load model"):
        LLM(str(tmp_path / "no-such-model"))


def test_malformed_configs(llama_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed config"):
        LLM(str(bad))
    config = json.loads(open(os.path.join(llama_dir, "config.json")).read())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="supports LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(str(bad))
    del config["hidden_size"]
    config["hidden_size"] = "wide"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(str(bad))


def test_missing_and_unexpected_weights(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    for name, change in [("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                         ("unexpected", lambda t: t.update({"model.layers.0.extra.weight": t["model.norm.weight"].clone()}))]:
        folder = tmp_path / name
        shutil.copytree(llama_dir, folder)
        changed = dict(tensors)
        change(changed)
        save_file(changed, str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=name):
            LLM(str(folder))


def test_kv_cache_too_small_for_max_model_len(llama_dir):
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(llama_dir, num_kvcache_blocks=2, max_model_len=64)


def test_prompt_forms_agree(llm):
    tokenizer = llm.get_tokenizer()
    text = "The quick brown fox"
    ids = tokenizer.encode(text)
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}, {"prompt": text}], GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "Hello world"}]
    reply = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert reply.prompt == text and text.endswith("assistant:")
    direct = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode(text, add_special_tokens=False)},
                          GREEDY, use_tqdm=False)[0]
    assert reply.outputs[0].token_ids == direct.outputs[0].token_ids
    assert len(llm.chat([messages, messages], GREEDY, use_tqdm=False)) == 2


def test_unsupported_engine_options(llama_dir):
    with pytest.raises(ValueError, match="load_format"):
        LLM(llama_dir, load_format="pickle")
