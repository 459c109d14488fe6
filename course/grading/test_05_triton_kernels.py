"""Assignment 5: the KV store and split-KV decode kernels in Triton.

Graded, each kernel on its own, through the given launchers `store_kv` and `decode_attention`:
`store_kv_kernel` against a loop that writes each token's row; `decode_attention_kernel`'s
partial outputs and log-sum-exps (captured before the reduce runs) against an oracle written
here in float64, for one split, for several (some past a context's end), and for query groups
and head sizes that are not powers of two; `decode_reduce_kernel` fed by a torch stand-in for the
first kernel, for the combination and for padding rows; and both kernels together in float16.
On the CPU the kernels run under the Triton interpreter (the grading conftest sets
TRITON_INTERPRET=1), so the shapes are tiny. The GPU criteria (`check 5 --gpu`) run them in
bfloat16 at 8 sequences of 8192 tokens: correct, and at least 80% of the original kernel's
bandwidth.
"""
import importlib.util
import math
import os
import random
import statistics

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nanoinfer.kernels import decode_attention as decode_module
from nanoinfer.kernels.decode_attention import decode_attention
from nanoinfer.kernels.store_kv import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16
SCALE = 0.3
LOG2E = math.log2(math.e)


# ---- a decode step, and the oracle --------------------------------------------------------

def make_step(context_lens, heads, kv_heads, head_dim, dtype=torch.float32, seed=0):
    """One query token per sequence, and a paged cache of random keys and values whose blocks
    are shuffled; the padding entries of each block-table row point at other sequences' blocks.
    The query is a strided view, as the model hands it over (a slice of the q/k/v projection)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in context_lens]
    num_blocks = sum(pages) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(n)] for n in pages]
    width = max(pages) + 1
    padded = [t + [rng.randrange(num_blocks) for _ in range(width - len(t))] for t in tables]
    shape = (num_blocks, PAGE, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    qkv = torch.randn(len(context_lens), (heads + 2 * kv_heads) * head_dim, generator=gen)
    query = qkv.to(DEVICE, dtype)[:, :heads * head_dim].view(-1, heads, head_dim)
    block_tables = torch.tensor(padded, dtype=torch.int32, device=DEVICE)
    context_lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return query, k_cache, v_cache, block_tables, context_lens


def split_bounds(context_len, split, num_splits, min_split_pages):
    """What the given `split_range` computes: the keys [start, end) of a split, and how many
    splits the sequence uses."""
    num_pages = -(-context_len // PAGE)
    split_pages = max(-(-num_pages // num_splits), min_split_pages)
    start = split * split_pages * PAGE
    return start, min(start + split_pages * PAGE, context_len), -(-num_pages // split_pages)


def keys_and_values(k_cache, v_cache, table, start, end):
    """Positions start .. end-1 of one sequence, read through its block table, in float64."""
    slots = [(table[p // PAGE], p % PAGE) for p in range(start, end)]
    k = torch.stack([k_cache[b, r] for b, r in slots]).double()
    v = torch.stack([v_cache[b, r] for b, r in slots]).double()
    return k, v


def attend(q, k, v, scale):
    """q [heads, d] over k, v [n, kv_heads, d]: the output [heads, d] and the base-2 log of the
    softmax's denominator, log2(sum 2^s) with s = scale * log2(e) * q.k, per head."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("hd,nhd->hn", q.double(), k) * scale * LOG2E
    lse = torch.logsumexp(s / LOG2E, dim=-1) * LOG2E
    return torch.einsum("hn,nhd->hd", (s - lse[:, None]).exp2(), v), lse


def split_oracle(query, k_cache, v_cache, block_tables, context_lens, scale, num_splits,
                 min_split_pages):
    """The partial outputs [seqs, heads, splits, d] and log-sum-exps [seqs, heads, splits] of
    every split a sequence uses, NaN in the rows of the splits it does not use."""
    seqs, heads, head_dim = query.shape
    partial = torch.full((seqs, heads, num_splits, head_dim), float("nan"),
                         dtype=torch.float64, device=query.device)
    lse = torch.full((seqs, heads, num_splits), float("nan"), dtype=torch.float64,
                     device=query.device)
    for i, (table, context_len) in enumerate(zip(block_tables.tolist(), context_lens.tolist())):
        used = split_bounds(context_len, 0, num_splits, min_split_pages)[2]
        for split in range(used):
            start, end, _ = split_bounds(context_len, split, num_splits, min_split_pages)
            k, v = keys_and_values(k_cache, v_cache, table, start, end)
            partial[i, :, split], lse[i, :, split] = attend(query[i], k, v, scale)
    return partial, lse


def dense_oracle(query, k_cache, v_cache, block_tables, context_lens, scale):
    """Each sequence's one query over all its keys, in float64; zeros for a context of 0."""
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    for i, (table, context_len) in enumerate(zip(block_tables.tolist(), context_lens.tolist())):
        if context_len:
            k, v = keys_and_values(k_cache, v_cache, table, 0, context_len)
            out[i] = attend(query[i], k, v, scale)[0]
    return out


# ---- the two halves of decode_attention, one at a time ----------------------------------

class CaptureReduce:
    """Stands in for decode_reduce_kernel: keeps the partial and lse buffers it is handed."""

    def __getitem__(self, grid):
        def launch(partial, lse, *args, **kwargs):
            self.partial, self.lse = partial, lse
        return launch


def split_kernel_outputs(step, num_splits, min_split_pages):
    """Run the student's decode_attention_kernel through the given launcher; its buffers."""
    capture = CaptureReduce()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_module, "decode_reduce_kernel", capture)
        decode_attention(*step, SCALE, num_splits, min_split_pages)
    return capture.partial, capture.lse


def check_splits(step, num_splits, min_split_pages):
    """The kernel's partial output and lse of every split each sequence uses, against the
    oracle (the rows of the other splits are not looked at)."""
    partial, lse = split_kernel_outputs(step, num_splits, min_split_pages)
    seqs, heads, head_dim = step[0].shape
    assert partial.shape == (seqs, heads, num_splits, head_dim) and lse.shape == partial.shape[:3]
    expected_partial, expected_lse = split_oracle(*step, SCALE, num_splits, min_split_pages)
    for i, context_len in enumerate(step[4].tolist()):
        for split in range(split_bounds(context_len, 0, num_splits, min_split_pages)[2]):
            where = f"sequence {i} (context {context_len}), split {split}"
            torch.testing.assert_close(partial[i, :, split].double(), expected_partial[i, :, split],
                                       rtol=1e-4, atol=1e-5, msg=lambda m: f"{where}, partial: {m}")
            torch.testing.assert_close(lse[i, :, split].double(), expected_lse[i, :, split],
                                       rtol=1e-5, atol=1e-4, msg=lambda m: f"{where}, lse: {m}")


class OracleSplitKernel:
    """Stands in for decode_attention_kernel: fills the partial and lse buffers from the oracle
    (in the layout the assignment states), NaN in the rows of unused splits."""

    def __getitem__(self, grid):
        def launch(query, k_cache, v_cache, block_tables, context_lens, partial, lse, scale_log2,
                   q_stride, bt_stride, num_splits, min_split_pages, **constants):
            expected = split_oracle(query, k_cache, v_cache, block_tables, context_lens,
                                    scale_log2 / LOG2E, num_splits, min_split_pages)
            partial.copy_(expected[0])
            lse.copy_(expected[1])
        return launch


def reduce_output(step, num_splits, min_split_pages):
    """decode_attention with the oracle's splits, and the student's decode_reduce_kernel."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_module, "decode_attention_kernel", OracleSplitKernel())
        return decode_attention(*step, SCALE, num_splits, min_split_pages)


# ---- the criteria -------------------------------------------------------------------------

@settings(max_examples=10, deadline=None, derandomize=True)
@given(st.sampled_from([torch.float32, torch.float16]),
       st.sampled_from([(1, 16), (2, 12), (4, 8)]), st.integers(1, 3), st.data())
def test_store_kv_kernel(dtype, kv_shape, num_blocks, data):
    """The store kernel writes each token's K and V row at its slot, and skips slot -1"""
    (kv_heads, head_dim), num_slots = kv_shape, num_blocks * PAGE
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), min_size=1, max_size=12,
                               unique=True), "slots")
    skipped = data.draw(st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)))
    slots = torch.tensor([-1 if skip else s for s, skip in zip(slots, skipped)])
    tokens, row = len(slots), kv_heads * head_dim
    gen = torch.Generator().manual_seed(tokens)
    # K and V as the model hands them over: strided views into one packed q/k/v projection
    qkv = torch.randn(tokens, 4 * row, generator=gen).to(DEVICE, dtype)
    key = qkv[:, 2 * row:3 * row].view(tokens, kv_heads, head_dim)
    value = qkv[:, 3 * row:].view(tokens, kv_heads, head_dim)
    k_cache = torch.full((num_blocks, PAGE, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, -7.0)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // PAGE, slot % PAGE] = key[t]
            expected_v[slot // PAGE, slot % PAGE] = value[t]
    store_kv(key, value, k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(k_cache, expected_k), "the key cache differs"
    assert torch.equal(v_cache, expected_v), "the value cache differs"


def test_decode_one_split():
    """One split: the decode kernel's partial output and log-sum-exp (base 2) for each head"""
    step = make_step([1, 17, 64, 100], heads=4, kv_heads=2, head_dim=16)
    check_splits(step, num_splits=1, min_split_pages=1)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 130), min_size=1, max_size=4), st.integers(2, 8),
       st.integers(1, 3), st.sampled_from([1, 2]))
# contexts that use every split, some, one, or none (a padding row)
@example([100, 33, 5, 0], 3, 1, 1)   # (num_splits, min_split_pages, group)
@example([100, 33, 5, 0], 8, 2, 2)
def test_decode_several_splits(context_lens, num_splits, min_split_pages, group):
    """Several splits: each covers its keys from split_range, some past the context's end"""
    step = make_step(context_lens, heads=2 * group, kv_heads=2, head_dim=16, seed=1)
    check_splits(step, num_splits, min_split_pages)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 24), (8, 1, 40)])
def test_decode_grouped_heads(heads, kv_heads, head_dim):
    """Grouped-query heads: GROUP and head_dim need not be powers of two"""
    step = make_step([20, 70], heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=2)
    check_splits(step, num_splits=2, min_split_pages=1)


@pytest.mark.parametrize("num_splits, min_split_pages", [(3, 1), (8, 2)])
def test_reduce_combines_splits(num_splits, min_split_pages):
    """The reduce weighs each split by 2^lse and reads only the splits a sequence uses"""
    step = make_step([1, 17, 100, 49], heads=4, kv_heads=2, head_dim=16, seed=3)
    out = reduce_output(step, num_splits, min_split_pages)
    assert out.shape == step[0].shape and out.dtype == step[0].dtype
    torch.testing.assert_close(out.double(), dense_oracle(*step, SCALE), rtol=1e-4, atol=1e-5)


def test_reduce_padding_rows():
    """The reduce gives zeros for a padding row (context length 0)"""
    step = make_step([0, 20, 0, 5], heads=2, kv_heads=1, head_dim=16, seed=4)
    out = reduce_output(step, num_splits=2, min_split_pages=1)
    assert torch.equal(out[0::2], torch.zeros_like(out[0::2])), "padding rows are not zeros"
    torch.testing.assert_close(out.double(), dense_oracle(*step, SCALE), rtol=1e-4, atol=1e-5)


def test_half_precision():
    """Both kernels together, float16 in and out, within 3e-3 of the float64 reference"""
    step = make_step([7, 50, 0, 33], heads=4, kv_heads=2, head_dim=32, dtype=torch.float16,
                     seed=5)
    out = decode_attention(*step, SCALE, 2, 1)
    assert out.dtype == torch.float16
    expected = dense_oracle(*step, SCALE)
    assert ((out.double() - expected).norm() / expected.norm()).item() < 3e-3


# ---- GPU criteria (python -m course check 5 --gpu) ----------------------------------------

ORIGINAL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".state",
                        "05", "original", "nanoinfer", "kernels", "decode_attention.py")


def gpu_criterion(test):
    """A GPU criterion: marked `gpu` (`check 5 --gpu` runs these alone), and where there is no
    CUDA not collected at all (the grader would count a test deselected by `-m "not gpu"` as a
    criterion not met)."""
    test.__test__ = torch.cuda.is_available()
    return pytest.mark.gpu(test)


def original_decode_attention():
    """The engine's own launcher and kernels, as `start` saved them (the live module when the
    assignment is not started)."""
    if not os.path.exists(ORIGINAL):
        return decode_attention
    spec = importlib.util.spec_from_file_location("original_decode_attention", ORIGINAL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode_attention


def long_decode_step(seqs=8, context=8192, heads=16, kv_heads=8, head_dim=128):
    """A decode step in bfloat16 with Qwen3-0.6B's heads, blocks shuffled over the cache: the
    shape of `python bench.py --mode kernels` (docs/BENCHMARKS.md)."""
    torch.manual_seed(0)
    pages = context // PAGE
    num_blocks = seqs * pages
    shape = (num_blocks, PAGE, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda").view(seqs, pages).to(torch.int32)
    context_lens = torch.full((seqs,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(seqs, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    return query, k_cache, v_cache, block_tables, context_lens


def gpu_time_ms(fn, runs=15, calls=10):
    """Milliseconds per call of fn(): the median of `runs` timings by CUDA events, after a
    warm-up, each of `calls` calls in a row (so that the GPU never waits for the launches)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


@gpu_criterion
def test_gpu_correct_at_8x8192():
    """GPU: correct in bfloat16 at 8 sequences x 8192 tokens (within 2e-2 of float32)"""
    step = long_decode_step()
    scale = 128 ** -0.5
    out = decode_attention(*step, scale)   # the default split, as in the engine
    expected = torch.empty(step[0].shape, dtype=torch.float32, device="cuda")
    query, k_cache, v_cache, block_tables, context_lens = step
    group = query.shape[1] // k_cache.shape[2]
    for i in range(query.shape[0]):
        k = k_cache[block_tables[i].long()].flatten(0, 1).float().repeat_interleave(group, dim=1)
        v = v_cache[block_tables[i].long()].flatten(0, 1).float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", query[i].float(), k) * scale
        expected[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    error = ((out.float() - expected).norm() / expected.norm()).item()
    assert out.dtype == torch.bfloat16 and error < 2e-2, f"relative error {error:.3g}"


@gpu_criterion
def test_gpu_bandwidth_at_8x8192():
    """GPU: at least 80% of the original kernel's bandwidth at 8 sequences x 8192 tokens"""
    step = long_decode_step()
    original = original_decode_attention()
    scale = 128 ** -0.5
    my_times, original_times = [], []
    for _ in range(3):   # alternately, so that both see the same state of the GPU
        my_times.append(gpu_time_ms(lambda: decode_attention(*step, scale)))
        original_times.append(gpu_time_ms(lambda: original(*step, scale)))
    _, k_cache, _, _, context_lens = step
    kv_bytes = 2 * int(context_lens.sum()) * k_cache[0, 0].numel() * k_cache.element_size()
    mine = kv_bytes / min(my_times) / 1e6   # GB/s
    original_bandwidth = kv_bytes / min(original_times) / 1e6
    assert mine >= 0.8 * original_bandwidth, (
        f"yours reads K/V at {mine:.0f} GB/s ({min(my_times) * 1e3:.0f} us a call), under 80% "
        f"of the original's {original_bandwidth:.0f} GB/s ({min(original_times) * 1e3:.0f} us)")
