"""KV connectors. Shared storage: a producer engine leaves its prompts' KV blocks in a folder, a
consumer engine started later loads them instead of computing them, and gets exactly the tokens a
colocated engine gets; missing blocks are computed; a truncated or corrupted block is found (by
safetensors' size check, or the checksum) and computed again, never used. Point to point: a
producer process sends its blocks to a consumer over gloo, with the same result."""
import glob
import multiprocessing as mp
import os
import socket
import time

import pytest

from conftest import hf_greedy, random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.config import Config

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = [40, 57, 16, 5]   # full blocks: 2, 3, 0 (16 tokens: the last one is always computed), 0


def transfer(role: str, path: str) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": path}}


def run(path: str, prompts: list, params: SamplingParams, **kwargs) -> tuple[list, object]:
    """The outputs, and the worker's connector (with one rank: the one in this process)."""
    llm = LLM(path, **kwargs)
    try:
        return llm.generate(prompts, params, use_tqdm=False), getattr(llm.llm_engine.model_executor,
                                                                         "kv_connector", None)
    finally:
        llm.shutdown()


@pytest.fixture
def stored(llama_dir, tmp_path) -> tuple[str, list]:
    """A producer's run with max_tokens=1: the prompts' full blocks are left in the folder."""
    prompts = random_prompts(LENGTHS, seed=11)
    _, producer = run(llama_dir, prompts, SamplingParams(max_tokens=1),
                      kv_transfer_config=transfer("kv_producer", str(tmp_path)))
    assert producer.num_saved_blocks == 2 + 3 + 1
    assert len(glob.glob(str(tmp_path / "*.safetensors"))) == 6
    return str(tmp_path), prompts


def test_a_consumer_computes_only_what_it_was_not_given(llama_dir, stored):
    folder, prompts = stored
    outputs, consumer = run(llama_dir, prompts, GREEDY, kv_transfer_config=transfer("kv_consumer", folder))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(llama_dir, p, 12) for p in prompts]
    assert [o.num_cached_tokens for o in outputs] == [32, 48, 0, 0]   # all but the last partial block
    assert consumer.num_loaded_blocks == 5


def test_missing_and_bad_blocks_are_computed(llama_dir, stored):
    folder, prompts = stored
    blocks = [[h for h in seq_hashes] for seq_hashes in block_hashes(llama_dir, prompts)]
    os.remove(file(folder, blocks[0][1]))   # prompt 0: its second block is gone
    with open(file(folder, blocks[1][1]), "r+b") as f:   # prompt 1: its second block cut short
        f.truncate(os.path.getsize(f.name) - 100)
    with open(file(folder, blocks[1][0]), "r+b") as f:   # ... and its first corrupted
        f.seek(-50, os.SEEK_END)
        f.write(b"\xff" * 8)
    outputs, consumer = run(llama_dir, prompts, GREEDY, kv_transfer_config=transfer("kv_consumer", folder))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(llama_dir, p, 12) for p in prompts]
    assert [o.num_cached_tokens for o in outputs] == [16, 0, 0, 0]
    assert consumer.num_bad_blocks == 1 and consumer.num_loaded_blocks == 1   # (the truncated: never asked)


def test_tensor_parallel_producer_and_consumer(llama_dir, tmp_path):
    prompts = random_prompts([37, 50], seed=12)
    run(llama_dir, prompts, SamplingParams(max_tokens=1), tensor_parallel_size=2,
        kv_transfer_config=transfer("kv_producer", str(tmp_path)))
    assert len(glob.glob(str(tmp_path / "*.r1.safetensors"))) == 2 + 3   # every rank its own heads
    outputs, _ = run(llama_dir, prompts, GREEDY, tensor_parallel_size=2,
                     kv_transfer_config=transfer("kv_consumer", str(tmp_path)))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(llama_dir, p, 12) for p in prompts]
    assert [o.num_cached_tokens for o in outputs] == [32, 48]


def test_bad_transfer_configs(llama_dir, tmp_path):
    for config, match in [({"kv_connector": "Nope", "kv_role": "kv_both"}, "kv_connector must be"),
                          (transfer("kv_sender", str(tmp_path)), "kv_role must be"),
                          ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}, "shared_storage_path"),
                          ({"kv_role": "kv_both", "extra": 1}, "must be a dict of")]:
        with pytest.raises(ValueError, match=match):
            Config(llama_dir, kv_transfer_config=config)


def produce(path: str, prompts: list, port: int, sent) -> None:
    """The producer process: prefill the prompts (max_tokens=1); their blocks go to the consumer."""
    llm = LLM(path, device="cpu", kv_transfer_config={"kv_connector": "P2pConnector", "kv_role": "kv_producer",
                                                      "kv_connector_extra_config": {"kv_port": port}})
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    sent.put(llm.llm_engine.model_executor.kv_connector.num_saved_blocks)
    llm.shutdown()


def test_point_to_point_between_two_processes(llama_dir):
    prompts = random_prompts(LENGTHS, seed=13)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    sent = ctx.Queue()
    producer = ctx.Process(target=produce, args=(llama_dir, prompts, port, sent))
    producer.start()
    consumer = LLM(llama_dir, kv_transfer_config={"kv_connector": "P2pConnector", "kv_role": "kv_consumer",
                                                  "kv_connector_extra_config": {"kv_port": port}})
    try:
        num_sent, connector = sent.get(timeout=120), consumer.llm_engine.model_executor.kv_connector
        for _ in range(300):   # (until the receiving thread has every block)
            if len(connector.received) == num_sent:
                break
            time.sleep(0.1)
        outputs = consumer.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        consumer.shutdown()
        producer.join(60)
    assert num_sent == 6 and producer.exitcode == 0
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(llama_dir, p, 12) for p in prompts]
    assert [o.num_cached_tokens for o in outputs] == [32, 48, 0, 0]


def block_hashes(path: str, prompts: list) -> list[list[int]]:
    from nanoinfer.engine.sequence import Sequence
    return [Sequence(0, p, GREEDY, 12, 16).block_hashes for p in prompts]


def file(folder: str, block_hash: int) -> str:
    return os.path.join(folder, f"{block_hash:032x}.r0.safetensors")
