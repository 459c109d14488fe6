"""What a KV block's bytes mean: the layout two engines must share to use each other's blocks.

A block's keys and values are only the ones another engine would have computed if it runs the
same model (weights and all: a fine-tune must not read its base model's blocks), in the same
dtype, with the same block size, KV layers (EAGLE's draft layer is one more), KV heads, head
size and ranks. `kv_layout` writes that down; `layout_id` names it, so that a connector keeps
the blocks of each layout apart (shared storage: a folder per layout).
"""
import glob
import json
import os

import xxhash

from nanoinfer.config import Config, head_dim


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

