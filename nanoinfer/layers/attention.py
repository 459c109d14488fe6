"""The attention layer: writes this step's K/V into the paged cache, then attends over it.

The model runner binds each layer's slice of the KV cache (`k_cache`, `v_cache`) and the
backend; the per-step metadata comes from the forward context.
"""
import torch
from torch import nn

from nanoinfer.attention import get_forward_context


class Attention(nn.Module):

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.backend = None
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]."""
        meta = get_forward_context()
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)
