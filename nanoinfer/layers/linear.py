"""Linear layers that can be split across tensor-parallel ranks (Megatron style).

- ColumnParallelLinear splits the output features: each rank computes a slice, no communication.
- RowParallelLinear splits the input features: each rank computes a partial sum, then all-reduce.
- QKVParallelLinear and MergedColumnParallelLinear pack several checkpoint matrices
  (q/k/v, gate/up) into one matmul; their `weight_loader` takes the checkpoint tensor of one
  shard (`shard_id`) and copies this rank's slice of it into the right rows.

Every parameter carries a `weight_loader(param, loaded_weight[, shard_id])` so the model
loader never needs to know how a layer is split.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed import all_reduce, get_tp_rank, get_tp_size


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


class LinearBase(nn.Module):

    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        check_shape(param.data, loaded_weight)
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def check_shape(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")


def set_shard_ids(layer: nn.Module, shard_ids: tuple) -> None:
    """The checkpoint shards a packed layer's parameters are made of (checked by the loader)."""
    for param in layer.parameters(recurse=False):
        param.shard_ids = shard_ids


class ColumnParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_size(), "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.shape[0]
        check_shape(param.data, loaded_weight.narrow(0, self.tp_rank * size, size))
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices side by side, e.g. gate_proj and up_proj (shards 0, 1)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)
        set_shard_ids(self, tuple(range(len(output_sizes))))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        check_shape(param.data.narrow(0, offset, size), shard)
        param.data.narrow(0, offset, size).copy_(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; each rank holds its own heads of each (GQA aware)."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        tp_size = get_tp_size()
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
        self.head_dim = head_dim
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)
        set_shard_ids(self, ("q", "k", "v"))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        check_shape(param.data.narrow(0, offset, size), shard)
        param.data.narrow(0, offset, size).copy_(shard)


class RowParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_size(), "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:   # the bias is not split; only rank 0 adds it
            return super().weight_loader(param, loaded_weight)
        size = param.shape[1]
        check_shape(param.data, loaded_weight.narrow(1, self.tp_rank * size, size))
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None))
