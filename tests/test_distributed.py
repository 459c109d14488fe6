"""The tensor-parallel group is a group of its own, not the world: two processes over gloo, cut
into two groups of one rank (as data-parallel replicas would be) and then one group of two."""
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, init_file: str) -> None:
    from nanoinfer import distributed
    from nanoinfer.layers.linear import ColumnParallelLinear
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = distributed.init_tensor_parallel(1)   # two replicas, each its own group
        assert (group.ranks, group.world_size, group.rank_in_group) == ([rank], 1, 0)
        assert ColumnParallelLinear(8, 6).weight.shape == (6, 8)
        assert group.all_reduce(torch.tensor([rank + 1.0])).item() == rank + 1   # no sum over the world
        distributed.destroy_tensor_parallel()
        group = distributed.init_tensor_parallel(2)
        assert (group.world_size, group.rank_in_group) == (2, rank)
        layer = ColumnParallelLinear(8, 6)
        assert layer.weight.shape == (3, 8) and layer.tp_group is group
        assert group.all_reduce(torch.tensor([rank + 1.0])).item() == 3
        assert distributed.get_tp_group() is group
        gathered = distributed.get_tp_group().gather(torch.tensor([[rank]]))
        assert gathered.tolist() == [[0, 1]] if rank == 0 else gathered is None
        assert distributed.get_tp_group().broadcast(torch.tensor([rank + 5])).item() == 5
        distributed.destroy_tensor_parallel()
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_group_is_not_the_world(tmp_path):
    mp.spawn(worker, args=(str(tmp_path / "init"),), nprocs=2)
