"""Triton kernels: the KV-cache store and paged attention (prefill and split-KV decode)."""
