"""Rotary embedding of queries and keys in place, optionally after a per-head RMSNorm (Qwen3).

One program per token rotates all of its query heads and key heads: each pair
(x[i], x[i + d/2]) becomes (x1 cos - x2 sin, x2 cos + x1 sin) at the token's position, read
from the float32 cos/sin tables. With q/k norm weights, each head is first RMS-normalized over
head_dim (Qwen3), so the three steps cost one kernel.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride, token, num_heads, cos, sin, norm_ptr, eps, HEAD_DIM: tl.constexpr,
                  HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM // 2)
    ptrs = x_ptr + token * stride + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HEAD_DIM // 2, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)
        w1 = tl.load(norm_ptr + offs_d, mask=offs_d < HEAD_DIM // 2).to(tl.float32)
        w2 = tl.load(norm_ptr + HEAD_DIM // 2 + offs_d, mask=offs_d < HEAD_DIM // 2).to(tl.float32)
        x1 = (x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1[None, :]
        x2 = (x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2[None, :]
    tl.store(ptrs, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(ptrs + HEAD_DIM // 2, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


# (positions is a view into the step's packed int64 buffer, after its token ids: whether it is
# 16-byte aligned depends on the token count, and Triton would compile a variant for each)
@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def rotary_kernel(q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, eps,
                  q_stride, k_stride, num_q_heads, num_k_heads, HEAD_DIM: tl.constexpr,
                  HAS_NORM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                  HALF: tl.constexpr):
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * (HEAD_DIM // 2) + offs_d, mask=offs_d < HEAD_DIM // 2)
    sin = tl.load(sin_ptr + pos * (HEAD_DIM // 2) + offs_d, mask=offs_d < HEAD_DIM // 2)
    _rotate_heads(q_ptr, q_stride, token, num_q_heads, cos, sin, q_norm_ptr, eps, HEAD_DIM,
                  HAS_NORM, BLOCK_Q, HALF)
    _rotate_heads(k_ptr, k_stride, token, num_k_heads, cos, sin, k_norm_ptr, eps, HEAD_DIM,
                  HAS_NORM, BLOCK_K, HALF)


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                      q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                      eps: float = 0.0) -> None:
    """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim], rows may be strided views."""
    num_tokens, num_q_heads, head_dim = q.shape
    has_norm = q_norm is not None
    rotary_kernel[(num_tokens,)](
        q, k, positions, cos_cache, sin_cache, q_norm if has_norm else q, k_norm if has_norm else k,
        eps, q.stride(0), k.stride(0), num_q_heads, k.shape[1], HEAD_DIM=head_dim,
        HAS_NORM=has_norm, BLOCK_Q=triton.next_power_of_2(num_q_heads),
        BLOCK_K=triton.next_power_of_2(k.shape[1]), HALF=triton.next_power_of_2(head_dim // 2))
