"""Assignment 11: a KV connector, shared storage.

Graded: `SharedStorageConnector.num_matched_blocks` over every pattern of stored and missing
blocks (every rank's file, truncated files, a producer that loads nothing); `read` on good files
and on files cut short, changed, or made for another block or layout; `write_block`: the file's
format, the temporary name and the rename, failures that leave nothing behind, and a block
stored whole that is not written again; `load_kv` on random runs of good and bad blocks,
against what the files hold. End to end, a producer engine leaves its prompts' blocks in a folder
and a consumer engine loads them instead of computing them, with transformers' greedy tokens,
and computes a block whose file was corrupted rather than use it.
"""
import itertools
import os
import shutil

import pytest
import torch
from conftest import hf_greedy, random_prompts
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import nanoinfer.kv_transfer.shared_storage as shared_storage
from nanoinfer import LLM, SamplingParams
from nanoinfer.config import Config
from nanoinfer.core.sequence import Sequence
from nanoinfer.kv_transfer.shared_storage import STORED, SharedStorageConnector, checksum

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = [40, 57, 16, 5]   # full blocks: 2, 3, 0 (its last token is always computed), 0


def transfer(role: str, folder: str) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": folder}}


def make_connector(model: str, folder: str, role: str = "kv_both", rank: int | None = 0,
                   tensor_parallel_size: int = 1) -> SharedStorageConnector:
    config = Config(model, device="cpu", tensor_parallel_size=tensor_parallel_size,
                    kv_transfer_config=transfer(role, folder))
    return SharedStorageConnector(config, rank)


@pytest.fixture
def connector(llama_dir, tmp_path):
    """A connector of one rank that loads and saves ("kv_both"), over a fresh folder."""
    conn = make_connector(llama_dir, str(tmp_path))
    yield conn
    conn.shutdown()


def block_shape(conn: SharedStorageConnector) -> tuple[int, ...]:
    """[2, layers, block_size, kv_heads, head_dim]: one block of one rank's cache."""
    layout = conn.layout_dict
    return (2, layout["num_layers"], layout["block_size"], layout["num_kv_heads"],
            layout["head_dim"])


def random_block(conn: SharedStorageConnector, seed: int) -> torch.Tensor:
    return torch.randn(block_shape(conn), generator=torch.Generator().manual_seed(seed))


def name(block_hash: int) -> str:
    return f"{block_hash:032x}"


def store(conn: SharedStorageConnector, block_hash: int, block: torch.Tensor, rank: int = 0,
          metadata: dict | None = None) -> str:
    """A block's file in the connector's format, written here (`metadata` replaces fields)."""
    fields = {"block_hash": name(block_hash), "layout": conn.layout, "checksum": checksum(block)}
    os.makedirs(conn.path, exist_ok=True)
    save_file({"kv": block}, conn.file(block_hash, rank), metadata=fields | (metadata or {}))
    return conn.file(block_hash, rank)


def change_byte(path: str, offset_from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x5A]))


def cut(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def file_tensor(path: str) -> torch.Tensor:
    with safe_open(path, "pt") as f:
        return f.get_tensor("kv")


def file_metadata(path: str) -> dict:
    with safe_open(path, "pt") as f:
        return f.metadata()


def leftovers(conn: SharedStorageConnector) -> list[str]:
    """Files in the folder other than the blocks' and layout.json."""
    return [f for f in os.listdir(conn.path)
            if not f.endswith(".safetensors") and f != "layout.json"]


def test_num_matched_blocks(llama_dir, tmp_path):
    """num_matched_blocks counts the stored blocks in order, up to the first missing one"""
    hashes = [101, 202, 303, 404, 505]
    conn = make_connector(llama_dir, str(tmp_path), role="kv_consumer")
    block = random_block(conn, 0)
    assert conn.num_matched_blocks([]) == 0
    for present in itertools.product([True, False], repeat=len(hashes)):
        for block_hash, here in zip(hashes, present):
            if here:
                store(conn, block_hash, block)
            elif os.path.exists(conn.file(block_hash, 0)):
                os.remove(conn.file(block_hash, 0))
        want = present.index(False) if False in present else len(hashes)
        assert conn.num_matched_blocks(hashes) == want, present
    # All five stored; the third cut short (a writer that crashed): it is missing.
    for block_hash in hashes:
        store(conn, block_hash, block)
    cut(conn.file(303, 0), 100)
    assert conn.num_matched_blocks(hashes) == 2
    # A producer loads nothing, whatever is stored.
    producer = make_connector(llama_dir, str(tmp_path), role="kv_producer")
    assert producer.num_matched_blocks(hashes[:2]) == 0
    producer.shutdown()
    # Two ranks (the scheduler's side: rank None): a block counts when both files open.
    scheduler = make_connector(llama_dir, str(tmp_path), role="kv_consumer", rank=None,
                               tensor_parallel_size=2)
    for block_hash in hashes:
        store(scheduler, block_hash, block, rank=0)
        if block_hash != 404:
            store(scheduler, block_hash, block, rank=1)
    assert scheduler.num_matched_blocks(hashes) == 3
    assert scheduler.num_matched_blocks(hashes[1:3]) == 2


def test_read(connector):
    """read returns the stored block, and None for a file cut short, changed, or not this block"""
    block = random_block(connector, 1)
    path = store(connector, 7, block)
    got = connector.read(path, name(7))
    assert got is not None and got.dtype == block.dtype and torch.equal(got, block)
    assert connector.read(connector.file(8, 0), name(8)) is None   # no such file
    assert connector.read(path, name(8)) is None   # the file of another block
    size, data = os.path.getsize(path), block.nbytes
    for length in [0, 7, 40, size - data, size - data // 2, size - 1]:   # cut short
        shutil.copy(path, path + ".cut")
        cut(path + ".cut", length)
        assert connector.read(path + ".cut", name(7)) is None, length
    for offset in [1, data // 3, data]:   # one byte of the data changed: the checksum fails
        shutil.copy(path, path + ".changed")
        change_byte(path + ".changed", offset)
        assert connector.read(path + ".changed", name(7)) is None, offset
    wrong = {"block_hash": name(9), "layout": "0" * 16, "checksum": checksum(block * 2)}
    for field, value in wrong.items():   # metadata that says it is something else
        assert connector.read(store(connector, 7, block, metadata={field: value}), name(7)) is None
    save_file({"kv": block}, path)   # no metadata at all
    assert connector.read(path, name(7)) is None
    with open(path, "wb") as f:   # not a safetensors file
        f.write(b"\x10" + b"\x00" * 7 + b"not json, nor tensors")
    assert connector.read(path, name(7)) is None


def test_write_block_format(llama_dir, connector, tmp_path):
    """write_block writes the tensor "kv" with its hash, layout and checksum in the metadata"""
    for block_hash, dtype in [(11, torch.float32), (2**127 + 5, torch.bfloat16)]:
        block = random_block(connector, block_hash % 1000).to(dtype)
        assert connector.write_block(block_hash, block) is None
        with safe_open(connector.file(block_hash, 0), "pt") as f:
            assert list(f.keys()) == ["kv"]
        assert torch.equal(file_tensor(connector.file(block_hash, 0)), block)
        metadata = file_metadata(connector.file(block_hash, 0))
        assert metadata["block_hash"] == name(block_hash)
        assert metadata["layout"] == connector.layout
        assert metadata["checksum"] == checksum(block)
    # A connector of rank 1 (of two) writes its own file.
    rank1 = make_connector(llama_dir, str(tmp_path), rank=1, tensor_parallel_size=2)
    block = random_block(rank1, 3)
    assert rank1.write_block(12, block) is None
    assert torch.equal(file_tensor(rank1.file(12, 1)), block)
    assert not os.path.exists(rank1.file(12, 0))
    rank1.shutdown()


def test_write_block_is_atomic(connector, monkeypatch):
    """write_block writes under a temporary name and renames it; a failure leaves no file"""
    final = connector.file(21, 0)
    temps = []

    def recording(tensors, filename, *args, **kwargs):
        temps.append(filename)
        assert not os.path.exists(final), "wrote over the block's own name"
        save_file(tensors, filename, *args, **kwargs)
    monkeypatch.setattr(shared_storage, "save_file", recording)
    block = random_block(connector, 4)
    assert connector.write_block(21, block) is None
    assert len(temps) == 1 and temps[0] != final
    assert os.path.dirname(os.path.abspath(temps[0])) == connector.path   # (rename: one folder)
    assert torch.equal(file_tensor(final), block)
    assert leftovers(connector) == []

    def failing(tensors, filename, *args, **kwargs):   # a disk that fills up half-way
        temps.append(filename)
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("No space left on device")
    monkeypatch.setattr(shared_storage, "save_file", failing)
    error = connector.write_block(21, random_block(connector, 5))   # (other bytes: a new write)
    assert isinstance(error, Exception)   # returned, not raised
    assert len(temps) == 2 and temps[1] != temps[0]   # a name of its own for each write
    assert torch.equal(file_tensor(final), block)   # the old file stays
    assert connector.write_block(22, block) is not None
    assert not os.path.exists(connector.file(22, 0)) and leftovers(connector) == []
    monkeypatch.undo()
    shutil.rmtree(connector.path)   # the folder removed: an error, returned
    assert isinstance(connector.write_block(23, block), Exception)


def test_write_block_skips_a_stored_block(connector):
    """write_block does not write a block stored whole with the same bytes again"""
    block = random_block(connector, 6)
    path = connector.file(31, 0)
    assert connector.write_block(31, block) is None
    before = os.stat(path)
    assert connector.write_block(31, block.clone()) is STORED
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    other = random_block(connector, 7)   # other bytes: written
    assert connector.write_block(31, other) is None
    assert torch.equal(file_tensor(path), other)
    change_byte(path, 10)   # stored badly (bytes changed): replaced
    assert connector.write_block(31, other) is None
    assert torch.equal(file_tensor(path), other)
    store(connector, 31, other, metadata={"layout": "0" * 16})   # another layout's: replaced
    assert connector.write_block(31, other) is None
    assert file_metadata(path)["layout"] == connector.layout


STATUSES = ["good", "missing", "changed", "other block", "other shape", "other dtype"]


def test_load_kv(connector):
    """load_kv fills the blocks in order, stops at the first bad one and counts it"""
    num_blocks = 6
    shape = block_shape(connector)
    cache = torch.full((shape[0], shape[1], num_blocks, *shape[2:]), -7.0)

    @settings(max_examples=80, deadline=None, derandomize=True, report_multiple_bugs=False,
              phases=[Phase.generate, Phase.shrink],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(statuses=st.lists(st.sampled_from(STATUSES), max_size=5),
           block_ids=st.permutations(range(num_blocks)), seed=st.integers(0, 1000))
    def check(statuses, block_ids, seed):
        cache.fill_(-7.0)
        blocks = [(block_id, 1000 * seed + i) for i, block_id in enumerate(block_ids)]
        blocks, stored = blocks[:len(statuses)], {}
        for (block_id, block_hash), status in zip(blocks, statuses):
            block = random_block(connector, block_hash)
            path = store(connector, block_hash, block)
            stored[block_id] = block
            if status == "missing":
                os.remove(path)
            elif status == "changed":
                change_byte(path, 1)
            elif status == "other block":
                store(connector, block_hash, block, metadata={"block_hash": name(block_hash + 1)})
            elif status == "other shape":   # (one that broadcasts into the block)
                store(connector, block_hash, block[:1])
            elif status == "other dtype":
                store(connector, block_hash, block.double())
        good = next((i for i, status in enumerate(statuses) if status != "good"), len(statuses))
        loaded, bad = connector.num_loaded_blocks, connector.num_bad_blocks
        assert connector.load_kv(blocks, cache) == good, statuses
        for i, (block_id, _) in enumerate(blocks):
            if i < good:
                assert torch.equal(cache[:, :, block_id], stored[block_id]), (statuses, i)
        filled = {block_id for block_id, _ in blocks[:good]}
        for block_id in set(range(num_blocks)) - filled:   # nothing else touched
            assert (cache[:, :, block_id] == -7.0).all(), (statuses, block_id)
        assert connector.num_loaded_blocks - loaded == good
        assert connector.num_bad_blocks - bad == (1 if good < len(blocks) else 0)
    check()


# End to end: a producer engine, then consumer engines over its folder.

def run(model: str, prompts: list, params: SamplingParams, role: str, folder: str):
    """The outputs, and the worker's connector. Shutting the engine down waits for its saves."""
    llm = LLM(model, max_model_len=128, enforce_eager=True,
              kv_transfer_config=transfer(role, folder))
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, llm.llm_engine.model_executor.kv_connector
    finally:
        llm.shutdown()


@pytest.fixture
def produced(llama_dir, tmp_path) -> tuple[str, list]:
    """A producer's run with max_tokens=1: the prompts' full blocks are left in the folder."""
    prompts = random_prompts(LENGTHS, seed=11)
    run(llama_dir, prompts, SamplingParams(max_tokens=1), "kv_producer", str(tmp_path))
    return str(tmp_path), prompts


def block_files(model: str, folder: str, prompt: list[int]) -> list[str]:
    """The files of the prompt's full blocks, by their prefix hashes."""
    conn = make_connector(model, folder, role="kv_consumer")
    return [conn.file(h, 0) for h in Sequence(0, prompt, GREEDY, 12, 16).block_hashes]


def test_consumer_loads_the_producers_blocks(llama_dir, produced):
    """End to end: a consumer loads the producer's prompt blocks and gives transformers' tokens"""
    folder, prompts = produced
    outputs, consumer = run(llama_dir, prompts, GREEDY, "kv_consumer", folder)
    assert [o.outputs[0].token_ids for o in outputs] == \
        [hf_greedy(llama_dir, p, 12) for p in prompts]
    # every full prompt block loaded, not computed (the last prompt token is always computed)
    assert [o.num_cached_tokens for o in outputs] == [32, 48, 0, 0]
    assert consumer.num_loaded_blocks == 5 and consumer.num_bad_blocks == 0


def test_consumer_computes_a_corrupted_block(llama_dir, produced):
    """End to end: a block whose file was damaged is computed by the consumer, never used"""
    folder, prompts = produced
    cut(block_files(llama_dir, folder, prompts[0])[0], 200)   # prompt 0: its first block cut short
    change_byte(block_files(llama_dir, folder, prompts[1])[1], 20)   # prompt 1: its second changed
    outputs, consumer = run(llama_dir, prompts, GREEDY, "kv_consumer", folder)
    assert [o.outputs[0].token_ids for o in outputs] == \
        [hf_greedy(llama_dir, p, 12) for p in prompts]
    assert [o.num_cached_tokens for o in outputs] == [0, 16, 0, 0]
    assert consumer.num_loaded_blocks == 1 and consumer.num_bad_blocks == 1
