"""Token embedding and LM head, split along the vocabulary across tensor-parallel ranks.

Each rank holds a contiguous slice of the vocabulary's rows. For the embedding, a rank looks up
only the ids in its slice (zeros elsewhere) and an all-reduce sums the slices. The LM head
reuses the same weight layout and gathers the logits to the first rank, the one that samples.
With tied embeddings the LM head shares the embedding's weight.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed import get_tp_group
from nanoinfer.layers.linear import copy_shard
from nanoinfer.utils import cdiv


class VocabParallelEmbedding(nn.Module):

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        self.num_embeddings = num_embeddings
        self.num_per_partition = per_rank = cdiv(num_embeddings, self.tp_size)
        self.vocab_start = self.tp_rank * self.num_per_partition
        self.weight = nn.Parameter(torch.zeros(per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight) -> None:
        # the last is short
        rows = max(0, min(self.num_per_partition, self.num_embeddings - self.vocab_start))
        copy_shard(param.data[:rows], loaded_weight, 0, self.vocab_start, self.num_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.num_per_partition)
        x = F.embedding(local.clamp(0, self.num_per_partition - 1), self.weight)
        return self.tp_group.all_reduce(x * in_shard.unsqueeze(-1))


class ParallelLMHead(VocabParallelEmbedding):

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The logits on the first tensor-parallel rank, which samples; None on the others."""
        logits = self.tp_group.gather(F.linear(hidden_states, self.weight))
        return None if logits is None else logits[..., :self.num_embeddings]
