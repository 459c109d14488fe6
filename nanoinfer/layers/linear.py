"""Linear layers that can be split across tensor-parallel ranks (Megatron style).

- ColumnParallelLinear splits the output features: each rank computes a slice, no communication.
- RowParallelLinear splits the input features: each rank computes a partial sum, then all-reduce.
- QKVParallelLinear and MergedColumnParallelLinear pack several checkpoint matrices
  (q/k/v, gate/up) into one matmul; their `weight_loader` takes the checkpoint tensor of one
  shard (`shard_id`) and copies this rank's slice of it into the right rows.

Every parameter carries a `weight_loader(param, loaded_weight[, shard_id])` so the model
loader never needs to know how a layer is split; `loaded_weight` may be a lazy safetensors
slice, so a rank reads only its own part of the checkpoint.

The forward is `linear`: torch's matmul, except on a GPU, where kernels/gemv.py takes the few
rows of a decode step in half precision (a kernel of our own, faster at those shapes). Sizes that
do not split over the ranks never get here: `Config.check_model_parallel` refuses them first.
"""
import torch
from torch import nn

from nanoinfer.distributed import get_tp_group, get_tp_size
from nanoinfer.utils import require


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.is_cuda:   # (Triton is imported on a GPU only: the CPU path runs without it)
        from nanoinfer.kernels.gemv import linear as gpu_linear
        return gpu_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


class LinearBase(nn.Module):
    """A linear layer's parameters; each subclass's `weight_loader` says how it is split."""
    # the checkpoint shards the parameters are made of (a packed layer's; checked by the loader)
    shard_ids: tuple = (None,)

    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp_group = get_tp_group()   # (the forward's collectives use this very group)
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
            param.shard_ids = self.shard_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def copy_shard(dst: torch.Tensor, loaded_weight, dim: int = 0, start: int = 0,
               full_size: int | None = None) -> None:
    """Copy [start, start + dst's size) along `dim` of a checkpoint tensor, whose size along `dim`
    must be `full_size` (default: dst's), into `dst`. `loaded_weight` is a tensor or a safetensors
    slice, from which only that part is read."""
    expected = list(dst.shape)
    expected[dim] = expected[dim] if full_size is None else full_size
    shape = list(loaded_weight.shape if isinstance(loaded_weight, torch.Tensor)
                 else loaded_weight.get_shape())
    require(shape == expected,
            f"checkpoint tensor has shape {tuple(shape)}, expected {tuple(expected)}")
    index = (slice(None),) * dim + (slice(start, start + dst.shape[dim]),)
    dst.copy_(loaded_weight[index])


class ColumnParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size // get_tp_size(), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight) -> None:
        """Copy this rank's slice of a checkpoint tensor into `param`: of the weight [output_size,
        input_size] the output rows [r * output_size / T, (r + 1) * output_size / T) of rank r
        (T ranks; `param` is [output_size / T, input_size]), of the bias [output_size] the same
        entries. `loaded_weight` is a tensor or a lazy safetensors slice: `copy_shard` reads only
        the part it copies."""
        size = param.shape[0]
        copy_shard(param.data, loaded_weight, 0, self.tp_rank * size, size * self.tp_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices side by side, e.g. gate_proj and up_proj (shards 0, 1)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        self.shard_ids = tuple(range(len(output_sizes)))   # (read by LinearBase.__init__)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: int) -> None:
        """Copy this rank's slice of shard `shard_id` (a checkpoint tensor of
        `output_sizes[shard_id]` rows, e.g. up_proj's weight or bias) into its rows of `param`.
        A rank's rows are its slices of the shards one after another, shard 0's first: shard i
        takes output_sizes[i] / T rows, rank r's part of it (as in ColumnParallelLinear), after
        the rows of the shards before it. Called once per shard, for the weight and the bias."""
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        copy_shard(param.data.narrow(0, offset, size), loaded_weight, 0, self.tp_rank * size,
                   self.output_sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; each rank holds its own heads of each (GQA aware).

    With more ranks than KV heads, each rank holds one KV head, the one its query heads use:
    tensor_parallel_size / num_key_value_heads ranks share (replicate) each KV head."""
    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        tp_size = get_tp_size()
        self.num_heads = total_num_heads // tp_size
        # (Config.check_model_parallel: one of the KV heads and the ranks divides the other)
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // total_num_kv_heads)
        self.head_dim = head_dim
        self.total_num_kv_heads = total_num_kv_heads
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: str) -> None:
        """Copy this rank's heads of the checkpoint's q, k or v projection (`shard_id` "q", "k" or
        "v": a weight [heads * head_dim, hidden_size] or a bias [heads * head_dim]) into their
        rows of `param`, which holds this rank's query heads (num_heads * head_dim rows), then its
        KV heads of k, then the same heads of v (num_kv_heads * head_dim rows each). Rank r holds
        query heads [r * num_heads, (r + 1) * num_heads), and KV heads [r * num_kv_heads,
        (r + 1) * num_kv_heads) or, with fewer KV heads than ranks, KV head r // kv_replicas
        (num_heads and num_kv_heads count one rank's heads, as __init__ sets them)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            dst = param.data[:q_size]
            start = self.tp_rank * q_size
            full = q_size * self.tp_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            dst = param.data.narrow(0, offset, kv_size)
            start = self.tp_rank // self.kv_replicas * kv_size
            full = self.total_num_kv_heads * self.head_dim
        copy_shard(dst, loaded_weight, 0, start, full)


class RowParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size // get_tp_size(), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight) -> None:
        """Copy this rank's slice of a checkpoint tensor into `param`: of the weight [output_size,
        input_size] the input columns [r * input_size / T, (r + 1) * input_size / T) of rank r
        (`param` is [output_size, input_size / T]); the bias [output_size] is not split, every
        rank holds all of it."""
        if param.dim() == 1:   # the bias is not split; only rank 0 adds it
            return copy_shard(param.data, loaded_weight)
        size = param.shape[1]
        copy_shard(param.data, loaded_weight, 1, self.tp_rank * size, size * self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, input_size / T], this rank's input features (the column-parallel
        layer before it leaves them split). Returns [num_tokens, output_size], the same on every
        rank: the sum over the ranks of their partial products x @ weight.T, all-reduced over
        `self.tp_group`, plus the bias, added once."""
        bias = self.bias if self.tp_rank == 0 else None
        return self.tp_group.all_reduce(linear(x, self.weight, bias))
