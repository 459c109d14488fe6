"""A matmul for a few rows: x [M <= 16, K] @ weight [N, K].T, the linear layers of a decode step.

At batch 1 a linear layer is a matrix-vector product: it does 2 FLOPs per weight it reads, so its
time is the time to read the weight. The weights of a small model are small (Qwen3-0.6B's o_proj
is 4 MB, 1 us of the H200's bandwidth), so a kernel's fixed costs (its launch, the ramp-up of
its loads, the tail of its last programs) are most of what it takes, and cuBLAS's choice of
kernel for such shapes is sometimes poor: at batch 1 that o_proj takes 12.7 us in cuBLAS and
5.4 us here (docs/BENCHMARKS.md).

Program n reads the weight rows [n * BLOCK_N, (n + 1) * BLOCK_N) once, in BLOCK_K-wide tiles,
and multiplies each tile by the same columns of x on the tensor cores (the rows of x past M are
masked to zero: a 16-row tile costs the same as one row when reading the weight is what takes
the time). Narrow BLOCK_N makes many programs, each with several tiles in flight
(`num_stages`), which is what keeps the memory system busy.
"""
import torch
import triton
import triton.language as tl

from nanoinfer.kernels.decode_attention import dot_precision

MAX_ROWS = 16   # more rows go to cuBLAS


@triton.jit(do_not_specialize=["M"])
def gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, x_stride, out_stride,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for m < M and this program's n; x's rows
    at x_ptr + m * x_stride, w contiguous [N, K], out's rows at out_ptr + m * out_stride."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x = tl.load(x_ptr + offs_m[:, None] * x_stride + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * K + k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * out_stride + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         block_n: int | None = None, block_k: int | None = None, num_warps: int = 4,
         num_stages: int = 4) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, unit column stride), weight [N, K] contiguous -> [M, N]. The
    default tiles (measured on an H200: docs/BENCHMARKS.md): narrow ones for a narrow weight,
    so that it still makes enough programs, and long K tiles while there are few programs."""
    (m, k), n = x.shape, weight.shape[0]
    block_n = block_n or (16 if n <= 2048 else 32 if n <= 4096 else 64)
    block_k = block_k or (512 if n <= 4096 else 128)
    out = x.new_empty(m, n)
    gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if bias is None else bias, out, m, n, k, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear, with a few half-precision rows on a GPU going through `gemv`. (float32 stays
    with torch: those are the runs checked for exactness against transformers.)"""
    if fits_gemv(x, weight, bias):
        return gemv(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def fits_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `gemv` takes these; anything else goes to torch (which also raises the errors
    about mismatched shapes or dtypes)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.is_cuda and weight.is_contiguous() and weight.shape[1] == x.shape[1]
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))
