"""The point-to-point connector: a prefill engine sends its prompt blocks straight to a decoder.

Both engines run one rank each (tensor_parallel_size = pipeline_parallel_size = 1). The producer
serves a TCPStore at kv_connector_extra_config's "kv_ip" (default 127.0.0.1) and "kv_port"; the
store is the link's control channel, and a process group of two ranks (NCCL between two GPUs,
gloo on the CPU) carries the blocks.

- Pairing. The producer writes its KV layout (kv_transfer/__init__.py) in the store at start-up
  and waits for consumers on a thread of its own. A consumer, at start-up, reads that layout and
  writes its own: if they differ, it refuses to start (a ValueError naming what differs) and the
  producer logs the refusal; else the two form a process group of their own. A restarted consumer
  pairs again the same way (the newest consumer is the one served).
- A transfer. After a step's forward, the producer's sender thread (saver.py) offers the step's
  blocks under the next number (their hashes, in the store) and waits for the consumer's answer;
  only then do the sends start, so no receive ever waits under the group's timeout: an idle
  link, for minutes or days, is a consumer thread waiting on the store, which has no timeout.
  The consumer keeps what arrives by hash; a request with that prefix finds the blocks there
  (the scheduler's side) and its step copies them into the request's own blocks (the worker's).
  A block that has not arrived yet is simply computed; one that two requests want in the same
  step goes to the first (the other computes it).
- Bounded. Received blocks take at most "kv_buffer_size" bytes (default 1 GiB): the oldest go
  first. A request that finishes frees any it did not load (blocks it had cached, the last one).
- A peer gone. A consumer that does not answer an offer within "kv_timeout" seconds (default 10),
  that left, or whose link fails, is gone: the producer logs it once, counts the blocks it does
  not send (`unsent_blocks`), and goes on serving until a consumer pairs again. A consumer whose
  producer is gone logs it and computes every prompt itself; pairing with a new producer takes
  restarting it. A link that fails mid-transfer fails after at most kv_timeout (on NCCL, the
  watchdog may then end the process: the one case that still costs an engine).
"""
import itertools
import json
import logging
import threading
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist

from nanoinfer.config import Config
from nanoinfer.kv_transfer import kv_layout
from nanoinfer.kv_transfer.saver import KVSaver

logger = logging.getLogger("nanoinfer")
FOREVER = timedelta(days=3650)   # an idle link's wait on the store


class P2pConnector:

    def __init__(self, config: Config, rank: int = 0):
        if config.world_size != 1:
            raise ValueError("P2pConnector connects one-rank engines (tensor_parallel_size = "
                             "pipeline_parallel_size = 1)")
        transfer, extra = config.kv_transfer, config.kv_transfer.extra_config
        self.loads, self.saves = (transfer.kv_role == r for r in ("kv_consumer", "kv_producer"))
        self.address = extra.get("kv_ip", "127.0.0.1"), extra["kv_port"]
        self.timeout = timedelta(seconds=extra.get("kv_timeout", 10))
        self.connect_timeout = timedelta(seconds=extra.get("kv_connect_timeout", 120))
        self.max_bytes = extra.get("kv_buffer_size", 2**30)
        self.device = torch.device("cpu")   # (the engine's own GPU, not a thread's default one)
        if config.device == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = dist.ProcessGroupNCCL if config.device == "cuda" else dist.ProcessGroupGloo
        self.layout = kv_layout(config)
        layout = self.layout
        self.block_shape = (2, layout["num_layers"], config.block_size, layout["num_kv_heads"],
                            layout["head_dim"])
        self.dtype = config.torch_dtype
        self.block_bytes = config.kv_cache_bytes_per_token * config.block_size
        self.received: OrderedDict[int, torch.Tensor] = OrderedDict()   # the consumer's, by hash
        self.lock = threading.Lock()   # (received: the receiving thread adds, the step takes)
        self.link = None   # while paired: (its store, its process group, the offers' numbers)
        self.closed = False
        self.num_loaded_blocks = self.num_saved_blocks = self.num_unsent_blocks = 0
        self.num_evicted_blocks = 0
        self.store = dist.TCPStore(*self.address, None, self.saves, self.connect_timeout,
                                   wait_for_workers=False)
        if self.saves:
            self.store.set("layout", json.dumps(layout))
            self.saver = KVSaver(self.send, self.max_bytes, "nanoinfer-kv-sender")
            threading.Thread(target=self.listen, name="nanoinfer-kv-listener", daemon=True).start()
        else:
            self.pair()
            threading.Thread(target=self.receive, name="nanoinfer-kv-receiver", daemon=True).start()

    def client(self) -> dist.TCPStore:
        """A connection of its own to the store (one blocked in a wait holds its connection)."""
        return dist.TCPStore(*self.address, None, False, self.connect_timeout)

    def pair(self) -> None:
        """The consumer's start-up: compare layouts with the producer, then form the group."""
        theirs = json.loads(self.store.get("layout"))   # (waits for the producer)
        number = self.store.add("consumers", 1)
        self.store.set(f"consumer{number}", json.dumps(self.layout))
        if theirs != self.layout:
            raise ValueError(f"P2pConnector: the producer at {self.address} exchanges other KV "
                             f"blocks than this engine: {differences(self.layout, theirs)}")
        store, self.number = dist.PrefixStore(f"link{number}", self.client()), number
        self.link = store, self.backend(store, 1, 2, self.timeout), itertools.count(1)

    def listen(self) -> None:
        """The producer's thread: pair with each consumer that comes."""
        store = self.client()
        for number in itertools.count(1):
            try:
                store.wait([f"consumer{number}"], FOREVER)
                theirs = json.loads(store.get(f"consumer{number}"))
                if theirs != self.layout:
                    logger.error("P2pConnector: refused a consumer that exchanges other KV blocks: "
                                 "%s", differences(self.layout, theirs))
                    continue
                link = dist.PrefixStore(f"link{number}", self.client())
                self.link = link, self.backend(link, 0, 2, self.timeout), itertools.count(1)
                logger.info("P2pConnector: a consumer paired")
            except RuntimeError as e:
                if self.closed:
                    return
                logger.warning("P2pConnector: pairing with a consumer failed: %s", e)

    # the scheduler's side

    def num_matched_blocks(self, block_hashes: list[int]) -> int:
        n = 0
        while self.loads and n < len(block_hashes) and block_hashes[n] in self.received:
            n += 1
        return n

    def request_finished(self, block_hashes: list[int]) -> None:
        """A request is done: it will load none of its blocks that are still here."""
        with self.lock:
            for block_hash in block_hashes:
                self.received.pop(block_hash, None)

    # the worker's side

    def load_kv(self, blocks: list[tuple[int, int]], kv_cache: torch.Tensor) -> int:
        for n, (block_id, block_hash) in enumerate(blocks):
            with self.lock:
                kv = self.received.pop(block_hash, None)
            if kv is None:
                return n
            kv_cache[:, :, block_id] = kv.to(kv_cache.device)
            self.num_loaded_blocks += 1
        return len(blocks)

    def save_kv(self, blocks: list[tuple[int, int]], kv_cache: torch.Tensor) -> int:
        return self.saver.put(blocks, kv_cache)

    def send(self, hashes: list[int], kv: torch.Tensor) -> None:
        """The sender thread's: offer the blocks, and send them once the consumer is ready."""
        link = self.link
        if link is None:
            self.num_unsent_blocks += len(hashes)
            return
        store, group, numbers = link
        if kv.is_cuda:
            torch.cuda.set_device(kv.device)
        try:
            if store.check(["left"]):
                raise ConnectionError("it shut down")
            n = next(numbers)
            store.set(f"offer{n}", ",".join(f"{h:x}" for h in hashes))
            store.wait([f"ready{n}"], self.timeout)
            for block in kv:
                group.send([block], 1, 0).wait()
            store.delete_key(f"ready{n}")
        except (RuntimeError, ConnectionError) as e:   # (a store's timeout is a RuntimeError)
            self.link, self.num_unsent_blocks = None, self.num_unsent_blocks + len(hashes)
            logger.warning("P2pConnector: the consumer is gone (%s); this engine serves on and "
                           "shares no blocks until a consumer pairs again", e)
            return
        self.num_saved_blocks += len(hashes)

    def receive(self) -> None:
        """The consumer's thread: each offer's blocks, for as long as the producer is there."""
        store, group, _ = self.link
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        for n in itertools.count(1):
            try:
                store.wait([f"offer{n}"], FOREVER)
                offer = store.get(f"offer{n}").decode()
                if not offer:
                    logger.info("P2pConnector: the producer stopped")
                    return
                hashes = [int(h, 16) for h in offer.split(",")]
                kvs = [torch.empty(self.block_shape, dtype=self.dtype, device=self.device)
                       for _ in hashes]
                store.delete_key(f"offer{n}")
                store.set(f"ready{n}", "")
                for kv in kvs:
                    group.recv([kv], 0, 0).wait()
            except RuntimeError as e:
                if not self.closed:
                    logger.warning("P2pConnector: the producer is gone (%s); this engine computes "
                                   "every prompt itself (restart it to pair with a new one)", e)
                return
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            self.keep(hashes, kvs)

    def keep(self, hashes: list[int], kvs: list[torch.Tensor]) -> None:
        """Received blocks, the oldest evicted beyond kv_buffer_size."""
        with self.lock:
            for block_hash, kv in zip(hashes, kvs):
                self.received[block_hash] = kv
                self.received.move_to_end(block_hash)
            while len(self.received) * self.block_bytes > self.max_bytes:
                self.received.popitem(last=False)
                self.num_evicted_blocks += 1

    def stats(self) -> dict[str, int]:
        return {"loaded_blocks": self.num_loaded_blocks, "saved_blocks": self.num_saved_blocks,
                "unsent_blocks": self.num_unsent_blocks, "evicted_blocks": self.num_evicted_blocks,
                "received_bytes": len(self.received) * self.block_bytes}

    def shutdown(self) -> None:
        self.closed = True
        try:
            if self.saves:   # what is queued goes out; then the consumer hears that we stopped
                self.saver.close()
                if self.link is not None:
                    self.link[0].set(f"offer{next(self.link[2])}", "")
            elif self.link is not None:   # the producer stops sending to us at once
                dist.PrefixStore(f"link{self.number}", self.client()).set("left", "")
        except RuntimeError:   # (the peer is gone already)
            pass


def differences(ours: dict, theirs: dict) -> str:
    return "; ".join(f"{key}: ours {ours.get(key)!r}, theirs {theirs.get(key)!r}"
                     for key in sorted(set(ours) | set(theirs)) if ours.get(key) != theirs.get(key))
