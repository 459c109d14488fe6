"""The gated MLP's activation: SiLU(gate) * up, on the packed [gate | up] projection
(one Triton kernel on a GPU, `kernels/activation.py`)."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from nanoinfer.kernels.activation import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
