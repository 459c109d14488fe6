"""The shared-storage connector: KV blocks as files in a folder both engines can read.

Blocks live in a folder per KV layout (layout.py): `{path}/{layout id}/`, with a
`layout.json` saying what that is, so engines of different models (a base model and its
fine-tune, say), dtypes, block sizes or ranks can share a path and never read each other's bytes.
Each full prompt block the producer computes is written by every rank as one safetensors file,
`{block hash}.r{rank}.safetensors`: that rank's keys and values of the block in all its layers,
[2, layers, block_size, kv_heads, head_dim], with the block's hash, the layout and a checksum of
the data in the file's metadata.

Writing is off the step loop (saver.py): a step's blocks come to the host in one copy (into
pinned memory kept for the next step) and four threads write their files at once. A file is
written under a temporary name unique to the
host, process and write, and renamed when complete, so a reader never sees half a file from a
live writer; one that is truncated anyway (a crash) fails safetensors' own size check, and one
whose bytes changed fails the checksum. A block already stored whole with these very bytes is not
written again; one stored badly is replaced. A write that fails (a full disk, a folder removed or
read-only) is counted and logged (once, until a write succeeds again): the producer goes on, and
a consumer computes those blocks. The scheduler counts a block as stored when every rank's file
opens; the worker loads a block only if its file's hash, layout and checksum are right, so a bad
block (and every one after it) is computed again, never used.
"""
import contextlib
import json
import logging
import os
import secrets
import socket
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from nanoinfer.config import Config
from nanoinfer.kv_transfer.layout import kv_layout, layout_id
from nanoinfer.kv_transfer.saver import KVSaver

logger = logging.getLogger("nanoinfer")
STORED = object()   # a block's file is there already, whole and equal


class SharedStorageConnector:

    def __init__(self, config: Config, rank: int | None = 0):
        transfer = config.kv_transfer
        self.layout_dict = kv_layout(config)
        self.layout = layout_id(self.layout_dict)
        self.path = os.path.join(transfer.extra_config["shared_storage_path"], self.layout)
        self.loads, self.saves = (transfer.kv_role != r for r in ("kv_producer", "kv_consumer"))
        self.rank = rank
        self.world_size = config.world_size
        self.num_loaded_blocks = self.num_saved_blocks = self.num_bad_blocks = 0
        self.num_failed_saves = 0
        self.failing = False
        self.saver = None
        self.device_bytes = 0   # (copies queued on the device, at most)
        self.host = None
        self.pool = ThreadPoolExecutor(4, "nanoinfer-kv-file")
        if self.saves and rank is not None:   # (rank None: the scheduler's side only)
            self.write_layout(self.layout_dict)
            self.device_bytes = transfer.extra_config.get("kv_buffer_size", 2**30)
            self.saver = KVSaver(self.write, self.device_bytes, "nanoinfer-kv-writer")

    def file(self, block_hash: int, rank: int) -> str:
        return os.path.join(self.path, f"{block_hash:032x}.r{rank}.safetensors")

    def write_layout(self, layout: dict) -> None:
        try:
            os.makedirs(self.path, exist_ok=True)
            with open(os.path.join(self.path, "layout.json"), "w") as f:
                json.dump(layout, f, indent=1)
        except OSError as e:
            self.failed(e)

    # the scheduler's side

    def num_matched_blocks(self, block_hashes: list[int]) -> int:
        """How many of these blocks, in order, are stored (by every rank).

        A block is stored when the file of each rank (`file(block_hash, rank)`, rank 0 to
        world_size - 1) opens with safetensors' `safe_open` (one cut short fails its size check);
        the count stops at the first block that is not. A connector that does not load (a
        producer) matches nothing: 0. The scheduler's side: it calls this when it admits a
        request, with the hashes of the prompt blocks after those in its own prefix cache."""
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
        """Fill these (block id, hash) blocks of this rank's cache; how many, in order, were
        good.

        `kv_cache` is [2, layers, num_blocks, block_size, kv_heads, head_dim]; block `block_id`
        is `kv_cache[:, :, block_id]`. Each block in turn: its file (this rank's) is `read`, and
        is good if it gives a tensor of that block's shape and dtype, which is copied in (and
        counted in `num_loaded_blocks`). The first bad block is counted in `num_bad_blocks` and
        ends the loading: it and the blocks after it are left as they are, to be computed."""
        for n, (block_id, block_hash) in enumerate(blocks):
            kv = self.read(self.file(block_hash, self.rank), f"{block_hash:032x}")
            expected = kv_cache[:, :, block_id].shape, kv_cache.dtype
            if kv is None or (kv.shape, kv.dtype) != expected:
                self.num_bad_blocks += 1
                return n
            kv_cache[:, :, block_id] = kv.to(kv_cache.device)
            self.num_loaded_blocks += 1
        return len(blocks)

    def read(self, path: str, block_hash: str) -> torch.Tensor | None:
        """The block in this file, if it is whole and is what its metadata says it is.

        `block_hash` is the hash as 32 hex digits (`f"{hash:032x}"`). The file holds one tensor,
        "kv", and in its metadata "block_hash", "layout" (`self.layout`) and "checksum"
        (`checksum(kv)`). The tensor if all three are right; None if they are not, or if the file
        is missing or does not open or read whole (never an exception)."""
        try:
            with safe_open(path, "pt") as f:
                meta, kv = f.metadata() or {}, f.get_tensor("kv")
        except Exception:
            return None
        wanted = {"block_hash": block_hash, "layout": self.layout, "checksum": checksum(kv)}
        return kv if all(meta.get(k) == v for k, v in wanted.items()) else None

    def save_kv(self, blocks: list[tuple[int, int]], kv_cache: torch.Tensor) -> int:
        """Queue these (block id, hash) blocks of this rank's cache for writing; a ticket."""
        return self.saver.put(blocks, kv_cache)

    def write(self, hashes: list[int], kv: torch.Tensor) -> None:
        """The writer thread's: each block's file, unless it is stored already. The step's blocks
        come to the host in one copy into pinned memory kept for the next, and the files are
        written by a few threads at once (the work is in the file system, not in Python)."""
        if kv.is_cuda:
            if self.host is None or len(self.host) < len(kv):
                self.host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            kv = self.host[:len(kv)].copy_(kv)
        if self.failing:   # (a folder removed since is made again)
            self.write_layout(self.layout_dict)
        for error in self.pool.map(self.write_block, hashes, kv):
            if error is None:
                self.num_saved_blocks += 1
                self.failing = False
            elif error is not STORED:
                self.failed(error)

    def write_block(self, block_hash: int, block: torch.Tensor) -> Exception | object | None:
        """Write one block's file (None), unless it is there whole (STORED); or the error.

        The file is `file(block_hash, self.rank)`, in `read`'s format, written with `save_file`
        under a temporary name in the same folder (unique to the host, the process and the
        write) and then renamed (`os.replace`), so that no reader sees half a file. A block whose
        file `read` gives with equal bytes is STORED, not written again; a bad one is replaced.
        A failure (an OSError, safetensors' own errors) removes the temporary file and is
        returned, never raised: the writer thread counts it."""
        path, name = self.file(block_hash, self.rank), f"{block_hash:032x}"
        if (stored := self.read(path, name)) is not None and torch.equal(stored, block):
            return STORED
        temp = f"{path}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            save_file({"kv": block}, temp, metadata={"block_hash": name, "layout": self.layout,
                                                     "checksum": checksum(block)})
            os.replace(temp, path)
        except Exception as e:   # (safetensors' own errors are not OSErrors)
            with contextlib.suppress(OSError):
                os.remove(temp)
            return e
        return None

    def failed(self, error: Exception) -> None:
        self.num_failed_saves += 1
        if not self.failing:
            logger.warning("shared storage: saving KV blocks in %s failed (%s); the producer goes "
                           "on, and consumers compute what is missing", self.path, error)
        self.failing = True

    def stats(self) -> dict[str, int]:
        return {"loaded_blocks": self.num_loaded_blocks, "saved_blocks": self.num_saved_blocks,
                "bad_blocks": self.num_bad_blocks, "failed_saves": self.num_failed_saves}

    def shutdown(self) -> None:
        if self.saver is not None:
            self.saver.close()
        self.pool.shutdown(wait=False)   # (idle once the saver is done)
        self.host = None   # (pinned memory)


def checksum(t: torch.Tensor) -> str:
    return xxhash.xxh64_hexdigest(t.contiguous().view(torch.uint8).numpy())
