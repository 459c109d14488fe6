"""Process groups: which ranks split a model between them, and the collectives over them.

torch.distributed's world holds every rank; inside it, each parallel dimension has groups of its
own. The tensor-parallel group is the set of ranks that hold shards of the same layers: its
collectives (the all-reduce after a row-parallel matmul, the gather of vocab-parallel logits to
the first rank, the broadcast of its sampled tokens) run over it alone, never over the world, so
that pipeline-parallel stages and data-parallel replicas can sit beside it in one world.
`init_tensor_parallel(size)` cuts the world into groups of `size` consecutive ranks.

The backend is NCCL on GPUs (one GPU a rank; its collectives are kernels on the GPU's stream, so
they are captured in CUDA graphs like any other kernel) and gloo on the CPU. With one process
(the default) the group has one rank and every collective is a no-op.
"""
from datetime import timedelta

import torch
import torch.distributed as dist


class GroupCoordinator:

    def __init__(self, ranks: list[int], group: dist.ProcessGroup | None = None):
        self.ranks, self.group = ranks, group
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(dist.get_rank()) if group is not None else 0

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, op=op, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` concatenated along the last dimension on the group's first rank;
        None on the others."""
        if self.world_size == 1:
            return x
        first = self.rank_in_group == 0
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if first else None
        dist.gather(x.contiguous(), parts, dst=self.ranks[0], group=self.group)
        return torch.cat(parts, dim=-1) if first else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """The group's first rank's `x`, written into `x` on every rank."""
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[0], group=self.group)
        return x


_TP = GroupCoordinator([0])


def init_distributed(rank: int, world_size: int, init_method: str, backend: str) -> GroupCoordinator:
    """Join the world (rank `rank` of `world_size`) and form the tensor-parallel groups."""
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # a peer that has not joined in two minutes is gone (the default would wait half an hour)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=2))
    return init_tensor_parallel(world_size)


def init_tensor_parallel(tensor_parallel_size: int) -> GroupCoordinator:
    """Split the (initialised) world into tensor-parallel groups; returns this rank's."""
    global _TP
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % tensor_parallel_size:
        raise ValueError(f"world size {world_size} is not divisible by tensor_parallel_size={tensor_parallel_size}")
    for start in range(0, world_size, tensor_parallel_size):
        ranks = list(range(start, start + tensor_parallel_size))
        group = dist.new_group(ranks)   # every rank takes part in creating every group
        if rank in ranks:
            _TP = GroupCoordinator(ranks, group)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP.group is not None:
        dist.destroy_process_group(_TP.group)
    _TP = GroupCoordinator([0])


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_tp_size() -> int:
    return _TP.world_size
