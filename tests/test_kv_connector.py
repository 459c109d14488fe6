"""KV connectors. Shared storage: a producer engine leaves its prompts' KV blocks in a folder, a
consumer engine started later loads them instead of computing them, and gets exactly the tokens a
colocated engine gets; missing blocks are computed; a truncated or corrupted block is found (by
safetensors' size check, or the checksum) and computed again, never used, and the next save
replaces it; another model's blocks in the same folder are never read; a save that fails is
counted and logged, and the producer serves on."""
import glob
import logging
import os
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_greedy, random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.config import Config
from nanoinfer.kv_transfer.layout import kv_layout, layout_id

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = [40, 57, 16, 5]   # full blocks: 2, 3, 0 (16 tokens: the last one is always computed), 0


def transfer(role: str, path: str, **extra) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": path, **extra}}


def run(path: str, prompts: list, params: SamplingParams, **kwargs) -> tuple[list, object]:
    """The outputs, and the worker's connector (with one rank: the one in this process)."""
    llm = LLM(path, **kwargs)
    try:
        return llm.generate(prompts, params, use_tqdm=False), getattr(llm.llm_engine.model_executor,
                                                                         "kv_connector", None)
    finally:
        llm.shutdown()


def greedy(path: str, prompts: list) -> list[list[int]]:
    return [hf_greedy(path, p, 12) for p in prompts]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture
def stored(llama_dir, tmp_path) -> tuple[str, list]:
    """A producer's run with max_tokens=1: the prompts' full blocks are left in the folder."""
    prompts = random_prompts(LENGTHS, seed=11)
    _, producer = run(llama_dir, prompts, SamplingParams(max_tokens=1),
                      kv_transfer_config=transfer("kv_producer", str(tmp_path)))
    assert producer.num_saved_blocks == 2 + 3 + 1
    assert len(glob.glob(str(tmp_path / "*" / "*.safetensors"))) == 6
    return str(tmp_path), prompts


@pytest.fixture
def fine_tune(llama_dir, tmp_path_factory) -> str:
    """The same model with other weights: same config, names and shapes."""
    path = str(tmp_path_factory.mktemp("models") / "fine-tune")
    shutil.copytree(llama_dir, path)
    weights = load_file(os.path.join(path, "model.safetensors"))   # (one tensor of one layer)
    g, name = torch.Generator().manual_seed(5), "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name] + 0.05 * torch.randn(weights[name].shape, generator=g)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def test_a_consumer_computes_only_what_it_was_not_given(llama_dir, stored):
    folder, prompts = stored
    outputs, consumer = run(llama_dir, prompts, GREEDY, kv_transfer_config=transfer("kv_consumer", folder))
    assert tokens(outputs) == greedy(llama_dir, prompts)
    assert [o.num_cached_tokens for o in outputs] == [32, 48, 0, 0]   # all but the last partial block
    assert consumer.num_loaded_blocks == 5


def test_missing_and_bad_blocks_are_computed_and_saved_again(llama_dir, stored, monkeypatch):
    folder, prompts = stored
    blocks = block_hashes(prompts)
    os.remove(file(llama_dir, folder, blocks[0][1]))   # prompt 0: its second block is gone,
    save_file({"kv": torch.zeros(3)}, file(llama_dir, folder, blocks[0][0]))   # its first foreign
    with open(file(llama_dir, folder, blocks[1][1]), "r+b") as f:   # prompt 1: its second cut short
        f.truncate(os.path.getsize(f.name) - 100)
    with open(file(llama_dir, folder, blocks[1][0]), "r+b") as f:   # ... and its first corrupted
        f.seek(-50, os.SEEK_END)
        f.write(b"\xff" * 8)
    outputs, consumer = run(llama_dir, prompts, GREEDY, kv_transfer_config=transfer("kv_consumer", folder))
    assert tokens(outputs) == greedy(llama_dir, prompts)
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0, 0]
    assert consumer.num_bad_blocks == 2 and consumer.num_loaded_blocks == 0   # (the truncated: never asked)

    import nanoinfer.kv_transfer.shared_storage as shared_storage
    temps = []   # the next producer writes the four again (and only those), under unique names
    monkeypatch.setattr(shared_storage, "save_file", lambda t, name, **kw: (temps.append(name),
                                                                            save_file(t, name, **kw)))
    _, producer = run(llama_dir, prompts, SamplingParams(max_tokens=1),
                      kv_transfer_config=transfer("kv_producer", folder))
    assert producer.num_saved_blocks == 4   # (each name: the file's, the host, the pid, a random part)
    suffixes = {name.split(".safetensors.")[1] for name in temps}
    assert len(suffixes) == 4 and all(f"{socket.gethostname()}.{os.getpid()}." in x for x in suffixes)
    outputs, consumer = run(llama_dir, prompts, GREEDY, kv_transfer_config=transfer("kv_consumer", folder))
    assert [o.num_cached_tokens for o in outputs] == [32, 48, 0, 0] and consumer.num_bad_blocks == 0


def test_two_models_over_one_folder_never_read_each_others_blocks(llama_dir, fine_tune, stored):
    folder, prompts = stored
    outputs, consumer = run(fine_tune, prompts, GREEDY, kv_transfer_config=transfer("kv_both", folder))
    assert tokens(outputs) == greedy(fine_tune, prompts)
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0, 0] and consumer.num_loaded_blocks == 0
    assert len(os.listdir(folder)) == 2   # a folder per layout, each saying what it holds
    outputs, _ = run(llama_dir, prompts, GREEDY, kv_transfer_config=transfer("kv_consumer", folder))
    assert [o.num_cached_tokens for o in outputs] == [32, 48, 0, 0]
    assert tokens(outputs) == greedy(llama_dir, prompts)
    mine = file(llama_dir, folder, block_hashes(prompts)[0][0])   # a file moved between folders
    shutil.copy(file(fine_tune, folder, block_hashes(prompts)[0][0]), mine)
    outputs, consumer = run(llama_dir, prompts[:1], GREEDY,
                            kv_transfer_config=transfer("kv_consumer", folder))
    assert consumer.num_bad_blocks == 1 and outputs[0].num_cached_tokens == 0
    assert tokens(outputs) == greedy(llama_dir, prompts[:1])


def test_a_fingerprint_sees_one_tensor_changed(tmp_path):
    from nanoinfer.kv_transfer.layout import model_fingerprint
    weights = {f"layers.{i}.weight": torch.randn(256, 256) for i in range(64)}   # 16 MiB
    for name in ("base", "copy", "tuned"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        if name == "tuned":
            weights["layers.41.weight"] = weights["layers.41.weight"] + 0.01
        save_file(weights, str(tmp_path / name / "model.safetensors"))
    base, copy, tuned = (model_fingerprint(str(tmp_path / n)) for n in ("base", "copy", "tuned"))
    assert base == copy != tuned


def test_a_failed_save_never_stops_the_producer(llama_dir, tmp_path, caplog):
    prompts = random_prompts(LENGTHS, seed=14)
    config = transfer("kv_producer", str(tmp_path))
    blocked = tmp_path / layout_id(kv_layout(Config(llama_dir, device="cpu", kv_transfer_config=config)))
    blocked.write_text("a file where the folder should be")   # (fails for root too, unlike chmod)
    llm = LLM(llama_dir, kv_transfer_config=config)
    try:
        with caplog.at_level(logging.WARNING, logger="nanoinfer"):
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert tokens(outputs) == greedy(llama_dir, prompts)
        stats = llm.llm_engine.engine_core.stats().kv_connector
        assert stats["failed_saves"] >= 6 and stats["saved_blocks"] == 0
        assert sum("saving KV blocks" in r.message for r in caplog.records) == 1   # logged once
        blocked.unlink()   # the folder can be made again: the next saves go through
        llm.generate(random_prompts([33], seed=15), GREEDY, use_tqdm=False)
        assert llm.llm_engine.engine_core.stats().kv_connector["saved_blocks"] == 2
    finally:
        llm.shutdown()


def test_a_step_is_reported_once_its_blocks_are_saved(llama_dir, tmp_path):
    """Back-pressure with room for one block at a time: every block is still saved, each before
    its request is answered."""
    llm = LLM(llama_dir, kv_transfer_config=transfer("kv_producer", str(tmp_path), kv_buffer_size=1))
    try:
        for n, prompt in enumerate(random_prompts([64, 48, 33], seed=16)):
            llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
            assert len(glob.glob(str(tmp_path / "*" / "*.safetensors"))) == [4, 7, 9][n]
    finally:
        llm.shutdown()


def test_tensor_parallel_producer_and_consumer(llama_dir, tmp_path):
    prompts = random_prompts([37, 50], seed=12)
    run(llama_dir, prompts, SamplingParams(max_tokens=1), tensor_parallel_size=2,
        kv_transfer_config=transfer("kv_producer", str(tmp_path)))
    assert len(glob.glob(str(tmp_path / "*" / "*.r1.safetensors"))) == 2 + 3   # every rank its own heads
    outputs, _ = run(llama_dir, prompts, GREEDY, tensor_parallel_size=2,
                     kv_transfer_config=transfer("kv_consumer", str(tmp_path)))
    assert tokens(outputs) == greedy(llama_dir, prompts)
    assert [o.num_cached_tokens for o in outputs] == [32, 48]


def test_bad_transfer_configs(llama_dir, tmp_path):
    for config, match in [({"kv_connector": "Nope", "kv_role": "kv_both"}, "kv_connector must be"),
                          (transfer("kv_sender", str(tmp_path)), "kv_role must be"),
                          ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}, "shared_storage_path"),
                          ({"kv_role": "kv_both", "extra": 1}, "must be a dict of")]:
        with pytest.raises(ValueError, match=match):
            Config(llama_dir, kv_transfer_config=config)


def block_hashes(prompts: list) -> list[list[int]]:
    from nanoinfer.core.sequence import Sequence
    return [Sequence(0, p, GREEDY, 12, 16).block_hashes for p in prompts]


def file(model: str, folder: str, block_hash: int) -> str:
    config = Config(model, device="cpu", kv_transfer_config=transfer("kv_consumer", folder))
    return os.path.join(folder, layout_id(kv_layout(config)), f"{block_hash:032x}.r0.safetensors")
