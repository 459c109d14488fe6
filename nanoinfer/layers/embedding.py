"""Token embedding and LM head, split along the vocabulary across tensor-parallel ranks.

Each rank holds a contiguous slice of the vocabulary's rows. For the embedding, a rank looks up
only the ids in its slice (zeros elsewhere) and an all-reduce sums the slices. The LM head
reuses the same weight layout and all-gathers the logits. With tied embeddings the LM head
shares the embedding's weight.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_per_partition
        self.weight = nn.Parameter(torch.zeros(self.num_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.shape != (self.num_embeddings, param.shape[1]):
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                             f"expected {(self.num_embeddings, param.shape[1])}")
        shard = loaded_weight[self.vocab_start:self.vocab_start + self.num_per_partition]
        param.data[:shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.num_per_partition)
        x = F.embedding(local.clamp(0, self.num_per_partition - 1), self.weight)
        return all_reduce(x * in_shard.unsqueeze(-1))


class ParallelLMHead(VocabParallelEmbedding):

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(F.linear(hidden_states, self.weight))
        return logits[..., :self.num_embeddings]
