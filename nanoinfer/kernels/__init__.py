"""Triton kernels: the KV-cache store, paged attention (prefill and split-KV decode), the fused
elementwise ops (add + RMSNorm, q/k norm + rotary, SiLU * up), sampling, the grammar bitmask, and
the few-row matmul of decode's linear layers (gemv)."""
