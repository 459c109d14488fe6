"""The shared-storage connector: KV blocks as files in a folder both engines can read.

Each full prompt block the producer computes is written by every rank as one safetensors file,
`{block hash}.r{rank}.safetensors`: that rank's keys and values of the block in all its layers,
[2, layers, block_size, kv_heads, head_dim], with the block's hash and a checksum of the data in
the file's metadata. Files are written under a temporary name and renamed when complete, so a
reader never sees half a file from a live writer; one that is truncated anyway (a full disk, a
crash) fails safetensors' own size check, and one whose bytes changed fails the checksum. The
scheduler counts a block as stored when every rank's file opens; the worker loads a block only
if its file's hash and checksum are right, so a bad block (and every one after it) is computed
again, never used.
"""
import os

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from nanoinfer.config import Config


class SharedStorageConnector:

    def __init__(self, config: Config, rank: int = 0):
        transfer = config.kv_transfer
        self.path = transfer.extra_config["shared_storage_path"]
        self.loads, self.saves = transfer.kv_role != "kv_producer", transfer.kv_role != "kv_consumer"
        self.rank, self.world_size = rank, config.world_size
        os.makedirs(self.path, exist_ok=True)
        self.num_loaded_blocks = self.num_saved_blocks = self.num_bad_blocks = 0

    def file(self, block_hash: int, rank: int) -> str:
        return os.path.join(self.path, f"{block_hash:032x}.r{rank}.safetensors")

    # the scheduler's side

    def num_matched_blocks(self, block_hashes: list[int]) -> int:
        """How many of these blocks, in order, are stored (by every rank)."""
        if not self.loads:
            return 0
        for n, block_hash in enumerate(block_hashes):
            for rank in range(self.world_size):
                try:
                    with safe_open(self.file(block_hash, rank), "pt"):
                        pass
                except Exception:   # missing, or not whole
                    return n
        return len(block_hashes)

    # the worker's side

    def load_kv(self, blocks: list[tuple[int, int]], kv_cache: torch.Tensor) -> int:
        """Fill these (block id, hash) blocks of this rank's cache; how many, in order, were good."""
        for n, (block_id, block_hash) in enumerate(blocks):
            try:
                with safe_open(self.file(block_hash, self.rank), "pt") as f:
                    meta, kv = f.metadata(), f.get_tensor("kv")
            except Exception:
                meta, kv = {}, None
            if (kv is None or meta.get("block_hash") != f"{block_hash:032x}" or meta.get("checksum") != checksum(kv)
                    or kv.shape != kv_cache[:, :, block_id].shape or kv.dtype != kv_cache.dtype):
                self.num_bad_blocks += 1
                return n
            kv_cache[:, :, block_id] = kv.to(kv_cache.device)
            self.num_loaded_blocks += 1
        return len(blocks)

    def save_kv(self, blocks: list[tuple[int, int]], kv_cache: torch.Tensor) -> None:
        """Write these (block id, hash) blocks of this rank's cache (the step's forward must have
        run: copying them to the host waits for it), unless they are stored already."""
        for block_id, block_hash in blocks:
            path = self.file(block_hash, self.rank)
            if os.path.exists(path):
                continue
            kv = kv_cache[:, :, block_id].contiguous().cpu()
            temp = f"{path}.{os.getpid()}.tmp"
            save_file({"kv": kv}, temp, metadata={"block_hash": f"{block_hash:032x}", "checksum": checksum(kv)})
            os.replace(temp, path)
            self.num_saved_blocks += 1


    def shutdown(self) -> None:
        pass


def checksum(t: torch.Tensor) -> str:
    return xxhash.xxh64_hexdigest(t.contiguous().view(torch.uint8).numpy())
