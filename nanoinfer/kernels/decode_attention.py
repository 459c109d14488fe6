"""Paged decode attention with split-KV (flash-decoding).

Decode has one query token per sequence, so the work is reading each sequence's whole K/V
context once: it is bound by memory bandwidth. One program handles one (sequence, kv head,
split): it loads the kv head's whole query group at once (GQA: the group's q heads share every
K/V tile they load) and streams its share of the context, `BLOCK_N` keys at a time gathered
through the block table, keeping an online softmax (running max `m`, sum `l`, output `acc`).

Splitting the context keeps the GPU full and evenly loaded: with few sequences (batch 1, say)
there would be too few programs for 132 SMs, and with many sequences of different lengths the
programs of the longest would run on alone at the end. So each sequence's context is cut into
`num_splits` slices of at least `min_split_pages` pages (short contexts use fewer slices); the
slices run in parallel, each writing a partial output and its log-sum-exp, and a second small
kernel combines them:
    out = sum_s exp(lse_s - max lse) * out_s / sum_s exp(lse_s - max lse).
The split count is a plain argument, not a compile-time constant: one compiled kernel serves
every batch size.
Everything is in base 2 (exp2/log2) with the softmax scale folded into log2(e).
"""
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact products (not TF32): float32 runs are the ones checked for
    exactness."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def split_range(context_len, split, num_splits, min_split_pages, PAGE: tl.constexpr):
    """The keys [start, end) of one split, and how many splits the sequence uses."""
    num_pages = tl.cdiv(context_len, PAGE)
    split_pages = tl.maximum(tl.cdiv(num_pages, num_splits), min_split_pages)
    start, span = split * split_pages * PAGE, split_pages * PAGE
    return start, tl.minimum(start + span, context_len), tl.cdiv(num_pages, split_pages)


@triton.jit(do_not_specialize=["bt_stride", "num_splits", "min_split_pages"],   # (see prefill)
            do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr"])
def decode_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                            partial_ptr, lse_ptr, scale_log2, q_stride, bt_stride, num_splits,
                            min_split_pages, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                            HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Program (seq, kv_head, split) attends the GROUP query heads kv_head * GROUP + g of one
    sequence's query (at q_ptr + seq * q_stride + head * HEAD_DIM) over the keys [start, end)
    that `split_range` gives this split, in pages of PAGE slots found through the block table
    (int32, row stride bt_stride); key position p is at slot block_tables[seq, p // PAGE] * PAGE
    + p % PAGE, and a slot's kv head at slot * NUM_KV_HEADS * HEAD_DIM + kv_head * HEAD_DIM.
    With scores s = scale_log2 * q.k (base 2), it writes, for row r = (seq * NUM_KV_HEADS * GROUP
    + head) * num_splits + split of the float32 buffers, the split's partial output
    sum(2^s * v) / sum(2^s) at partial_ptr + r * HEAD_DIM, and lse_ptr[r] = log2(sum(2^s)).
    A split past the context's end (start >= end) need not write anything."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start, end, _ = split_range(context_len, split, num_splits, min_split_pages, PAGE)

    offs_h, offs_d, offs_n = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    head = kv_head * GROUP + offs_h
    h_mask, d_mask = offs_h < GROUP, offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * q_stride + head[:, None] * HEAD_DIM + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < end
        page = tl.load(block_tables_ptr + seq * bt_stride + pos // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        kv_offs = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l = l * alpha + tl.sum(p, 1)
        m = m_new

    row = (seq * NUM_KV_HEADS * GROUP + head) * num_splits + split
    h_mask = offs_h < tl.where(start < end, GROUP, 0)   # a split past the context writes nothing
    tl.store(partial_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
             acc / tl.where(l > 0, l, 1.0)[:, None], mask=h_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + row, m + tl.log2(l), mask=h_mask)


@triton.jit(do_not_specialize=["num_splits", "min_split_pages"])
def decode_reduce_kernel(partial_ptr, lse_ptr, out_ptr, context_lens_ptr, out_stride, num_splits,
                         min_split_pages, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (seq, head) combines the head's partial outputs of the splits the sequence uses
    (the first `used`, from `split_range`; the other rows were never written): weights
    2^(lse_s - max lse), out = sum(weight_s * partial_s) / sum(weight_s), stored in the output's
    dtype at out_ptr + seq * out_stride + head * HEAD_DIM. A sequence of context length 0 (a
    padding row) uses no split and gets zeros."""
    seq, head = tl.program_id(0), tl.program_id(1)
    _, _, used = split_range(tl.load(context_lens_ptr + seq), 0, num_splits, min_split_pages, PAGE)
    offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    s_mask, d_mask = offs_s < used, offs_d < HEAD_DIM
    row = (seq * NUM_HEADS + head) * num_splits + offs_s
    lse = tl.load(lse_ptr + row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    partial = tl.load(partial_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weight, 0)   # 0 for a padding row (context length 0): it gets zeros
    out = tl.sum(weight[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * out_stride + head * HEAD_DIM + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def default_split(num_seqs: int, num_kv_heads: int, device: torch.device) -> tuple[int, int]:
    """(num_splits, min_split_pages): enough (sequence, kv head, split) programs for several waves
    over the SMs. Slices are long (`MIN_SPLIT_PAGES`) when the sequences alone fill the SMs, and
    shorter when they do not (8 pages, or 4 below a quarter of the SMs): at batch 1 a program's
    time is the latency of its loop over the slice, not the bandwidth it uses."""
    num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 8)
    programs = num_seqs * num_kv_heads
    num_splits = max(1, min(MAX_SPLITS, triton.cdiv(TARGET_WAVES * num_sms, programs)))
    if programs >= num_sms:
        return num_splits, MIN_SPLIT_PAGES
    return num_splits, 8 if 4 * programs > num_sms else 4


TARGET_WAVES, MAX_SPLITS, MIN_SPLIT_PAGES = 16, 32, 32   # measured on an H200: docs/BENCHMARKS.md


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     num_splits: int | None = None, min_split_pages: int | None = None,
                     block_n: int = 64, num_stages: int = 2) -> torch.Tensor:
    """query: [seqs, heads, head_dim], one token per sequence -> output of the same shape."""
    num_seqs, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group, precision = num_heads // num_kv_heads, dot_precision(query.dtype)
    splits, min_pages = default_split(num_seqs, num_kv_heads, query.device)
    num_splits = splits if num_splits is None else num_splits
    min_split_pages = min_pages if min_split_pages is None else min_split_pages
    partial = query.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32)
    lse = query.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    block_d, block_h = triton.next_power_of_2(head_dim), max(16, triton.next_power_of_2(group))
    decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens, partial, lse, scale * LOG2E,
        query.stride(0), block_tables.stride(0), num_splits, min_split_pages,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_H=block_h,
        BLOCK_D=block_d, BLOCK_N=block_n, PRECISION=precision, num_warps=4, num_stages=num_stages)
    out, block_s = torch.empty_like(query), triton.next_power_of_2(num_splits)
    decode_reduce_kernel[(num_seqs, num_heads)](
        partial, lse, out, context_lens, out.stride(0), num_splits, min_split_pages,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, PAGE=page, BLOCK_S=block_s, BLOCK_D=block_d)
    return out
