"""Assignment 8: tensor-parallel linear layers.

Graded over gloo with two CPU processes (ranks), started once for the whole file: on each rank
every kind of layer is built, loaded through its weight loaders from a safetensors checkpoint
(lazy slices, as the engine's loader passes them), and run. Each criterion checks its part of
what the ranks got against one dense `nn.Linear` per checkpoint matrix, computed here in one
process: the slice each rank holds, and the outputs (concatenated over the ranks for the
column-parallel layers; all-reduced, on every rank, for the row-parallel one). Last, the engine
with two ranks gives transformers' greedy tokens.
"""
import multiprocessing
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import hf_greedy, random_prompts
from safetensors import safe_open
from safetensors.torch import save_file

from nanoinfer import LLM, SamplingParams

TP = 2                          # ranks
HIDDEN, HEAD_DIM = 16, 4        # the layers' input size; attention's head size
GATE, UP = 8, 12                # gate_up: two shards of different sizes
ROW_IN = 12                     # the row-parallel layer's input size (split), output HIDDEN
NUM_TOKENS = 5
TIMEOUT_S = 150                 # for the two ranks together, start-up included


def checkpoint() -> dict[str, torch.Tensor]:
    """The full (dense) checkpoint tensors, and the input activations."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g)
    tensors = {"x": randn(NUM_TOKENS, HIDDEN), "row.x": randn(NUM_TOKENS, ROW_IN),
               "col.weight": randn(12, HIDDEN), "col.bias": randn(12),
               "gate.weight": randn(GATE, HIDDEN), "gate.bias": randn(GATE),
               "up.weight": randn(UP, HIDDEN), "up.bias": randn(UP),
               "row.weight": randn(HIDDEN, ROW_IN), "row.bias": randn(HIDDEN)}
    for name, kv_heads in (("gqa", 2), ("kv1", 1)):   # 4 query heads; 2 KV heads, or 1
        for proj, heads in (("q", 4), ("k", kv_heads), ("v", kv_heads)):
            tensors[f"{name}.{proj}.weight"] = randn(heads * HEAD_DIM, HIDDEN)
            tensors[f"{name}.{proj}.bias"] = randn(heads * HEAD_DIM)
    return tensors


def dense(tensors: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    """The oracle: one checkpoint matrix as a plain nn.Linear."""
    weight = tensors[f"{name}.weight"]
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(tensors[f"{name}.bias"])
        return linear(x)


# ---- what each rank does (in its own process) ----

def load(layer, f, shards: dict) -> None:
    """Load every parameter of `layer` through its weight_loader: shards maps a shard id (None:
    an unpacked layer) to its checkpoint name."""
    for kind in ("weight", "bias"):
        param = getattr(layer, kind)
        for shard_id, name in shards.items():
            tensor = f.get_slice(f"{name}.{kind}")   # lazy, as the engine's loader passes it
            if shard_id is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)


def loaded(layer, x: torch.Tensor) -> dict:
    return {"weight": layer.weight.detach().clone(), "bias": layer.bias.detach().clone(),
            "out": layer(x).detach().clone()}


def attempt(results: dict, key: str, work) -> None:
    """results[key] = work(), or the traceback of what it raised."""
    try:
        results[key] = work()
    except Exception:
        results[key] = traceback.format_exc()


def row_forward(tensors: dict, rank: int, bias: bool) -> torch.Tensor:
    """RowParallelLinear.forward alone: the weights set directly (this rank's input columns,
    the full bias), not through the weight loader."""
    from nanoinfer.layers.linear import RowParallelLinear
    layer = RowParallelLinear(ROW_IN, HIDDEN, bias=bias)
    columns = slice(rank * ROW_IN // TP, (rank + 1) * ROW_IN // TP)
    with torch.no_grad():
        layer.weight.copy_(tensors["row.weight"][:, columns])
        if bias:
            layer.bias.copy_(tensors["row.bias"])
    return layer(tensors["row.x"][:, columns]).detach().clone()


def rank_main(rank: int, init_file: str, ckpt_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    results = {}
    try:
        from nanoinfer import distributed
        from nanoinfer.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                             QKVParallelLinear, RowParallelLinear)
        # a rank left waiting in a collective gives up after 30 s
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=TP, timeout=timedelta(seconds=30))
        distributed.init_model_parallel(TP)
        with safe_open(ckpt_file, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            x = tensors["x"]

            def column():
                layer = ColumnParallelLinear(HIDDEN, 12, bias=True)
                load(layer, f, {None: "col"})
                return loaded(layer, x)

            def merged():
                layer = MergedColumnParallelLinear(HIDDEN, [GATE, UP], bias=True)
                load(layer, f, {0: "gate", 1: "up"})
                return loaded(layer, x)

            def qkv(name: str, kv_heads: int):
                layer = QKVParallelLinear(HIDDEN, HEAD_DIM, 4, kv_heads, bias=True)
                load(layer, f, {"q": f"{name}.q", "k": f"{name}.k", "v": f"{name}.v"})
                return loaded(layer, x)

            def row_loader():
                layer = RowParallelLinear(ROW_IN, HIDDEN, bias=True)
                load(layer, f, {None: "row"})
                return {"weight": layer.weight.detach().clone(),
                        "bias": layer.bias.detach().clone()}

            attempt(results, "column", column)
            attempt(results, "merged", merged)
            attempt(results, "gqa", lambda: qkv("gqa", 2))
            attempt(results, "kv1", lambda: qkv("kv1", 1))
            attempt(results, "row", row_loader)
            for bias in (True, False):
                attempt(results, f"row_forward_bias={bias}",
                        lambda: row_forward(tensors, rank, bias))
        dist.destroy_process_group()
    except Exception:
        results["rank"] = traceback.format_exc()
    torch.save(results, out_file)


@pytest.fixture(scope="session")
def ranks(tmp_path_factory) -> list[dict]:
    """Start two ranks, once: what each got, by layer (a dict of tensors, or a traceback)."""
    tmp = tmp_path_factory.mktemp("tp")
    ckpt = str(tmp / "model.safetensors")
    save_file(checkpoint(), ckpt)
    out_files = [str(tmp / f"rank{rank}.pt") for rank in range(TP)]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(rank, str(tmp / "init"), ckpt, out_files[rank]),
                         daemon=True) for rank in range(TP)]
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs:
            proc.join(max(deadline - time.monotonic(), 0))
    finally:
        for proc in procs:   # stopped whatever happened: a rank that hangs, a Ctrl-C
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [torch.load(path) if os.path.exists(path)
            else {"rank": f"rank {rank} did not finish within {TIMEOUT_S} s"}
            for rank, path in enumerate(out_files)]


def got(ranks: list[dict], key: str) -> list:
    """Each rank's result for `key`; fails with the rank's error if it raised."""
    for rank, results in enumerate(ranks):
        if "rank" in results:
            pytest.fail(f"rank {rank} failed:\n{results['rank']}")
        if isinstance(results[key], str):
            pytest.fail(f"rank {rank} raised:\n{results[key]}")
    return [results[key] for results in ranks]


def part(t: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s slice of `t` along `dim`: the r-th of TP equal parts."""
    return t.chunk(TP, dim)[rank]


@pytest.fixture(scope="session")
def tensors() -> dict[str, torch.Tensor]:
    return checkpoint()


def test_column_parallel(ranks, tensors):
    """ColumnParallelLinear: each rank loads its slice of the output rows (weight and bias)"""
    want = dense(tensors, "col", tensors["x"])
    results = got(ranks, "column")
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["weight"], part(tensors["col.weight"], rank))
        torch.testing.assert_close(result["bias"], part(tensors["col.bias"], rank))
    # each rank computes its own output features; side by side, they are the dense output
    torch.testing.assert_close(torch.cat([r["out"] for r in results], dim=1), want)


def test_merged_column_parallel(ranks, tensors):
    """MergedColumnParallelLinear: each rank holds its slice of each shard, shard after shard"""
    gate, up = dense(tensors, "gate", tensors["x"]), dense(tensors, "up", tensors["x"])
    for rank, result in enumerate(got(ranks, "merged")):
        for kind in ("weight", "bias"):
            torch.testing.assert_close(result[kind], torch.cat(
                [part(tensors[f"gate.{kind}"], rank), part(tensors[f"up.{kind}"], rank)]))
        # this rank's gate features, then its up features
        torch.testing.assert_close(result["out"], torch.cat([part(gate, rank, dim=1),
                                                             part(up, rank, dim=1)], dim=1))


def check_qkv(result: dict, tensors: dict, name: str, rank: int, kv_part) -> None:
    """q, k, v rows of one rank: its query heads, and the KV heads `kv_part` picks."""
    for kind in ("weight", "bias"):
        torch.testing.assert_close(result[kind], torch.cat(
            [part(tensors[f"{name}.q.{kind}"], rank), kv_part(tensors[f"{name}.k.{kind}"]),
             kv_part(tensors[f"{name}.v.{kind}"])]))
    # the outputs transposed, [features, tokens], so that the same slices pick this rank's
    q, k, v = (dense(tensors, f"{name}.{proj}", tensors["x"]).T for proj in "qkv")
    torch.testing.assert_close(result["out"].T, torch.cat([part(q, rank), kv_part(k), kv_part(v)]))


def test_qkv_parallel(ranks, tensors):
    """QKVParallelLinear: each rank holds its own query heads and KV heads"""
    # 4 query heads and 2 KV heads: rank r has query heads 2r, 2r + 1 and KV head r
    for rank, result in enumerate(got(ranks, "gqa")):
        check_qkv(result, tensors, "gqa", rank, lambda t: part(t, rank))


def test_qkv_parallel_shared_kv_head(ranks, tensors):
    """QKVParallelLinear with fewer KV heads than ranks: ranks share (replicate) a KV head"""
    # 4 query heads and 1 KV head: rank r has query heads 2r, 2r + 1, and both the KV head
    for rank, result in enumerate(got(ranks, "kv1")):
        check_qkv(result, tensors, "kv1", rank, lambda t: t)


def test_row_parallel_loader(ranks, tensors):
    """RowParallelLinear.weight_loader: each rank its slice of the input columns, the whole bias"""
    for rank, result in enumerate(got(ranks, "row")):
        torch.testing.assert_close(result["weight"], part(tensors["row.weight"], rank, dim=1))
        torch.testing.assert_close(result["bias"], tensors["row.bias"])


def test_row_parallel_forward(ranks, tensors):
    """RowParallelLinear.forward: the all-reduced sum is the dense output, bias added once"""
    with_bias = dense(tensors, "row", tensors["row.x"])
    without = F.linear(tensors["row.x"], tensors["row.weight"])
    for bias, want in ((True, with_bias), (False, without)):
        for out in got(ranks, f"row_forward_bias={bias}"):   # the same on every rank
            torch.testing.assert_close(out, want)


def test_end_to_end(llama_dir):
    """End to end: two tensor-parallel ranks give transformers' greedy tokens"""
    prompts = random_prompts([5, 23], seed=1)
    llm = LLM(llama_dir, tensor_parallel_size=2, max_model_len=128, enforce_eager=True)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(llama_dir, p, 8)
                                                         for p in prompts]
