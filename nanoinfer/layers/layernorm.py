"""RMSNorm, optionally fused with the residual add that precedes it.

`norm(x, residual)` computes `x + residual`, returns it as the new residual, and normalizes it:
the decoder layer's two adds and two norms become two calls. The arithmetic follows Hugging
Face's order (normalize in float32, cast back, then scale) so outputs match to the bit.
On a GPU one Triton kernel does the whole thing (`kernels/rms_norm.py`).
"""
import torch
from torch import nn


class RMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:
            from nanoinfer.kernels.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)
