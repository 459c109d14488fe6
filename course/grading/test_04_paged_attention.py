"""Assignment 4: paged attention, the reference in torch.

Graded: `TorchAttentionBackend.store_kv` writes each token's K and V at its slot and nothing for
slot -1; `TorchAttentionBackend.forward` equals dense causal softmax attention (an oracle written
here with plain matmuls, in float64) for one prompt, for a chunk after a cached prefix, with
grouped-query heads, and for a batch of sequences whose blocks are scattered over the cache; and
the engine, which runs this backend on the CPU, gives transformers' greedy tokens.
"""
import random

import pytest
import torch
from conftest import hf_greedy, random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoinfer import LLM, SamplingParams
from nanoinfer.attention import AttentionMetadata
from nanoinfer.attention.torch_backend import TorchAttentionBackend

SCALE = 0.3   # not head_dim ** -0.5: forward must use the scale it is given


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The oracle, for one sequence: q [len_q, heads, d] are the last len_q of the len_k tokens
    whose keys and values are k, v [len_k, kv_heads, d]. Query i sits at position
    len_k - len_q + i and sees the keys at positions 0 .. len_k - len_q + i."""
    q, k, v = q.double(), k.double(), v.double()
    len_q, heads, _ = q.shape
    len_k, kv_heads, _ = k.shape
    group = heads // kv_heads
    # query head h uses kv head h // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    query_pos = torch.arange(len_q)[:, None] + (len_k - len_q)
    visible = torch.arange(len_k)[None, :] <= query_pos
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_step(query_lens, context_lens, heads, kv_heads, head_dim, block_size, seed=0):
    """A step of sequences with these query and key counts: each sequence's keys and values
    (dense, for the oracle), and the same keys and values in a paged cache whose blocks are
    shuffled, with garbage in every slot no sequence owns and in the padding of the block
    table."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(pages) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(n)] for n in pages]
    width = max(pages) + 1
    # padding entries point at real blocks (other sequences'): reading them would show
    padded = [t + [rng.randrange(num_blocks) for _ in range(width - len(t))] for t in tables]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    keys, values = [], []
    for table, n in zip(tables, context_lens):
        k = torch.randn(n, kv_heads, head_dim, generator=gen)
        v = torch.randn(n, kv_heads, head_dim, generator=gen)
        for pos in range(n):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        slot_mapping=torch.full((cu[-1],), -1, dtype=torch.int64),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        max_seqlen_q=max(query_lens))
    query = torch.randn(cu[-1], heads, head_dim, generator=gen)
    return query, k_cache, v_cache, meta, keys, values


def check_forward(query_lens, context_lens, heads, kv_heads, head_dim, block_size, seed=0):
    query, k_cache, v_cache, meta, keys, values = paged_step(
        query_lens, context_lens, heads, kv_heads, head_dim, block_size, seed)
    caches = k_cache.clone(), v_cache.clone()
    out = TorchAttentionBackend.forward(query, k_cache, v_cache, meta, SCALE)
    assert out.shape == query.shape and out.dtype == query.dtype
    cu = meta.cu_seqlens_q.tolist()
    for i in range(len(query_lens)):
        expected = dense_attention(query[cu[i]:cu[i + 1]], keys[i], values[i], SCALE)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].double(), expected, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"sequence {i}: {m}")
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1]), \
        "forward must not change the cache"


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.data())
def test_store_kv(data):
    """store_kv writes each token's K and V at its slot, and nothing for slot -1"""
    num_blocks = data.draw(st.integers(1, 6), "num_blocks")
    block_size = data.draw(st.sampled_from([1, 4, 16]), "block_size")
    kv_heads, head_dim = data.draw(st.sampled_from([(1, 8), (2, 16), (4, 4)]), "kv shape")
    num_slots = num_blocks * block_size
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), max_size=min(num_slots, 20),
                               unique=True), "slots")
    skipped = data.draw(st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)))
    slots = [-1 if skip else s for s, skip in zip(slots, skipped)]
    tokens, row = len(slots), kv_heads * head_dim
    # K and V as the model hands them over: strided views into one packed q/k/v projection
    qkv = torch.randn(tokens, 3 * row)
    key = qkv[:, row:2 * row].view(tokens, kv_heads, head_dim)
    value = qkv[:, 2 * row:].view(tokens, kv_heads, head_dim)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), 7.0)
    v_cache = torch.full_like(k_cache, -7.0)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[t]
            expected_v[slot // block_size, slot % block_size] = value[t]
    TorchAttentionBackend.store_kv(key, value, k_cache, v_cache,
                                   torch.tensor(slots, dtype=torch.int64))
    assert torch.equal(k_cache, expected_k), "the key cache differs"
    assert torch.equal(v_cache, expected_v), "the value cache differs"


@pytest.mark.parametrize("length, block_size", [(1, 16), (13, 4), (37, 16), (16, 16)])
def test_one_prompt(length, block_size):
    """One prompt: the output equals dense causal softmax attention"""
    check_forward([length], [length], heads=2, kv_heads=2, head_dim=16, block_size=block_size)


@pytest.mark.parametrize("len_q, len_k", [(1, 1), (1, 29), (5, 21), (16, 48), (3, 3)])
def test_cached_prefix(len_q, len_k):
    """A chunk after a cached prefix: len_q queries over len_k keys, the mask shifted by k - q"""
    check_forward([len_q], [len_k], heads=2, kv_heads=2, head_dim=16, block_size=4)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 1), (6, 2)])
def test_grouped_query_heads(heads, kv_heads):
    """Grouped-query heads: query head h attends with kv head h // (heads / kv_heads)"""
    check_forward([7, 1], [7, 20], heads=heads, kv_heads=kv_heads, head_dim=8, block_size=4)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=5),
       st.sampled_from([(2, 2), (4, 2), (4, 1)]), st.sampled_from([1, 4, 16]),
       st.integers(0, 2**16))
def test_batch_scattered_blocks(seqs, head_shape, block_size, seed):
    """A batch of sequences of different lengths, their blocks scattered over the cache"""
    query_lens = [min(q, k) if k else q for q, k in seqs]
    context_lens = [k if k else q for q, k in seqs]
    heads, kv_heads = head_shape
    check_forward(query_lens, context_lens, heads, kv_heads, head_dim=8, block_size=block_size,
                  seed=seed)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_matches_transformers(family, llama_dir, qwen3_dir):
    """End to end: the engine gives transformers' greedy tokens (Llama; Qwen3, head_dim 32)"""
    model_dir = {"llama": llama_dir, "qwen3": qwen3_dir}[family]
    # a shared prefix (a prefix-cache hit) and a small token budget (prompts in chunks)
    prompts = random_prompts([3, 21, 40], seed=4, prefix=random_prompts([17], seed=5)[0])
    llm = LLM(model_dir, enforce_eager=True, num_kvcache_blocks=32, max_model_len=96,
              max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 10)
