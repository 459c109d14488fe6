"""Attention: per-step metadata, and the backends that read and write the paged KV cache."""
from nanoinfer.attention.metadata import AttentionMetadata, get_forward_context, set_forward_context

__all__ = ["AttentionMetadata", "get_forward_context", "set_forward_context", "get_attn_backend"]


def get_attn_backend(name: str):
    if name == "torch":
        from nanoinfer.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend
    if name == "triton":
        from nanoinfer.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend
    raise ValueError(f"unknown attention backend {name!r}; available: 'torch', 'triton'")
