"""SiLU(gate) * up on the packed [gate | up] projection, in one kernel."""
import torch
import triton
import triton.language as tl


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n, BLOCK: tl.constexpr):
    row, col = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < n
    gate = tl.load(x_ptr + row * x_stride + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n + col, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + row * out_stride + col, silu * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    rows, n = x.shape[0], x.shape[1] // 2
    block = min(1024, triton.next_power_of_2(n))
    out, grid = x.new_empty(rows, n), (rows, triton.cdiv(n, block))
    silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out
