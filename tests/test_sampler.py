"""The sampler: greedy is argmax, the top-k / top-p / min-p masks, seeded reproducibility."""
import math

import pytest
import torch

from conftest import random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.layers.sampler import Sampler, SamplingMetadata, apply_top_k_top_p_min_p

NEG_INF = float("-inf")


def metadata(rows, temperature=1.0, top_k=None, top_p=None, min_p=None, seeds=None, logprobs=None):
    return SamplingMetadata(
        temperatures=torch.full((rows,), temperature), top_ks=top_k, top_ps=top_p, min_ps=min_p,
        seeds=torch.arange(rows) if seeds is None else torch.tensor(seeds), all_greedy=temperature == 0,
        max_num_logprobs=logprobs)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    out = Sampler()(logits, metadata(5, temperature=0))
    assert torch.equal(out.sampled_token_ids[:, 0], logits.argmax(-1))


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 5.0, 3.0, 4.0, 2.0]])
    masked = apply_top_k_top_p_min_p(logits, torch.tensor([2, 0]), None, None)
    assert masked[0].tolist() == [NEG_INF, 5.0, NEG_INF, 4.0, NEG_INF]
    assert torch.equal(masked[1], logits[1])   # 0 = off


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    masked = apply_top_k_top_p_min_p(logits, None, torch.tensor([0.7]), None)
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]   # 0.5 + 0.3 >= 0.7
    masked = apply_top_k_top_p_min_p(logits, None, torch.tensor([0.1]), None)
    assert torch.isfinite(masked).tolist() == [[True, False, False, False]]  # the top token always stays


def test_min_p_drops_tokens_below_fraction_of_top():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    masked = apply_top_k_top_p_min_p(logits, None, None, torch.tensor([0.5]))   # threshold 0.25
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = probs.log().expand(20000, 4).contiguous()
    counts = torch.bincount(Sampler()(logits, metadata(20000)).sampled_token_ids[:, 0], minlength=4).float() / 20000
    assert torch.allclose(counts, probs, atol=0.02)


def test_a_row_draw_depends_on_its_seed_alone():
    logits = torch.randn(3, 100)
    a = Sampler()(logits, metadata(3, seeds=[1, 7, 2])).sampled_token_ids[:, 0]
    b = Sampler()(torch.cat([torch.randn(2, 100), logits[1:2]]), metadata(3, seeds=[5, 6, 7])).sampled_token_ids[:, 0]
    assert a[1] == b[2]
    draws = {Sampler()(logits[:1], metadata(1, seeds=[seed])).sampled_token_ids[:, 0].item() for seed in range(20)}
    assert len(draws) > 1   # other seeds, other draws


def test_logprobs_are_of_raw_logits():
    logits = torch.randn(2, 30)
    out = Sampler()(logits, metadata(2, temperature=0, logprobs=3))
    expected = logits.log_softmax(-1)
    assert torch.equal(out.logprob_token_ids[:, 0], logits.argmax(-1))
    assert torch.allclose(out.logprobs, expected.gather(1, out.logprob_token_ids))
    assert torch.equal(out.logprob_token_ids[:, 1:], expected.topk(3).indices)


@pytest.mark.parametrize("params", [dict(temperature=0.8, seed=123), dict(temperature=1.5, top_k=20, top_p=0.9,
                                                                          min_p=0.05, seed=9)])
def test_same_seed_same_output_whatever_else_runs(llama_dir, params):
    llm = LLM(llama_dir)
    prompts = random_prompts([9, 21, 14], seed=6)
    sp = SamplingParams(max_tokens=10, ignore_eos=True, **params)
    alone = llm.generate(prompts[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True)] * 2
    batched = llm.generate(prompts, [sp] + others, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched
    other_seed = SamplingParams(max_tokens=10, ignore_eos=True, **{**params, "seed": params["seed"] + 1})
    assert llm.generate(prompts[0], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_1_is_greedy(llama_dir):
    llm = LLM(llama_dir)
    prompts = random_prompts([5, 30], seed=7)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_engine_logprobs_match_transformers(llama_dir):
    from conftest import hf_logits
    llm = LLM(llama_dir)
    prompt = random_prompts([12], seed=8)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    reference = hf_logits(llama_dir, prompt + out.token_ids).log_softmax(-1)
    assert len(out.logprobs) == 4
    for i, (token, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert token in lps and len(lps) in (2, 3)
        for t, lp in lps.items():
            assert math.isclose(lp.logprob, row[t].item(), abs_tol=1e-4)
            assert lp.rank == int((row >= row[t]).sum())


def test_repetition_penalty_matches_transformers(llama_dir):
    from conftest import hf_greedy
    prompts = random_prompts([6, 20], seed=70)
    for penalty in (1.6, 0.7):
        ours = LLM(llama_dir).generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                               repetition_penalty=penalty), use_tqdm=False)
        for prompt, out in zip(prompts, ours):
            assert out.outputs[0].token_ids == hf_greedy(llama_dir, prompt, 12, repetition_penalty=penalty)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_frequency_and_presence_penalties(llama_dir, async_scheduling):
    """Greedy with penalties against a step-by-step reference on transformers' logits: each
    token's logit minus frequency x its count in the output, minus presence if it is there."""
    from conftest import hf_logits
    prompt = random_prompts([6, 20], seed=70)[1]   # greedy repeats itself after 5 tokens
    llm = LLM(llama_dir, async_scheduling=async_scheduling)
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for frequency, presence in ((1.5, 0.0), (0.0, 2.0), (-2.0, 0.5)):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=presence,
                                                  frequency_penalty=frequency), use_tqdm=False)[0].outputs[0]
        expected = []
        for _ in range(10):
            logits = hf_logits(llama_dir, prompt + expected)[-1]
            counts = torch.bincount(torch.tensor(expected, dtype=torch.long), minlength=logits.shape[0]).float()
            expected.append(int((logits - frequency * counts - presence * (counts > 0)).argmax()))
        assert out.token_ids == expected != plain[0].outputs[0].token_ids
