"""Rotary position embeddings (RoPE), plain and with Llama 3's frequency scaling.

Each pair (x[i], x[i + d/2]) of a query or key head is rotated by the angle
`position * inv_freq[i]`, with `inv_freq[i] = theta ** (-2i / d)`. The cos/sin table is built
once for every position up to max_model_len and indexed by each token's position, so tokens of
any sequence, at any offset, can share one batch.

Llama 3 ("rope_type": "llama3") stretches long wavelengths by `factor`, keeps short ones, and
blends smoothly in between. The model config gives theta and the scaling either as
transformers 4's `rope_theta` + `rope_scaling` or as transformers 5's `rope_parameters`.

Qwen3 RMS-normalizes each query and key head just before the rotation; on a GPU the norm and
the rotation of all heads of a token are one Triton kernel, in place (`kernels/rotary.py`).
"""
import math

import torch
from torch import nn


def rope_config(hf_config) -> tuple[float, dict | None]:
    """(theta, scaling) from either config form; scaling is None for plain RoPE."""
    scaling = getattr(hf_config, "rope_parameters", None)   # transformers 5: theta in it too
    if scaling and "rope_theta" in scaling:
        theta = scaling["rope_theta"]
    else:   # transformers 4
        theta = getattr(hf_config, "rope_theta", 10000.0)
        scaling = getattr(hf_config, "rope_scaling", None)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope type {rope_type!r} is not supported; "
                         "nanoinfer supports 'default' and 'llama3'")
    return theta, scaling


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling["low_freq_factor"]
    high = scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / theta ** exponent
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; q_norm/k_norm: per-head
        RMSNorms."""
        if q.is_cuda:
            from nanoinfer.kernels.rotary import rotary_embedding_
            norms = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else ()
            rotary_embedding_(positions, q, k, self.cos_cache, self.sin_cache, *norms)
            return q, k
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
