"""SiLU(gate) * up on the packed [gate | up] projection, in one kernel."""
import torch
import triton
import triton.language as tl


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n, BLOCK: tl.constexpr):
    row, col = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < n
    gate = tl.load(x_ptr + row * x_stride + col, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + n + col, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    tl.store(out_ptr + row * out_stride + col, (g / (1.0 + tl.exp(-g))).to(gate.dtype) * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out
