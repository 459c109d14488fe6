"""KV connectors: a request's prompt KV cache from outside the engine, and to it (vLLM V1's split).

Disaggregated serving runs the prefill of a request in one engine (the producer) and its decode
in another (the consumer): the producer computes the prompt's keys and values and hands them over,
the consumer computes only what it was not given. A connector has two sides:

- the scheduler's (engine core, `Scheduler`): how many of a waiting request's full prompt blocks,
  after those in its own prefix cache, can come from outside (`num_matched_blocks`). The
  scheduler then admits the request with blocks for them and no tokens to compute: the step
  message asks the runner to fill those blocks (`SchedulerOutput.kv_loads`), and the request
  waits (WAITING_FOR_REMOTE_KVS) until the step's output says how many of them were filled with
  valid data. It counts those as computed (and enters them in its prefix cache) and computes the
  rest like any prompt. Each step also lists the full prompt blocks it computes, to be saved
  (`SchedulerOutput.kv_saves`);
- the worker's (`ModelRunner`, on every rank): before the forward, fill the blocks to load
  (`load_kv`: a rank stops at the first block whose data is missing or fails its check, and the
  ranks agree on the smallest count); after it, save the blocks to save (`save_kv`).

A block is named by its prefix hash (`Sequence.block_hashes`: equal hashes, equal whole
prefixes), so a consumer finds the KV of any prefix the producer computed, whoever asked for it.
`kv_role` says which sides act: "kv_producer" saves, "kv_consumer" loads, "kv_both" does both.

Two connectors: SharedStorageConnector (shared_storage.py: files in a folder) and P2pConnector
(p2p.py: a prefill engine sends straight to a decode engine over torch.distributed). An engine
of one rank has one connector object for both sides; with several ranks, every worker has its
own and the engine core one more for the scheduler's side. A producer saves off the step loop
(saver.py): a thread writes or sends a step's blocks while the next step runs, and the step's
output is reported once they are saved, so a request the producer has answered finds its blocks.

Bytes are only meaningful to an engine that would have computed the same ones: the same model
(weights and all, so a fine-tune does not read its base model's blocks), dtype, block size, KV
layers (EAGLE's draft layer is one more), KV heads, head size and ranks. `kv_layout` writes all
of that down; shared storage keeps each layout's blocks in a folder of its own, and the two ends
of a point-to-point link compare theirs before the first block.

What each connector promises under faults (an idle link, a peer gone, a full disk, a mismatch):
docs/ARCHITECTURE.md section 14.
"""
import glob
import json
import os

import xxhash

from nanoinfer.config import Config, head_dim


def make_kv_connector(config: Config, rank: int | None = 0):
    """The configured connector (None if none is); `rank` is the worker's, in the world (None:
    the engine core's, for the scheduler's side only, beside workers of their own)."""
    if config.kv_transfer is None:
        return None
    if config.kv_transfer.kv_connector == "P2pConnector":
        from nanoinfer.kv_transfer.p2p import P2pConnector
        return P2pConnector(config, rank)
    from nanoinfer.kv_transfer.shared_storage import SharedStorageConnector
    return SharedStorageConnector(config, rank)


def kv_layout(config: Config) -> dict:
    """What a block's bytes are: the model, its dtype and the KV cache's shape and ranks."""
    hf = config.hf_config
    eagle = config.num_lookahead_tokens > 0   # (EAGLE's draft layer is one more KV layer)
    return {"model": model_fingerprint(config.model, config.load_format, config.seed),
            "draft_model": model_fingerprint(config.speculative.model) if eagle else None,
            "dtype": str(config.torch_dtype), "block_size": config.block_size,
            "num_layers": hf.num_hidden_layers + eagle, "num_kv_heads": hf.num_key_value_heads,
            "head_dim": head_dim(hf), "tensor_parallel_size": config.tensor_parallel_size,
            "pipeline_parallel_size": config.pipeline_parallel_size}


def model_fingerprint(path: str, load_format: str = "auto", seed: int = 0) -> str:
    """A hash of a model folder's config.json and weights: each file's header (the tensors'
    names, shapes and offsets) and three 4 KiB samples of every tensor's data (fine-tuning
    changes every element of a tensor it trains), so it costs milliseconds even for a large
    model. Random weights are named by their seed."""
    digest = xxhash.xxh64()
    with open(os.path.join(path, "config.json"), "rb") as f:
        digest.update(f.read())
    if load_format == "dummy":
        digest.update(f"dummy weights, seed {seed}".encode())
        return digest.hexdigest()
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = f.read(size)
            digest.update(header)
            for name, tensor in sorted(json.loads(header).items()):
                start, end = tensor["data_offsets"] if name != "__metadata__" else (0, 0)
                for at in (start, (start + end) // 2, end - 4096):
                    f.seek(8 + size + max(start, at))
                    digest.update(f.read(min(4096, end - start)))
    return digest.hexdigest()


def layout_id(layout: dict) -> str:
    return xxhash.xxh64_hexdigest(json.dumps(layout, sort_keys=True).encode())


def layout_differences(ours: dict, theirs: dict) -> str:
    return "; ".join(f"{key}: ours {ours.get(key)!r}, theirs {theirs.get(key)!r}"
                     for key in sorted(set(ours) | set(theirs)) if ours.get(key) != theirs.get(key))
