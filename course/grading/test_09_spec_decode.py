"""Assignment 9: speculative decoding, n-gram drafts and exact verification.

Graded: `NgramProposer.find` against a brute-force search written here (the longest suffix of at
most max_n tokens found earlier, its earliest place, overlaps allowed, nothing under min_n, at
most k tokens); `accept_drafts` against a Python loop on random batches; and the engine with
n-gram drafts giving exactly the target's tokens, greedy (transformers' own) and seeded at a
temperature above 0, while it accepts drafts.
"""
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import hf_greedy, random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from nanoinfer import LLM, SamplingParams
from nanoinfer.spec_decode.ngram_proposer import NgramProposer
from nanoinfer.spec_decode.rejection_sampler import accept_drafts


def find(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    proposer = NgramProposer(k, min_n, max_n, max_model_len=1000)
    return proposer.find(np.array(tokens, np.int32), k)


def oracle_find(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Try every length from max_n down, every earlier start from the left."""
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        # an earlier match ends before the last token; it may overlap the suffix
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 3), min_size=4, max_size=40),
       min_n=st.integers(1, 4), extra_n=st.integers(0, 3), k=st.integers(1, 6))
def test_find_matches_brute_force(tokens, min_n, extra_n, k):
    """find drafts the tokens after the longest earlier match of the sequence's suffix"""
    max_n = min_n + extra_n
    got = find(tokens, k, min_n, max_n)
    assert isinstance(got, list)
    assert got == oracle_find(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)


def test_find_longest_then_earliest():
    """find prefers the longest match (up to max_n tokens), then the earliest of equals"""
    # "1" occurs first at 0, but "5 1" (at 2-3) is longer.
    assert find([1, 8, 5, 1, 9, 5, 1], 2, 1, 3) == [9, 5]
    # "1" occurs at 2, 5 and 7, each followed by other tokens: the earliest wins.
    assert find([7, 5, 1, 8, 5, 1, 9, 1], 4, 1, 3) == [8, 5, 1, 9]
    # "3 1 2" matches 3 tokens at 5; "1 2" matches 2 tokens at 1 and at 5.
    tokens = [0, 1, 2, 40, 3, 1, 2, 50, 3, 1, 2]
    assert find(tokens, 1, 1, 3) == [50]   # the longest match
    assert find(tokens, 1, 1, 2) == [40]   # no longer than max_n: both are 2, the earliest wins


def test_find_overlapping_match():
    """A match may overlap the suffix it matches (periodic text)"""
    # The suffix "1 2 1" (positions 2-4) occurs at 0-2 only: the 2 tokens after it are "2 1".
    assert find([1, 2, 1, 2, 1], 4, 3, 3) == [2, 1]
    # The suffix "7 7" (positions 1-2) occurs at 0-1 only: one token follows it.
    assert find([7, 7, 7], 5, 2, 2) == [7]


def test_find_no_match():
    """find returns [] when no earlier match has at least min_n tokens"""
    assert find([5, 6], 3, 1, 3) == []                       # nothing earlier to match
    assert find([1, 2, 3, 4, 5, 6], 3, 1, 3) == []           # the last token never occurred
    assert find([1, 2, 3, 4, 2, 3], 3, 3, 3) == []           # "2 3" occurs, "4 2 3" does not
    assert find([1, 2, 3, 4, 2, 3], 3, 2, 3) == [4, 2, 3]    # ... and "2 3" is enough at min_n=2
    assert find([9, 3, 9, 8, 9], 2, 2, 4) == []              # "9" occurs, "8 9" does not


def test_find_respects_k():
    """find drafts at most k tokens, fewer where the sequence ends first"""
    tokens = [4, 5, 6, 7, 8, 9, 10, 4, 5]   # "4 5" occurs at 0-1, 7 tokens follow it
    for k in range(1, 10):
        assert find(tokens, k, 1, 2) == tokens[2:2 + k]


def oracle_accept(sampled: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Each sequence: its samples while they equal its drafts, then one more."""
    out, row = [], 0
    for seq_drafts in drafts:
        rows = sampled[row:row + len(seq_drafts) + 1]
        row += len(seq_drafts) + 1
        emitted = []
        for token, draft in zip(rows, seq_drafts + [None]):
            emitted.append(token)
            if token != draft:
                break
        out.append(emitted)
    return out


def run_accept(sampled: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """accept_drafts on the engine's tensors; each row's tokens before the -1 padding."""
    k = max(map(len, drafts))
    padded = [d + [-1] * (k - len(d)) for d in drafts]
    out = accept_drafts(torch.tensor(sampled, dtype=torch.int64),
                        torch.tensor(padded, dtype=torch.int64).reshape(len(drafts), k),
                        torch.tensor([len(d) for d in drafts], dtype=torch.int64))
    assert out.dtype == torch.int64 and out.shape == (len(drafts), k + 1)
    rows = []
    for row in out.tolist():
        n = row.index(-1) if -1 in row else len(row)
        assert row[n:] == [-1] * (len(row) - n), row   # -1 only after the emitted tokens
        rows.append(row[:n])
    return rows


@st.composite
def verification_batches(draw):
    """Sequences with 0-5 drafts each, and samples that often agree with them (tokens 0-2)."""
    num_seqs = draw(st.integers(1, 6))
    drafts = [draw(st.lists(st.integers(0, 2), max_size=5)) for _ in range(num_seqs)]
    num_rows = sum(len(d) + 1 for d in drafts)
    sampled = draw(st.lists(st.integers(0, 2), min_size=num_rows, max_size=num_rows))
    return sampled, drafts


@settings(max_examples=300, deadline=None, derandomize=True)
@given(batch=verification_batches())
def test_accept_drafts_matches_loop(batch):
    """accept_drafts keeps the samples while they equal the drafts, then one more"""
    sampled, drafts = batch
    assert run_accept(sampled, drafts) == oracle_accept(sampled, drafts), batch


def test_accept_drafts_cases():
    """Each sequence emits 1 to k_i + 1 tokens from its own rows: a rejection, all, none"""
    # rows: seq 0 (drafts 5 6 7) | seq 1 (no drafts) | seq 2 (drafts 8 9) | seq 3 (draft 4)
    sampled = [5, 6, 3, 0] + [11] + [8, 9, 12] + [2, 13]
    drafts = [[5, 6, 7], [], [8, 9], [4]]
    assert run_accept(sampled, drafts) == [
        [5, 6, 3],      # 5 and 6 accepted; the sample at 7's row differs: it is the last token
        [11],           # no drafts: its one sample
        [8, 9, 12],     # all accepted, and the bonus row's sample
        [2]]            # the first draft rejected
    # A step where no sequence has drafts: k = 0, one row each.
    assert run_accept([3, 4, 5], [[], [], []]) == [[3], [4], [5]]


NGRAM = {"method": "ngram", "num_speculative_tokens": 4,
         "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def generate(model_dir: str, prompts, params, spec: dict | None = None):
    llm = LLM(model_dir, speculative_config=spec, max_model_len=256, enforce_eager=True)
    return llm.generate(prompts, params, use_tqdm=False)


def num_accepted(outputs) -> int:
    return sum(o.metrics.spec_decoding.num_accepted_tokens for o in outputs)


def test_end_to_end_greedy(llama_dir):
    """End to end: with n-gram drafts, greedy output is transformers' and drafts are accepted"""
    prompts = [[9, 8, 7, 6] * 10] + random_prompts([5, 30], seed=3)   # the first repeats itself
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = generate(llama_dir, prompts, params, NGRAM)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(llama_dir, prompt, 32)
    assert num_accepted(outputs) > 0


@pytest.fixture(scope="module")
def bigram_dir(llama_dir, tmp_path_factory) -> str:
    """The tiny Llama with its attention and MLP outputs zeroed: each token's successor depends on
    that token alone, so its text soon cycles and n-gram drafts are often right."""
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


def test_end_to_end_seeded(bigram_dir):
    """End to end: a seeded request at temperature > 0 gives the same tokens with drafts"""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    cycle = generate(bigram_dir, [[50]], greedy)[0].outputs[0].token_ids
    prompts = [[50] + cycle, random_prompts([12], seed=5)[0]]
    # A low temperature: the samples follow the cycle often, not always.
    params = [SamplingParams(temperature=0.15, seed=seed, max_tokens=40, ignore_eos=True)
              for seed in (7, 8)]
    want = generate(bigram_dir, prompts, params)
    got = generate(bigram_dir, prompts, params, NGRAM)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert num_accepted(got) > 0
