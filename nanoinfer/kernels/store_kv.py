"""Write each token's key and value into the paged KV cache at its slot.

One program per token copies one row of `num_kv_heads * head_dim` values into slot
`slot_mapping[token]` of the key cache and of the value cache. Slot -1 means "nowhere"
(a padding token, e.g. in a CUDA graph bigger than the batch) and is skipped.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, key_stride,
                    value_stride, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Program `token` (grid: one per token) copies the token's key row, the ROW = kv_heads *
    head_dim values at key_ptr + token * key_stride, to k_cache_ptr + slot * ROW, where slot =
    slot_mapping[token] (int64); the value row likewise (value_stride, v_cache_ptr). Slot -1:
    nothing is written. BLOCK is ROW rounded up to a power of two (mask the rest)."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    key = tl.load(key_ptr + token * key_stride + offs, mask=mask)
    value = tl.load(value_ptr + token * value_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, key, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, value, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value: [tokens, kv_heads, head_dim], each token's row contiguous;
    caches: [blocks, block_size, kv_heads, head_dim]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    for t in (key, value):
        assert t.stride()[1:] == (head_dim, 1), "each token's K/V row must be contiguous"
    row = num_kv_heads * head_dim
    store_kv_kernel[(num_tokens,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0),
                                   value.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row))
