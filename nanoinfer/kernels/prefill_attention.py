"""Paged prefill attention: a (possibly chunked) prompt's queries over its cached context.

Sequence i contributes q_i query tokens (`cu_seqlens_q`), the last q_i of its `context_len`
tokens, whose K/V are all in the paged cache already (earlier chunks, prefix-cache hits, and
this chunk, just stored). Query r (position context_len - q_i + r) attends causally to keys
0 .. context_len - q_i + r. One program takes `BLOCK_M` queries of one sequence and one head,
streams that head's K/V in `BLOCK_N`-key tiles gathered through the block table, and keeps an
online softmax. Tiles entirely after the program's last query are never loaded, and only tiles
that cross the diagonal pay for the causal mask. Sequences of any lengths share one launch;
decode tokens in a mixed step are simply sequences with one query.

Which program takes which queries: the programs of one head are numbered 0 .. tokens // BLOCK_M
+ num_seqs - 1, and sequence i owns the numbers from cu_seqlens_q[i] // BLOCK_M + i up to the next
sequence's first. That is at least the blocks it needs (its spare numbers return at once), the
launch's size depends on the step's token and sequence counts alone (so a CUDA graph can hold
it), and a program finds its sequence by counting the first numbers up to its own.
"""
import torch
import triton
import triton.language as tl

from nanoinfer.kernels.decode_attention import LOG2E, dot_precision


# (The step's arrays are views into one buffer, at offsets that vary by step, and the block
# table's width varies too: Triton would compile a variant for each alignment it meets.)
@triton.jit(do_not_specialize=["bt_stride", "num_seqs"], do_not_specialize_on_alignment=[
    "cu_seqlens_q_ptr", "context_lens_ptr", "block_tables_ptr"])
def prefill_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_seqlens_q_ptr,
                             context_lens_ptr, block_tables_ptr, scale_log2, q_stride, out_stride,
                             bt_stride, num_seqs, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                             HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    program, head = tl.program_id(0), tl.program_id(1)
    seq = find_sequence(cu_seqlens_q_ptr, num_seqs, program, BLOCK_M)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    m_block = program - (q_start // BLOCK_M + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix = context_len - q_len
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    m_mask, d_mask = offs_m < q_len, offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * q_stride + head * HEAD_DIM + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + offs_m

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # past the last query: never seen
    end = tl.minimum(context_len, prefix + (m_block + 1) * BLOCK_M)
    # before the first query: all seen
    full_end = prefix + m_block * BLOCK_M
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < end
        page = tl.load(block_tables_ptr + seq * bt_stride + pos // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        kv_offs = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if n0 + BLOCK_N > full_end:   # a tile on the diagonal or at the end: mask it
            s = tl.where((pos[None, :] <= q_pos[:, None]) & valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l = l * alpha + tl.sum(p, 1)
        m = m_new

    out = acc / l[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * out_stride + head * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def find_sequence(cu_seqlens_q_ptr, num_seqs, program, BLOCK_M: tl.constexpr):
    """The last sequence i whose first program number, cu_seqlens_q[i] // BLOCK_M + i, is at
    most `program`: those numbers only grow with i, so it is how many are at most `program`,
    less one (sequence 0's is 0: cu_seqlens_q[0] must be 0). The loads of 64 at a time do not
    wait on each other."""
    count = program * 0
    for start in range(0, num_seqs, 64):
        i = start + tl.arange(0, 64)
        first = tl.load(cu_seqlens_q_ptr + i, mask=i < num_seqs) // BLOCK_M + i
        count += tl.sum(((first <= program) & (i < num_seqs)).to(tl.int32))
    return count - 1


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor, max_seqlen_q: int, scale: float) -> torch.Tensor:
    """query: [tokens, heads, head_dim] of all sequences back to back -> output of the same
    shape."""
    num_heads, head_dim = query.shape[1:]
    _, page, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(query)
    block_m = 128 if query.device.type == "cuda" else 16
    block_m = min(block_m, max(16, triton.next_power_of_2(max_seqlen_q)))
    num_seqs = len(context_lens)
    grid = (len(query) // block_m + num_seqs, num_heads)
    prefill_attention_kernel[grid](
        query, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, scale * LOG2E,
        query.stride(0), out.stride(0), block_tables.stride(0), num_seqs, NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page, BLOCK_M=block_m, BLOCK_N=64,
        BLOCK_D=triton.next_power_of_2(head_dim), PRECISION=dot_precision(query.dtype),
        num_warps=8 if block_m >= 128 else 4, num_stages=2)
    return out
