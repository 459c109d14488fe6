"""Pipeline parallelism on the CPU: stages of layers in worker processes over gloo.

Greedy tokens equal transformers' for every family, with layer counts the stages do not divide
evenly, at P = 2 and at P = 2 x T = 2; with chunked prefill, prefix caching, preemption, seeded
sampling, logprobs and guided decoding the tokens equal one rank's; two steps are in flight at
once and never share a sequence waiting for its token; nothing is left behind after shutdown.
"""
import pytest

from conftest import hf_greedy, random_prompts, save_model
from nanoinfer import LLM, SamplingParams
from nanoinfer.config import Config
from test_tensor_parallel import assert_all_stopped, engine_run, one_rank_run, shm_entries  # noqa: F401

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def three_layer_dirs(tmp_path_factory) -> dict[str, str]:
    return {family: save_model(family, str(tmp_path_factory.mktemp(family) / "m"), num_hidden_layers=3)
            for family in ("llama", "qwen2", "qwen3")}


def generate(path: str, prompts: list, **kwargs) -> list[list[int]]:
    llm = LLM(path, **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(three_layer_dirs, family):
    """3 layers in 2 stages: 2 and 1 (qwen2: the last stage's LM head is the first's embedding)."""
    path, prompts = three_layer_dirs[family], random_prompts([5, 23, 40], seed=1)
    assert generate(path, prompts, pipeline_parallel_size=2) == [hf_greedy(path, p, 12) for p in prompts]


def test_two_stages_of_two_tensor_parallel_ranks(three_layer_dirs):
    path, prompts = three_layer_dirs["qwen2"], random_prompts([9, 31], seed=2)
    got = generate(path, prompts, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert got == [hf_greedy(path, p, 12) for p in prompts]


def test_engine_features_match_one_rank(model_dirs, one_rank_run):  # noqa: F811
    two_stages = engine_run(model_dirs["llama"], tp=1, pp=2)
    assert [ids for ids, _ in two_stages] == [ids for ids, _ in one_rank_run]
    for (_, logprobs), (_, expected) in zip(two_stages, one_rank_run):
        for step, expected_step in zip(logprobs or [], expected or []):
            assert step.keys() == expected_step.keys()
            assert all(abs(step[t].logprob - expected_step[t].logprob) < 1e-4 for t in step)


def test_steps_in_flight_hold_disjoint_sequences(three_layer_dirs, monkeypatch):
    path, prompts = three_layer_dirs["llama"], random_prompts([3 + 5 * i for i in range(8)], seed=5)
    llm = LLM(path, pipeline_parallel_size=2, max_num_seqs=8)
    try:
        engine = llm.llm_engine
        advance = engine.scheduler.advance

        def checked_advance(seq, num_new, out):
            assert seq.num_output_placeholders == 0, "scheduled while its token is in flight"
            advance(seq, num_new, out)
        monkeypatch.setattr(engine.scheduler, "advance", checked_advance)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, GREEDY)
        depths, outputs = [], {}
        while engine.has_unfinished_requests():
            outputs |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
            depths.append(len(engine.engine_core.in_flight))
    finally:
        monkeypatch.undo()
        llm.shutdown()
    assert max(depths) == 2   # one step per stage
    assert [outputs[str(i)] for i in range(8)] == [hf_greedy(path, p, 12) for p in prompts]


def test_preempted_while_its_token_is_in_flight(three_layer_dirs):
    """A small cache preempts sequences whose token is still in a stage: none is readmitted before
    that token is back (it would be sampled twice)."""
    import random
    path, rnd = three_layer_dirs["llama"], random.Random(1029)
    num = rnd.randint(4, 12)
    prompts = random_prompts([rnd.randint(3, 40) for _ in range(num)], seed=29)
    params = [SamplingParams(temperature=0, max_tokens=rnd.randint(1, 30), ignore_eos=True) for _ in range(num)]
    llm = LLM(path, pipeline_parallel_size=2, num_kvcache_blocks=10, max_model_len=96, max_num_batched_tokens=32,
              max_num_seqs=8)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, s.max_tokens)
                                                         for p, s in zip(prompts, params)]


def test_shutdown_leaves_nothing_behind(three_layer_dirs):
    shm_before = shm_entries()
    llm = LLM(three_layer_dirs["llama"], pipeline_parallel_size=2, tensor_parallel_size=2)
    pids = [w.pid for w in llm.llm_engine.model_executor.workers]
    assert len(pids) == 4
    llm.generate(random_prompts([7]), GREEDY, use_tqdm=False)
    llm.shutdown()
    assert_all_stopped(pids, shm_before)


def test_bad_pipeline_settings(llama_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is more than the model's num_hidden_layers=2"):
        Config(llama_dir, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        Config(llama_dir, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="speculative decoding does not work with pipeline parallelism"):
        Config(llama_dir, pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
