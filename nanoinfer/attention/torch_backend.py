"""The reference attention backend: plain PyTorch, one sequence at a time.

It writes each token's K and V into its cache slot, then for each sequence gathers its keys and
values out of the paged cache through the block table and runs exact causal attention with
grouped-query heads. It is slow but obviously right: the CPU path, and the oracle against which
the fast kernels are tested.

Causality with a cached prefix: a sequence's q queries are its last q tokens out of k, so query j
(position k - q + j) may see keys 0 .. k - q + j: a lower-triangular mask shifted by k - q.
"""
import torch
import torch.nn.functional as F

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.utils import cdiv


class TorchAttentionBackend:

    @staticmethod
    def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write token t's key and value into slot `slot_mapping[t]` of the caches, in place.

        key/value: [tokens, kv_heads, head_dim], possibly strided views (slices of the packed
        q/k/v projection); caches: [blocks, block_size, kv_heads, head_dim]. Slot s is row
        s % block_size of block s // block_size; slot -1 means "nowhere" (the token is
        skipped). No other slot of the caches changes."""
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep]
        v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep]

    @staticmethod
    def forward(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query: [tokens, heads, head_dim] -> output of the same shape and dtype.

        Sequence i's queries are rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, its last q tokens of
        k = `context_lens[i]`; its keys and values are positions 0 .. k-1, position p in block
        `block_tables[i, p // block_size]` at row p % block_size (block_size: the caches'
        second dimension). Query j sees keys 0 .. k - q + j; the scores are scaled by `scale`;
        query head h reads kv head h // (heads // kv_heads). The caches are only read."""
        out = torch.empty_like(query)
        block_size = k_cache.shape[1]
        cu_q, lens_k = meta.cu_seqlens_q.tolist(), meta.context_lens.tolist()
        for i, len_k in enumerate(lens_k):
            q = query[cu_q[i]:cu_q[i + 1]].transpose(0, 1)              # [heads, q, d]
            len_q = q.shape[1]
            blocks = meta.block_tables[i, :cdiv(len_k, block_size)]
            k = k_cache[blocks].flatten(0, 1)[:len_k].transpose(0, 1)   # [kv_heads, k, d]
            v = v_cache[blocks].flatten(0, 1)[:len_k].transpose(0, 1)
            mask = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(len_k - len_q)
            o = F.scaled_dot_product_attention(q, k, v, mask, scale=scale, enable_gqa=True)
            out[cu_q[i]:cu_q[i + 1]] = o.transpose(0, 1)
        return out
