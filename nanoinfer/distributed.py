"""Process groups: which ranks split a model between them, and the collectives over them.

torch.distributed's world holds every rank; inside it, each parallel dimension has groups of its
own. The tensor-parallel group is the set of ranks that hold shards of the same layers: its
collectives (the all-reduce after a row-parallel matmul, the all-gather of vocab-parallel logits)
run over it alone, never over the world, so that pipeline-parallel stages and data-parallel
replicas can sit beside it in one world. `init_tensor_parallel(size)` cuts the world into groups
of `size` consecutive ranks.

With one process (the default) the group has one rank and every collective is a no-op.
"""
import torch
import torch.distributed as dist


class GroupCoordinator:

    def __init__(self, ranks: list[int], group: dist.ProcessGroup | None = None):
        self.ranks, self.group = ranks, group
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(dist.get_rank()) if group is not None else 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


_TP = GroupCoordinator([0])


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


def get_tp_rank() -> int:
    return _TP.rank_in_group


def get_tp_size() -> int:
    return _TP.world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(x)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    return _TP.all_gather(x)
