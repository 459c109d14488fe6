"""The model-parallel groups are groups of their own, not the world: two processes over gloo, cut
into two pipeline stages of one rank each (tensor-parallel groups of one), then into one stage
of two tensor-parallel ranks."""
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def destroy_model_parallel() -> None:
    """Back to one rank: the model-parallel groups destroyed."""
    from nanoinfer import distributed
    for group in {distributed._TP.group, distributed._PP.group} - {None}:
        dist.destroy_process_group(group)
    distributed._TP = distributed._PP = distributed.GroupCoordinator([0])


def worker(rank: int, init_file: str) -> None:
    from nanoinfer import distributed
    from nanoinfer.layers.linear import ColumnParallelLinear
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        distributed.init_model_parallel(1)   # two stages: each rank its own tensor-parallel group
        tp, pp = distributed.get_tp_group(), distributed.get_pp_group()
        assert (tp.ranks, tp.world_size, tp.rank_in_group) == ([rank], 1, 0)
        assert (pp.ranks, pp.rank_in_group, pp.is_first, pp.is_last) == ([0, 1], rank, rank == 0, rank == 1)
        assert ColumnParallelLinear(8, 6).weight.shape == (6, 8)
        assert tp.all_reduce(torch.tensor([rank + 1.0])).item() == rank + 1   # no sum over the world
        if pp.is_first:
            pp.send_next(torch.tensor([7.0, 8.0]))
        else:
            assert pp.recv_prev(torch.empty(2)).tolist() == [7.0, 8.0]
        destroy_model_parallel()
        distributed.init_model_parallel(2)   # one stage of two ranks
        group, pp = distributed.get_tp_group(), distributed.get_pp_group()
        assert (group.world_size, group.rank_in_group) == (2, rank)
        assert (pp.ranks, pp.is_first, pp.is_last) == ([rank], True, True)
        layer = ColumnParallelLinear(8, 6)
        assert layer.weight.shape == (3, 8) and layer.tp_group is group
        assert group.all_reduce(torch.tensor([rank + 1.0])).item() == 3
        gathered = group.gather(torch.tensor([[rank]]))
        assert gathered.tolist() == [[0, 1]] if rank == 0 else gathered is None
        assert group.broadcast(torch.tensor([rank + 5])).item() == 5
        destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def test_model_parallel_groups_are_not_the_world(tmp_path):
    mp.spawn(worker, args=(str(tmp_path / "init"),), nprocs=2)
