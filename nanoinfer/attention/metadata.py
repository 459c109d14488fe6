"""What attention needs to know about one step, set once per step for every layer to read.

A step is one flat batch of tokens from many sequences (prompt chunks and decodes mixed).
Sequence i owns query tokens `cu_seqlens_q[i]:cu_seqlens_q[i+1]` of the batch; they are its
*last* query tokens: its keys are the `context_lens[i]` tokens already in the cache, counting
this step's. `slot_mapping[t]` is where token t's K and V are written (-1: nowhere);
`block_tables[i]` lists sequence i's cache blocks; the entries past them are padding that is never
read (the context length says where a sequence ends).

The model's forward keeps the signature `forward(input_ids, positions)`: the model runner sets
this object around the forward pass, and each attention layer fetches it.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor   # int32 [num_seqs + 1]
    context_lens: torch.Tensor   # int32 [num_seqs]: keys per sequence, this step's included
    slot_mapping: torch.Tensor   # int64 [num_tokens]
    block_tables: torch.Tensor   # int32 [num_seqs, max_blocks_per_seq]
    max_seqlen_q: int            # the most query tokens of any sequence (1: a pure-decode step)


_forward_context: AttentionMetadata | None = None


@contextmanager
def set_forward_context(metadata: AttentionMetadata):
    global _forward_context
    _forward_context = metadata
    try:
        yield
    finally:
        _forward_context = None


def get_forward_context() -> AttentionMetadata:
    if _forward_context is None:
        raise RuntimeError("attention ran outside set_forward_context(): no step metadata")
    return _forward_context
