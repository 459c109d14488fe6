"""The point-to-point connector: a prefill engine sends its prompt blocks straight to a decode engine.

Both engines run one rank each (tensor_parallel_size = pipeline_parallel_size = 1). Their workers
form a process group of their own, two ranks over torch.distributed (NCCL between two GPUs, gloo
on the CPU): the producer rank 0, the consumer rank 1, meeting at a TCPStore whose address
kv_connector_extra_config gives ("kv_ip", default 127.0.0.1, and "kv_port"; the producer serves
it). Each full prompt block the producer computes goes out right after its step's forward: its
hash (two int64s), then its keys and values in every layer. The consumer's receiving thread keeps
what arrives by hash; a request with that prefix finds the blocks there (the scheduler's side)
and its step copies them into the request's own blocks (the worker's side). A block that has not
arrived yet is simply computed; one that two requests want in the same step goes to the first
(the other computes it).
"""
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from nanoinfer.config import Config

STOP = -1   # a header saying that the producer is done


class P2pConnector:

    def __init__(self, config: Config, rank: int = 0):
        if config.world_size != 1:
            raise ValueError("P2pConnector connects one-rank engines (tensor_parallel_size = pipeline_parallel_size = 1)")
        transfer, hf = config.kv_transfer, config.hf_config
        self.loads, self.saves = transfer.kv_role == "kv_consumer", transfer.kv_role == "kv_producer"
        self.device = torch.device("cuda" if config.device == "cuda" else "cpu")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.block_shape = (2, hf.num_hidden_layers, config.block_size, kv_heads, head_dim)
        self.dtype = config.torch_dtype
        extra, timeout = transfer.extra_config, timedelta(minutes=2)
        store = dist.TCPStore(extra.get("kv_ip", "127.0.0.1"), extra["kv_port"], 2, self.saves, timeout=timeout)
        group = dist.ProcessGroupNCCL if self.device.type == "cuda" else dist.ProcessGroupGloo
        self.group = group(store, 0 if self.saves else 1, 2, timeout)   # (waits for the other engine)
        self.received: dict[int, torch.Tensor] = {}   # the consumer's: block hash -> its K/V
        self.num_loaded_blocks = self.num_saved_blocks = self.num_bad_blocks = 0
        if self.loads:
            threading.Thread(target=self.receive, name="nanoinfer-kv-receiver", daemon=True).start()

    def receive(self) -> None:
        """The consumer's thread: blocks, by hash, until the producer stops (or is gone)."""
        while True:
            header = torch.empty(2, dtype=torch.int64, device=self.device)
            kv = torch.empty(self.block_shape, dtype=self.dtype, device=self.device)
            try:
                self.group.recv([header], 0, 0).wait()
                if header[0].item() == STOP:
                    return
                self.group.recv([kv], 0, 0).wait()
            except RuntimeError:   # the producer is gone: nothing more will come
                return
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            low, high = (int(x) % 2**64 for x in header.tolist())
            self.received[high << 64 | low] = kv

    # the scheduler's side

    def num_matched_blocks(self, block_hashes: list[int]) -> int:
        n = 0
        while self.loads and n < len(block_hashes) and block_hashes[n] in self.received:
            n += 1
        return n

    # the worker's side

    def load_kv(self, blocks: list[tuple[int, int]], kv_cache: torch.Tensor) -> int:
        for n, (block_id, block_hash) in enumerate(blocks):
            kv = self.received.pop(block_hash, None)
            if kv is None:
                return n
            kv_cache[:, :, block_id] = kv
            self.num_loaded_blocks += 1
        return len(blocks)

    def save_kv(self, blocks: list[tuple[int, int]], kv_cache: torch.Tensor) -> None:
        for block_id, block_hash in blocks:   # (NCCL's sends wait on the device for the forward)
            halves = [block_hash & (2**64 - 1), block_hash >> 64]
            header = torch.tensor([h - 2**64 if h >= 2**63 else h for h in halves], device=self.device)
            self.group.send([header], 1, 0).wait()
            self.group.send([kv_cache[:, :, block_id].contiguous()], 1, 0).wait()
            self.num_saved_blocks += 1

    def shutdown(self) -> None:
        if self.saves:   # the consumer's thread ends (unless the consumer is gone already)
            try:
                self.group.send([torch.tensor([STOP, 0], device=self.device)], 1, 0).wait()
            except RuntimeError:
                pass
