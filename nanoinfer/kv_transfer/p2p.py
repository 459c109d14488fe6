"""The point-to-point connector: a prefill engine sends its prompt blocks straight to a decoder.

Both engines run one rank each (tensor_parallel_size = pipeline_parallel_size = 1). The producer
serves a TCPStore at kv_connector_extra_config's "kv_ip" (default 127.0.0.1) and "kv_port": the
link's control channel. A process group of two ranks (NCCL between two GPUs, gloo on the CPU)
carries the blocks. Every thread talks to the store over a connection of its own (a connection
blocked in a wait holds up every other call on it), and the group has one more.

- Pairing. The producer writes its KV layout (kv_transfer/__init__.py) in the store at start-up
  and waits for consumers on a thread of its own. A consumer reads that layout at start-up: if
  it differs from its own, it refuses to start (a ValueError naming each difference) and the
  producer logs the refusal. Once its engine is built (not while it profiles memory or captures
  CUDA graphs), the consumer's thread pairs: it writes its layout under the next number, and the
  two form a process group of their own. A consumer that loses its link pairs again; so does a
  restarted one (the newest consumer is the one served).
- A transfer. After a step, the producer's sender thread (saver.py) offers its blocks under the
  next number (their hashes, in the store) and waits for the consumer's answer: how many of them
  it takes (the first ones, as many as fit); the producer says go, and only then do the sends
  and receives start. So no receive is ever posted before its send is on its way, and no
  operation of the group waits under its timeout: an idle link, for minutes or days, is a
  consumer thread waiting on the store, which has no timeout. The consumer keeps what arrives
  by hash; a request with that prefix finds the blocks there (the scheduler's side) and its step
  copies them into the request's own blocks (the worker's side). A block that has not arrived
  yet is simply computed; one that two requests want in the same step goes to the first.
- Bounded. Received blocks take at most "kv_buffer_size" bytes (default 1 GiB, from the KV
  cache's share of the GPU): an offer evicts the oldest first, and one larger than that brings
  its first blocks only. A finished request frees those it did not load.
- A peer gone. A consumer that does not answer an offer within "kv_timeout" seconds (default
  10), that left, or whose link fails, is gone: the producer logs it once, counts the blocks it
  does not send (`unsent_blocks`), and goes on serving until a consumer pairs again. A consumer
  whose producer is gone logs it and computes every prompt itself; pairing with a new producer
  takes restarting it. A link that fails mid-transfer fails after at most kv_timeout (on NCCL,
  the watchdog may then end the process: the one case that still costs an engine).
- Streams. Sends and receives run on their threads' own CUDA streams, so a slow peer never holds
  up the engine's kernels; a step's blocks count as saved once the consumer holds them.
"""
import contextlib
import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist

from nanoinfer.config import Config
from nanoinfer.kv_transfer import kv_layout, layout_differences
from nanoinfer.kv_transfer.saver import KVSaver

logger = logging.getLogger("nanoinfer")
FOREVER = timedelta(days=3650)   # an idle link's wait on the store


class P2pConnector:

    def __init__(self, config: Config, rank: int = 0):
        if config.world_size != 1:
            raise ValueError("P2pConnector connects one-rank engines (no tensor or pipeline ranks)")
        transfer, extra = config.kv_transfer, config.kv_transfer.extra_config
        self.loads, self.saves = (transfer.kv_role == r for r in ("kv_consumer", "kv_producer"))
        self.address = extra.get("kv_ip", "127.0.0.1"), extra["kv_port"]
        self.timeout = timedelta(seconds=extra.get("kv_timeout", 10))
        self.connect_timeout = timedelta(seconds=extra.get("kv_connect_timeout", 120))
        self.device_bytes = extra.get("kv_buffer_size", 2**30)   # (beside the KV cache)
        self.backend = dist.ProcessGroupNCCL if config.device == "cuda" else dist.ProcessGroupGloo
        self.layout = kv_layout(config)
        self.received: OrderedDict[int, torch.Tensor] = OrderedDict()   # the consumer's, by hash
        self.lock = threading.Lock()   # (received and link: a thread changes them, the step reads)
        self.link = None   # while paired: (its control store, its process group, offer numbers)
        self.closed = False
        self.next_consumer = 1
        self.offer = 1
        self.num_loaded_blocks = self.num_saved_blocks = 0
        self.num_unsent_blocks = self.num_evicted_blocks = 0
        self.store = self.saver = self.receiver = self.listener = None
        if self.saves:   # (the port is taken once the engine is built: register_kv_caches)
            return
        self.store = dist.TCPStore(*self.address, None, False, self.connect_timeout)
        theirs = json.loads(self.store.get("layout"))   # (waits for the producer)
        if theirs != self.layout:   # (announced, so that the producer logs it too)
            self.store.set(f"consumer{self.store.add('consumers', 1)}", json.dumps(self.layout))
            raise ValueError(f"P2pConnector: the producer at {self.address} exchanges other KV "
                             f"blocks than this engine: {layout_differences(self.layout, theirs)}")

    def client(self, timeout: timedelta | None = None) -> dist.TCPStore:
        return dist.TCPStore(*self.address, None, False, timeout or self.connect_timeout)

    def open_link(self, number: int, rank: int) -> tuple:
        """Link `number`'s control store and process group (each on a connection of its own)."""
        group_store = dist.PrefixStore(f"link{number}/group", self.client())
        control = dist.PrefixStore(f"link{number}", self.client())
        return control, self.backend(group_store, rank, 2, self.timeout), itertools.count(1)

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """The engine is built: the producer opens its store, the consumer starts receiving
        (into blocks shaped as its cache's)."""
        self.block = kv_cache[:, :, 0]   # (shape, dtype, device, size: the engine's own)
        if self.loads:
            self.receiver = threading.Thread(target=self.receive, name="nanoinfer-kv-receiver",
                                             daemon=True)
            self.receiver.start()
            return
        self.store = dist.TCPStore(*self.address, None, True, self.connect_timeout,
                                   wait_for_workers=False)
        self.store.set("layout", json.dumps(self.layout))
        self.saver = KVSaver(self.send, self.device_bytes, "nanoinfer-kv-sender")
        self.listener = threading.Thread(target=self.listen, name="nanoinfer-kv-pair", daemon=True)
        self.listener.start()

    def listen(self) -> None:
        """The producer's thread: pair with each consumer that comes."""
        store = self.client()
        for number in itertools.count(1):
            self.next_consumer = number
            try:
                if self.closed:
                    return
                store.wait([f"consumer{number}"], FOREVER)
                if self.closed:
                    return
                theirs = json.loads(store.get(f"consumer{number}"))
                if theirs != self.layout:
                    logger.error("P2pConnector: refused a consumer that exchanges other KV blocks: "
                                 "%s", layout_differences(self.layout, theirs))
                    continue
                link = self.open_link(number, 0)
                with self.lock:
                    self.link = link
                    link = None   # (the thread keeps no link of its own)
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
            kv_cache[:, :, block_id] = kv
            self.num_loaded_blocks += 1
        return len(blocks)

    def save_kv(self, blocks: list[tuple[int, int]], kv_cache: torch.Tensor) -> int:
        return self.saver.put(blocks, kv_cache)

    def send(self, hashes: list[int], kv: torch.Tensor) -> None:
        """The sender thread's: offer the blocks; send them if the consumer is ready."""
        link = self.link
        if link is None:
            self.num_unsent_blocks += len(hashes)
            return
        control, group, numbers = link
        unsent = len(hashes)   # (until the consumer says how many it takes)
        try:
            if control.check(["left"]):
                raise ConnectionError("it shut down")
            n = next(numbers)
            control.set(f"offer{n}", ",".join(f"{h:x}" for h in hashes))
            control.wait([f"ready{n}"], self.timeout)
            accepted = int(control.get(f"ready{n}"))   # (the first ones, as many as fit there)
            control.delete_key(f"ready{n}")
            self.num_unsent_blocks += len(hashes) - accepted
            unsent = accepted
            if not accepted:   # (no room: not a failure)
                return
            control.set(f"go{n}", "")
            for block in kv[:accepted]:
                group.send([block], 1, 0).wait()
            with contextlib.suppress(dist.DistStoreError):   # (late: slow, not gone; sent anyway)
                control.wait([f"kept{n}"], self.timeout)   # saved: the consumer can load them
            control.delete_key(f"kept{n}")
        except (RuntimeError, ConnectionError) as e:   # (a store's timeout is a RuntimeError)
            self.num_unsent_blocks += unsent
            with self.lock:
                if self.link is not link:   # (a newer consumer paired meanwhile)
                    return
                self.link = None
            logger.warning("P2pConnector: the consumer is gone (%s); this engine serves on and "
                           "shares no blocks until a consumer pairs again", e)
            return
        self.num_saved_blocks += accepted

    def receive(self) -> None:
        """The consumer's thread: pair, and receive for as long as the link lasts; pair again."""
        stream = torch.cuda.Stream(self.block.device) if self.block.is_cuda else None
        if stream is not None:   # (the engine's GPU, and a stream of this thread's own)
            torch.cuda.set_device(self.block.device)
        while not self.closed:
            try:
                number = self.store.add("consumers", 1)
                self.store.set(f"consumer{number}", json.dumps(self.layout))
                self.number, self.link = number, self.open_link(number, 1)
                with torch.cuda.stream(stream):
                    if not self.receive_offers(*self.link, stream):
                        break   # the producer stopped, or this engine
            except dist.DistNetworkError as e:   # the producer's store is gone
                if not self.closed:
                    logger.warning("P2pConnector: the producer is gone (%s); this engine computes "
                                   "every prompt itself (restart it to pair with a new one)", e)
                break
            except RuntimeError as e:   # a transfer failed or timed out
                if not self.closed:
                    logger.warning("P2pConnector: the link failed (%s): pairing again", e)
                    time.sleep(1)
        self.link = None

    def receive_offers(self, control, group, _, stream) -> bool:
        """Each offer's blocks, until the producer stops (False) or the link fails (raises)."""
        for n in itertools.count(1):
            self.offer = n
            if self.closed:
                return False
            control.wait([f"offer{n}"], FOREVER)
            offer = control.get(f"offer{n}").decode()
            if not offer:
                if not self.closed:
                    logger.info("P2pConnector: the producer stopped")
                return False
            hashes = [int(h, 16) for h in offer.split(",")]
            hashes = hashes[:self.make_room(len(hashes))]
            try:
                kvs = [torch.empty_like(self.block) for _ in hashes]
            except torch.OutOfMemoryError:
                kvs = []
            control.delete_key(f"offer{n}")
            control.set(f"ready{n}", str(len(kvs)))
            if not kvs:
                continue
            control.wait([f"go{n}"], self.timeout)
            control.delete_key(f"go{n}")
            for kv in kvs:
                group.recv([kv], 0, 0).wait()
            if stream is not None:   # (the engine's stream reads them next, and frees them)
                stream.synchronize()
                for kv in kvs:
                    kv.record_stream(torch.cuda.default_stream())
            with self.lock:
                for block_hash, kv in zip(hashes, kvs):
                    self.received[block_hash] = kv
            control.set(f"kept{n}", "")
        return True

    def make_room(self, wanted: int) -> int:
        """Evict the oldest blocks kept until `wanted` more fit in kv_buffer_size (or as many as
        fit in all of it: the first ones of an offer, a prefix, are the useful ones)."""
        wanted = min(wanted, self.device_bytes // self.block.nbytes)
        with self.lock:
            while len(self.received) > self.device_bytes // self.block.nbytes - wanted:
                self.received.popitem(last=False)
                self.num_evicted_blocks += 1
        return wanted

    def stats(self) -> dict[str, int]:
        return {"loaded_blocks": self.num_loaded_blocks, "saved_blocks": self.num_saved_blocks,
                "unsent_blocks": self.num_unsent_blocks, "evicted_blocks": self.num_evicted_blocks,
                "received_bytes": sum(kv.nbytes for kv in list(self.received.values()))}

    def shutdown(self) -> None:
        self.closed = True
        with contextlib.suppress(RuntimeError):   # (the peer is gone already)
            if self.saver is not None:   # what is queued goes out; the consumer hears we stopped
                self.saver.close()
                if self.link is not None and not self.saver.thread.is_alive():
                    self.link[0].set(f"offer{next(self.link[2])}", "")
                for n in (self.next_consumer, self.next_consumer + 1):   # (wakes the listener)
                    self.store.set(f"consumer{n}", "")
            elif self.link is not None:   # the producer stops sending; our thread wakes up
                link = dist.PrefixStore(f"link{self.number}", self.client(timedelta(seconds=2)))
                link.set("left", "")
                for n in (self.offer, self.offer + 1):   # (the offer it waits for, or the next)
                    link.set(f"offer{n}", "")
        for thread in filter(None, (self.receiver, self.listener)):
            thread.join(5)
        self.link = self.store = self.block = None   # (the port, the KV cache: freed)
        self.received.clear()

