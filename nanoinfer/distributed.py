"""Process groups: which ranks split a model between them, and the collectives over them.

torch.distributed's world holds every rank; inside it, each parallel dimension has groups of its
own. The tensor-parallel group is the set of ranks that hold shards of the same layers: its
collectives (the all-reduce after a row-parallel matmul, the gather of vocab-parallel logits to
the first rank, the broadcast of its sampled tokens) run over it alone, never over the world. The
pipeline-parallel group is the set of ranks that hold the same shard of successive layer ranges,
one rank per stage: a stage sends its hidden states to the next one point to point. With
pipeline_parallel_size P and tensor_parallel_size T the world has P x T ranks, stage s being
ranks [s T, (s + 1) T) (`init_model_parallel`):

    T = 2, P = 2:   stage 0: ranks 0 1   (tensor-parallel groups: [0, 1] and [2, 3])
                    stage 1: ranks 2 3   (pipeline-parallel groups: [0, 2] and [1, 3])

The backend is NCCL on GPUs (one GPU a rank; its collectives are kernels on the GPU's stream, so
they are captured in CUDA graphs like any other kernel) and gloo on the CPU. With one process
(the default) every group has one rank and every collective is a no-op.
"""
from datetime import timedelta

import torch
import torch.distributed as dist


class GroupCoordinator:

    def __init__(self, ranks: list[int], group: dist.ProcessGroup | None = None):
        self.ranks = ranks
        self.group = group
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
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(x.contiguous(), parts, dst=self.ranks[0], group=self.group)
        return torch.cat(parts, dim=-1) if self.is_first else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """The group's first rank's `x`, written into `x` on every rank."""
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[0], group=self.group)
        return x

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def send_next(self, x: torch.Tensor) -> None:
        """To the next rank of the group (the next pipeline stage)."""
        dist.send(x.contiguous(), dst=self.ranks[self.rank_in_group + 1], group=self.group)

    def recv_prev(self, x: torch.Tensor) -> torch.Tensor:
        """From the previous rank of the group, into `x`."""
        dist.recv(x, src=self.ranks[self.rank_in_group - 1], group=self.group)
        return x


_TP = _PP = GroupCoordinator([0])


def init_distributed(rank: int, world_size: int, init_method: str, backend: str,
                     tensor_parallel_size: int) -> None:
    """Join the world (rank `rank` of `world_size`) and form the model-parallel groups."""
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # a peer that has not joined in two minutes is gone (the default would wait half an hour)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=2))
    init_model_parallel(tensor_parallel_size)


def init_model_parallel(tensor_parallel_size: int) -> None:
    """Split the (initialised) world into tensor-parallel groups of consecutive ranks and
    pipeline-parallel groups across them (the world size over T is the number of stages)."""
    global _TP, _PP
    world_size = dist.get_world_size()
    tp = tensor_parallel_size
    # tensor-parallel groups: a stage's consecutive ranks; pipeline-parallel: one rank of each stage
    _TP = own_group([list(range(start, start + tp)) for start in range(0, world_size, tp)])
    _PP = own_group([list(range(first, world_size, tp)) for first in range(tp)])


def own_group(groups: list[list[int]]) -> GroupCoordinator:
    """Make every group (every rank takes part in making each); return this rank's."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = GroupCoordinator(ranks, group)
    return mine


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_tp_size() -> int:
    return _TP.world_size
