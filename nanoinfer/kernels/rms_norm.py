"""Fused residual add + RMSNorm: one pass over each row instead of eight small kernels.

Row by row: x = x + residual (the residual buffer is updated in place), then
out = weight * (x / sqrt(mean(x^2) + eps)), normalized in float32 and cast back before the
weight, in the same order as the torch layer.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, x_stride, residual_stride,
                    out_stride, n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * residual_stride + offs, mask=mask, other=0.0)
        tl.store(residual_ptr + row * residual_stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + offs, mask=mask)
    tl.store(out_ptr + row * out_stride + offs, weight * normed, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """x: [rows, n] -> normalized rows; with `residual`, also returns the updated residual."""
    out, n = torch.empty_like(x), x.shape[1]
    has_residual = residual is not None
    rms_norm_kernel[(x.shape[0],)](x, residual if has_residual else x, weight, out, x.stride(0),
                                   residual.stride(0) if has_residual else 0, out.stride(0), n, eps,
                                   HAS_RESIDUAL=has_residual, BLOCK=triton.next_power_of_2(n))
    return (out, residual) if has_residual else out
