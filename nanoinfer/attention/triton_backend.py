"""The default attention backend on GPU: the project's own Triton kernels.

A step whose sequences all have exactly one query token (pure decode, the common case) runs
the split-KV decode kernel; any other step (prompt chunks, possibly mixed with decodes) runs the
paged prefill kernel, which handles both. Both can be captured in CUDA graphs.
"""
import torch

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.kernels.decode_attention import decode_attention
from nanoinfer.kernels.prefill_attention import prefill_attention
from nanoinfer.kernels.store_kv import store_kv


class TritonAttentionBackend:
    store_kv = staticmethod(store_kv)

    @staticmethod
    def forward(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.max_seqlen_q == 1:
            return decode_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                    scale)
        return prefill_attention(query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens,
                                 meta.block_tables, meta.max_seqlen_q, scale)
