"""The Triton kernels against the torch reference backend.

On the CPU they run under the Triton interpreter (conftest sets TRITON_INTERPRET=1) on small
shapes, in float32 and float16 (the interpreter's bfloat16 dot is wrong); on a GPU the `gpu`
tests run them in bfloat16 at real model shapes.
"""
import random

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

from nanoinfer.attention import AttentionMetadata
from nanoinfer.attention.torch_backend import TorchAttentionBackend

PAGE = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_step(query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype, device=DEVICE, seed=0):
    """Random caches and a step of sequences with these query and context lengths, their blocks
    scattered over the cache (and a few blocks shared, as prefix hits would be)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pages = [-(-c // PAGE) for c in context_lens]
    num_blocks = sum(pages) + 8
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(n)] for n in pages]
    if len(tables) > 2 and tables[1] and tables[2]:
        tables[2][0] = tables[1][0]   # one block in two tables, as after a prefix-cache hit
    width = max(pages)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    shape = (num_blocks, PAGE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device), block_tables=block_tables,
        max_seqlen_q=max(query_lens))
    query = torch.randn(cu[-1], num_heads, head_dim, dtype=dtype, device=device)
    return query, k_cache, v_cache, meta


def reference(query, k_cache, v_cache, meta, scale):
    up = lambda t: t.double()   # noqa: E731
    return TorchAttentionBackend.forward(up(query), up(k_cache), up(v_cache), meta, scale)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_store_kv(dtype, group):
    from nanoinfer.kernels.store_kv import store_kv
    num_kv_heads, head_dim, tokens = 2, 32, 21
    k_cache = torch.zeros(6, PAGE, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(tokens, (group + 2) * num_kv_heads * head_dim, dtype=dtype, device=DEVICE)
    _, k, v = qkv.split([group * num_kv_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    k, v = k.view(tokens, num_kv_heads, head_dim), v.view(tokens, num_kv_heads, head_dim)   # strided views
    slots = torch.randperm(6 * PAGE, device=DEVICE)[:tokens]
    slots[3] = slots[10] = -1
    store_kv(k, v, k_cache, v_cache, slots)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    TorchAttentionBackend.store_kv(k, v, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("num_splits, min_split_pages", [(1, 1), (3, 1), (8, 2)])
def test_decode_attention(dtype, group, num_splits, min_split_pages):
    """Split counts where the long contexts use every split and the short ones only some."""
    from nanoinfer.kernels.decode_attention import decode_attention
    context_lens = [1, 17, 100, 33, 64]   # odd lengths, partial last blocks, an exact multiple
    query, k_cache, v_cache, meta = make_step([1] * 5, context_lens, 2 * group, 2, 64, dtype)
    out = decode_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125, num_splits,
                           min_split_pages)
    assert rel_err(out, reference(query, k_cache, v_cache, meta, 0.125)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_prefill_attention(dtype, group):
    from nanoinfer.kernels.prefill_attention import prefill_attention
    # fresh prompts, a chunk after a cached prefix, decodes mixed in, a 1-token prompt
    query_lens, context_lens = [37, 20, 1, 16, 1, 5], [37, 53, 30, 48, 1, 5]
    query, k_cache, v_cache, meta = make_step(query_lens, context_lens, 2 * group, 2, 64, dtype)
    out = prefill_attention(query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                            meta.max_seqlen_q, 0.125)
    assert rel_err(out, reference(query, k_cache, v_cache, meta, 0.125)) < TOL[dtype]


@hypothesis.settings(max_examples=15, deadline=None, database=None, derandomize=True)
@hypothesis.given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 30)), min_size=1, max_size=5),
                  st.integers(0, 3), st.integers(0, 40))
@hypothesis.example(seqs=[(1, 3)] * 66 + [(20, 5)], spare_seqs=2, spare_rows=3)   # 64 and more
def test_prefill_attention_padded_as_in_a_cuda_graph(seqs, spare_seqs, spare_rows):
    """Random query lengths and cached prefixes, with what a CUDA graph adds: spare sequences with
    no queries and no context, and spare query rows after the step's. The step's rows are
    unchanged by them (and every program finds its sequence: block_m is 16 here, so the
    sequences own several programs each)."""
    from nanoinfer.kernels.prefill_attention import prefill_attention
    query_lens, context_lens = [q for q, _ in seqs], [q + p for q, p in seqs]
    query, k_cache, v_cache, meta = make_step(query_lens, context_lens, 4, 2, 32, torch.float32)
    want = reference(query, k_cache, v_cache, meta, 0.125)
    tokens = len(query)
    cu = torch.cat([meta.cu_seqlens_q, meta.cu_seqlens_q[-1:].repeat(spare_seqs)])
    lens = torch.cat([meta.context_lens, meta.context_lens.new_zeros(spare_seqs)])
    tables = torch.cat([meta.block_tables, meta.block_tables.new_zeros(spare_seqs, meta.block_tables.shape[1])])
    padded = torch.cat([query, torch.randn(spare_rows, *query.shape[1:], device=DEVICE)])
    out = prefill_attention(padded, k_cache, v_cache, cu, lens, tables, tokens + spare_rows, 0.125)
    assert rel_err(out[:tokens], want) < TOL[torch.float32]


def test_head_dim_not_a_power_of_two():
    from nanoinfer.kernels.decode_attention import decode_attention
    from nanoinfer.kernels.prefill_attention import prefill_attention
    query, k_cache, v_cache, meta = make_step([9, 1], [20, 7], 4, 2, 48, torch.float32)
    out = prefill_attention(query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                            meta.max_seqlen_q, 0.2)
    assert rel_err(out, reference(query, k_cache, v_cache, meta, 0.2)) < 1e-4
    query, k_cache, v_cache, meta = make_step([1, 1], [20, 7], 4, 2, 48, torch.float32)
    out = decode_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.2, 2)
    assert rel_err(out, reference(query, k_cache, v_cache, meta, 0.2)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    from nanoinfer.kernels.rms_norm import rms_norm
    from nanoinfer.layers.layernorm import RMSNorm
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data.normal_()
    x, residual = torch.randn(7, 96, dtype=dtype), torch.randn(7, 96, dtype=dtype)
    norm = norm.to(dtype)
    if with_residual:
        expected, expected_residual = norm(x, residual.clone())
        out, new_residual = rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-5, residual.to(DEVICE))
        assert torch.allclose(new_residual.cpu(), expected_residual)
    else:
        expected, out = norm(x), rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-5)
    assert rel_err(out.cpu(), expected.double()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim, qk_norm", [(64, False), (32, True), (48, False)])
def test_rotary(dtype, head_dim, qk_norm):
    from nanoinfer.kernels.rotary import rotary_embedding_
    from nanoinfer.layers.layernorm import RMSNorm
    from nanoinfer.layers.rotary_embedding import RotaryEmbedding
    rope = RotaryEmbedding(head_dim, 128, 10000.0)
    norms = (RMSNorm(head_dim, 1e-6).to(dtype), RMSNorm(head_dim, 1e-6).to(dtype)) if qk_norm else ()
    for n in norms:
        n.weight.data.normal_()
    qkv = torch.randn(9, (4 + 2 * 2) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([4 * head_dim, 2 * head_dim, 2 * head_dim], -1)
    q, k = q.view(9, 4, head_dim), k.view(9, 2, head_dim)    # strided views, as in the model
    positions = torch.randint(0, 128, (9,))
    expected_q, expected_k = rope(positions, q.clone(), k.clone(), *norms)
    qkv_dev = qkv.to(DEVICE)
    q_dev, k_dev, _ = qkv_dev.split([4 * head_dim, 2 * head_dim, 2 * head_dim], -1)
    q_dev, k_dev = q_dev.view(9, 4, head_dim), k_dev.view(9, 2, head_dim)
    weights = (norms[0].weight.to(DEVICE), norms[1].weight.to(DEVICE), 1e-6) if qk_norm else ()
    rotary_embedding_(positions.to(DEVICE), q_dev, k_dev, rope.cos_cache.to(DEVICE), rope.sin_cache.to(DEVICE),
                      *weights)
    assert rel_err(q_dev.cpu(), expected_q.double()) < TOL[dtype]
    assert rel_err(k_dev.cpu(), expected_k.double()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul(dtype):
    from nanoinfer.kernels.activation import silu_and_mul
    from nanoinfer.layers.activation import SiluAndMul
    x = torch.randn(5, 2 * 1500, dtype=dtype)
    assert rel_err(silu_and_mul(x.to(DEVICE)).cpu(), SiluAndMul()(x).double()) < TOL[dtype]


def test_gumbel_max_sampling_kernel():
    """Greedy rows are the argmax (the vocabulary split over several programs); a row's draw
    depends on its seed alone; draws follow softmax(logits / T)."""
    from nanoinfer.kernels.sampling import gumbel_max_sample
    logits = torch.randn(6, 3000, device=DEVICE)
    temps = torch.tensor([0, 0.7, 0, 1.0, 0, 2.0], device=DEVICE)
    seeds = torch.arange(6, device=DEVICE) * 1000
    out = gumbel_max_sample(logits, temps, seeds, block=128)
    assert torch.equal(out[::2], logits[::2].argmax(-1))
    moved = gumbel_max_sample(logits.flip(0), temps.flip(0), seeds.flip(0), block=128)
    assert torch.equal(moved.flip(0), out)

    probs = torch.tensor([0.6, 0.3, 0.1, 0.0], device=DEVICE)
    rows = 600   # (the draws are seeded: the same every run; 0.05 is 3 standard deviations)
    draws = gumbel_max_sample(probs.log().expand(rows, 4), torch.full((rows,), 0.5, device=DEVICE),
                              torch.arange(rows, device=DEVICE), block=16)
    expected = probs ** 2 / (probs ** 2).sum()   # temperature 0.5 squares the probabilities
    assert torch.allclose(torch.bincount(draws, minlength=4).float() / rows, expected, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, k, n, block_k", [(1, 256, 64, 128), (5, 300, 40, 128),
                                                 (16, 96, 48, 64)])
def test_gemv(dtype, rows, k, n, block_k):
    """A few rows times a weight, with and without a bias: K and N need not be multiples of the
    tiles, and x may be a view with a row stride of its own."""
    from nanoinfer.kernels.gemv import gemv
    torch.manual_seed(rows)
    x = torch.randn(rows, k + 7, dtype=dtype)[:, 3:k + 3]
    weight, bias = torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype)
    for b in (None, bias):
        out = gemv(x.to(DEVICE), weight.to(DEVICE), None if b is None else b.to(DEVICE), 16, block_k)
        expected = x.double() @ weight.double().T + (0 if b is None else b.double())
        assert out.shape == (rows, n) and rel_err(out.cpu(), expected) < TOL[dtype]
