"""Speculative decoding: the output is the target's, token for token (greedy and seeded), and the
rejection rule keeps the target's distribution."""
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import VOCAB_SIZE, random_prompts, write_eagle_head, write_medusa_head
from nanoinfer import LLM, SamplingParams
from nanoinfer.config import SpeculativeConfig
from nanoinfer.sampling_params import RequestOutputKind
from nanoinfer.spec_decode.ngram_proposer import NgramProposer
from nanoinfer.spec_decode.rejection_sampler import accept_drafts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def run(model_dir, prompts, params, spec=None, flat=False, **kwargs):
    """flat: verification steps as one-query rows, as when a CUDA graph runs them (GPU only otherwise)."""
    llm = LLM(model_dir, speculative_config=spec, max_model_len=256, **kwargs)
    llm.llm_engine.model_executor.input_batch.max_flat_rows = 10**9 if flat else 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("config, message", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "method must be"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "more than"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "eagle", "num_speculative_tokens": 2, "model": "/no/such/folder"}, "needs 'model'"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(config)


def test_ngram_lookup():
    def propose(tokens, k=4, min_n=1, max_n=3, max_model_len=100):
        return NgramProposer(k, min_n, max_n, max_model_len).propose(0, tokens)
    assert propose([1, 2, 3, 4, 2, 3], min_n=2) == [4, 2, 3]          # the tokens after "2 3"
    assert propose([1, 2, 3, 4, 2, 3], min_n=3) == []                 # no earlier "4 2 3"
    assert propose([7, 5, 1, 8, 5, 1, 9, 1]) == [8, 5, 1, 9]          # "1": the earliest of equals
    assert propose([7, 5, 1, 8, 5, 1, 9, 5, 1]) == [8, 5, 1, 9]       # "5 1" beats "1"
    assert propose([1, 2, 1, 2, 1]) == [2, 1]                         # "1 2 1" overlaps the suffix
    assert propose([1, 2, 1, 2, 1], max_model_len=7) == [2]           # room for the draft and one more
    proposer, token_ids = NgramProposer(2, 1, 2, 100), [4, 5, 6]
    assert proposer.propose(0, token_ids) == []
    token_ids += [4, 5]   # tokens appended later are seen
    assert proposer.propose(0, token_ids) == [6, 4]
    # Sequences shorter than max_n: no match to grow, and no index past their start.
    assert propose([5], max_n=5) == [] and propose([5, 5], max_n=5) == [5]
    assert propose([5, 6, 7], max_n=5) == []



@pytest.mark.parametrize("flat", [False, True])
def test_greedy_output_unchanged(llama_dir, flat):
    """Mixed lengths, a shared prefix (prefix caching), prompts chunked over steps, and a cache so
    small that sequences are preempted."""
    prompts = random_prompts([5, 40, 3, 90, 17, 64], seed=3, prefix=random_prompts([20], seed=4)[0])
    prompts[1] = [9, 8, 7, 6] * 10   # repeats itself
    settings = dict(max_num_batched_tokens=48, max_num_seqs=6, num_kvcache_blocks=24)
    base, want = run(llama_dir, prompts, GREEDY, **settings)
    llm, got = run(llama_dir, prompts, GREEDY, NGRAM, flat, **settings)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0
    assert stats.num_draft_tokens == sum(o.metrics.spec_decoding.num_draft_tokens for o in got)
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks   # nothing left allocated


@pytest.mark.parametrize("num_layers, bias", [(1, True), (2, False)])
def test_medusa_greedy_output_unchanged(llama_dir, tmp_path, num_layers, bias):
    """Random-weight heads: the mechanism is under test, not the heads' guesses."""
    medusa = {"method": "medusa", "num_speculative_tokens": 3,
              "model": write_medusa_head(str(tmp_path / "medusa"), 64, VOCAB_SIZE, 4, num_layers, bias)}
    prompts = random_prompts([5, 40, 3, 90], seed=6, prefix=random_prompts([20], seed=4)[0])
    settings = dict(max_num_batched_tokens=48, max_num_seqs=4, num_kvcache_blocks=20)
    _, want = run(llama_dir, prompts, GREEDY, **settings)
    llm, got = run(llama_dir, prompts, GREEDY, medusa, **settings)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_steps > 0


@pytest.mark.parametrize("family, fc_bias", [("llama", False), ("qwen3", True)])
def test_eagle_greedy_output_unchanged(model_dirs, tmp_path, family, fc_bias):
    """A random-weight head: its keys and values in the paged cache, k autoregressive passes,
    the lookahead slots, with prefix caching, chunked prompts and preemption."""
    eagle = {"method": "eagle", "num_speculative_tokens": 3,
             "model": write_eagle_head(str(tmp_path / "eagle"), model_dirs[family], fc_bias)}
    prompts = random_prompts([5, 40, 3, 90], seed=6, prefix=random_prompts([20], seed=4)[0])
    settings = dict(max_num_batched_tokens=48, max_num_seqs=4, num_kvcache_blocks=16)
    _, want = run(model_dirs[family], prompts, GREEDY, **settings)
    llm, got = run(model_dirs[family], prompts, GREEDY, eagle, **settings)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and llm.llm_engine.scheduler.num_preemptions > 0
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_bad_medusa_heads(llama_dir, tmp_path):
    path = write_medusa_head(str(tmp_path / "m"), 64, VOCAB_SIZE, 2)
    with pytest.raises(ValueError, match="needs 3 Medusa heads"):
        LLM(llama_dir, speculative_config={"method": "medusa", "num_speculative_tokens": 3, "model": path})
    path = write_medusa_head(str(tmp_path / "w"), 32, VOCAB_SIZE, 3)
    with pytest.raises(ValueError, match="hidden_size=32"):
        LLM(llama_dir, speculative_config={"method": "medusa", "num_speculative_tokens": 3, "model": path})


class OracleProposer:
    """Drafts the known continuation of each prompt, with its last draft made wrong every third
    time: runs of accepted drafts that stops can land in, and rejections, whatever the model."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], k: int = 4):
        self.continuations = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.k, self.calls = k, 0

    def propose(self, seq_id: int, token_ids: list[int]) -> list[int]:
        self.calls += 1
        prompt = max((p for p in self.continuations if tuple(token_ids[:len(p)]) == p), key=len)
        n = len(token_ids) - len(prompt)
        drafts = self.continuations[prompt][n:n + self.k]
        if drafts and self.calls % 3 == 0:
            drafts[-1] = (drafts[-1] + 1) % VOCAB_SIZE
        return drafts

    def remove(self, seq_id: int) -> None:
        pass


def run_with_oracle(model_dir, prompts, params, continuations):
    llm = LLM(model_dir, speculative_config=NGRAM, max_model_len=256)
    llm.llm_engine.scheduler.ngram = OracleProposer(prompts, continuations)
    return llm, llm.generate(prompts, params, use_tqdm=False)


def test_stops_inside_an_accepted_run(llama_dir):
    """A stop id, a stop string or max_tokens on a token followed by more tokens of the same step:
    nothing past it is returned, exactly as without speculation."""
    prompt = random_prompts([12], seed=8)[0]
    _, (ref,) = run(llama_dir, [prompt], GREEDY)
    tokens = ref.outputs[0].token_ids
    # the steps of the speculative run (DELTA outputs), to find tokens inside them
    llm = LLM(llama_dir, speculative_config=NGRAM, max_model_len=256)
    llm.llm_engine.scheduler.ngram = OracleProposer([prompt], [tokens])
    llm.llm_engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                                           output_kind=RequestOutputKind.DELTA))
    runs = []
    while llm.llm_engine.has_unfinished_requests():
        runs += [o.outputs[0].token_ids for o in llm.llm_engine.step() if o.outputs[0].token_ids]
    assert [t for r in runs for t in r] == tokens
    starts = [sum(map(len, runs[:n])) for n in range(len(runs))]
    inside = [s + j for s, r in zip(starts, runs) for j in range(len(r) - 1)]   # i and i + 1 in one step
    firsts = [i for i in inside if i > 0 and tokens[i] not in tokens[:i]][:3]
    assert len(firsts) == 3, runs
    tokenizer = llm.get_tokenizer()
    cases = []
    for i in firsts:
        cases.append(SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop_token_ids=[tokens[i]]))
        cases.append(SamplingParams(temperature=0, max_tokens=i + 1, ignore_eos=True))
        text = tokenizer.decode(tokens[i - 1:i + 1])
        cases.append(SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[text]))
    prompts = [prompt] * len(cases)
    _, want = run(llama_dir, prompts, cases)
    _, got = run_with_oracle(llama_dir, prompts, cases, [tokens] * len(cases))
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                         w.stop_reason)
        assert len(w.token_ids) < 48


def test_seeded_sampling_and_logprobs_unchanged(llama_dir):
    """Each sample row draws with the seed of its output index, so a seeded request gives the same
    tokens and logprobs with and without speculation, also with penalties, top-k/top-p/min-p."""
    prompts = random_prompts([8, 30, 15, 21], seed=5)
    params = [SamplingParams(temperature=0.7, seed=11, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, seed=12, top_k=5, top_p=0.9, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.5, seed=13, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.2,
                             frequency_penalty=0.1, max_tokens=40, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.3, seed=14, min_tokens=30, stop_token_ids=list(range(3, 200)),
                             max_tokens=40)]
    _, want = run(llama_dir, prompts, params)
    llm, got = run_with_oracle(llama_dir, prompts, params, [w.outputs[0].token_ids for w in want])
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        # (k + 1 query rows add up in another order than one: float32 rounding apart)
        for got_lp, want_lp in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
            assert got_lp.keys() == want_lp.keys()
            for t in got_lp:
                assert abs(got_lp[t].rank - want_lp[t].rank) <= 1   # (a rank counts near-ties)
                assert got_lp[t].logprob == pytest.approx(want_lp[t].logprob, abs=1e-4)
    assert got[0].outputs[0].logprobs and got[2].outputs[0].logprobs
    stats = llm.llm_engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.fixture(scope="module")
def bigram_dir(llama_dir, tmp_path_factory) -> str:
    """The tiny Llama with its attention and MLP outputs zeroed: each token's successor depends on
    that token alone, so greedy text soon cycles, and repeats itself as n-gram drafts assume."""
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.data.zero_()
        layer.mlp.down_proj.weight.data.zero_()
    path = str(tmp_path_factory.mktemp("bigram"))
    model.save_pretrained(path)
    for name in os.listdir(llama_dir):
        if name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(os.path.join(llama_dir, name), path)
    return path


def test_ngram_accepts_several_tokens_on_a_repeating_prompt(bigram_dir):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    _, (cycle,) = run(bigram_dir, [[50]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    prompt = [50] + cycle.outputs[0].token_ids   # ends in a few turns of its cycle
    _, (want,) = run(bigram_dir, [prompt], params)
    _, (got,) = run(bigram_dir, [prompt], params, NGRAM)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    stats = got.metrics.spec_decoding
    assert stats.mean_acceptance_length > 2 and 0.5 < stats.acceptance_rate <= 1, stats


@pytest.mark.parametrize("flat", [False, True])
def test_eagle_drafts_follow_the_emitted_tokens(bigram_dir, tmp_path, flat):
    """On the bigram model, an EAGLE head that passes its token's embedding straight through (fc
    takes the embedding half; attention and MLP outputs zero) predicts the token after it, as the
    target does: every draft is right if the passes feed each position the right token."""
    from safetensors.torch import load_file, save_file
    path = write_eagle_head(str(tmp_path / "eagle"), bigram_dir)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    hidden = tensors["fc.weight"].shape[0]
    tensors["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    tensors["layers.0.self_attn.o_proj.weight"].zero_()
    tensors["layers.0.mlp.down_proj.weight"].zero_()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    eagle = {"method": "eagle", "num_speculative_tokens": 3, "model": path}
    prompts = random_prompts([7, 30, 12], seed=2)
    _, want = run(bigram_dir, prompts, GREEDY)
    llm, got = run(bigram_dir, prompts, GREEDY, eagle, flat, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0, stats


def test_accept_drafts():
    # three requests: 2 drafts (first agrees), none, 3 drafts (all agree)
    sampled = torch.tensor([5, 9, 1, 4, 7, 7, 7, 3])
    drafts = torch.tensor([[5, 8, -1], [-1, -1, -1], [7, 7, 7]])
    out = accept_drafts(sampled, drafts, torch.tensor([2, 0, 3]))
    assert out.tolist() == [[5, 9, -1, -1], [4, -1, -1, -1], [7, 7, 7, 3]]


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     generator: torch.Generator) -> list[int]:
    """The rule with draft distributions (spec_decode/rejection_sampler.py), for one sequence.
    target_probs: [k + 1, vocab]; draft_probs: [k, vocab]; draft_token_ids: [k] -> 1 to k + 1 tokens."""
    k = len(draft_token_ids)
    uniform = torch.rand(k, dtype=torch.float64, generator=generator)
    race = torch.empty(target_probs.shape[1]).exponential_(generator=generator)
    out = []
    for j in range(k):
        x = int(draft_token_ids[j])
        p, q = target_probs[j], draft_probs[j]
        if uniform[j] * q[x] < p[x]:   # u < p(x) / q(x), without dividing
            out.append(x)
            continue
        residual = (p - q).clamp(min=0)
        out.append(int((residual / race).argmax()))   # the exponential race draws from norm(residual)
        return out
    out.append(int((target_probs[k] / race).argmax()))
    return out


@pytest.mark.parametrize("case", ["random", "disjoint", "point_mass", "equal"])
def test_rejection_rule_keeps_the_target_distribution(case):
    """Two drafts from q, then the emitted tokens' frequencies against p, position by position
    (a position is reached when the drafts before it were accepted). The bound is 4.5 standard
    errors of a frequency: 0.0225 over all 10,000 draws, while a rule that, say, recovers from p
    instead of max(p - q, 0) is off by 0.1 or more in these cases."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 6, 10_000
    p = torch.softmax(torch.randn(3, vocab, generator=g) * 1.5, -1).double()
    q = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, -1).double()
    if case == "disjoint":
        p[:2] = torch.tensor([0, 0, 0, 0.2, 0.3, 0.5])
        q[:] = torch.tensor([0.6, 0.4, 0, 0, 0, 0])
    elif case == "point_mass":
        q[:] = torch.nn.functional.one_hot(torch.tensor([2, 4]), vocab).double()
    elif case == "equal":
        q[:] = p[:2]
    emitted = []
    for _ in range(n):
        drafts = torch.stack([torch.multinomial(q[j], 1, generator=g)[0] for j in range(2)])
        emitted.append(rejection_sample(p, q, drafts, g))
    for pos in range(3):
        reached = [e[pos] for e in emitted if len(e) > pos]
        if case == "disjoint" and pos > 0:
            assert not reached   # no draft is ever accepted
            continue
        freq = torch.bincount(torch.tensor(reached), minlength=vocab).double() / len(reached)
        assert (freq - p[pos]).abs().max() < 4.5 * (0.25 / len(reached)) ** 0.5, (pos, len(reached), freq, p[pos])
    if case == "equal":
        assert all(len(e) == 3 for e in emitted)   # p == q: every draft is accepted
