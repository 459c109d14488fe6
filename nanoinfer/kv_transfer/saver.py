"""Saving off the step loop: a producer's blocks are written by a thread of their own.

In the step, `put` only queues a copy of the step's blocks, made on the device behind the step's
forward (no wait for the GPU); the thread waits for that copy and hands it to the connector's
`write` (a file per block; a point-to-point connector would send them to its peer). The next
step is scheduled and launched meanwhile. The copies queued at once are bounded (`max_bytes`): a
disk slower than the steps holds the step loop back only when that much is waiting
(back-pressure, nothing dropped).

`put` returns a ticket; the step's output waits for it (`wait`) before it is reported, so a
request the producer has answered has its blocks saved: the consumer it is handed to finds them.
`write` handles its own failures; one that raises anyway is logged, never the step's problem.
On a GPU the thread copies and writes on a CUDA stream of its own, so that its work never waits
for the engine's next step, nor the engine's kernels for it.
"""
import logging
import queue
import threading
from typing import Callable

import torch

logger = logging.getLogger("nanoinfer")


class KVSaver:

    def __init__(self, write: Callable[[list[int], torch.Tensor], None], max_bytes: int, name: str):
        """write(hashes, kv): kv is [blocks, 2, layers, block_size, kv_heads, head_dim]."""
        self.write = write
        self.max_bytes = max_bytes
        self.queue: queue.Queue = queue.Queue()
        self.progress = threading.Condition()
        self.num_put = self.num_done = 0   # step copies queued and saved (put, by the step loop;
        self.bytes_put = self.bytes_done = 0   # done, by the thread: each counter has one writer)
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)
        self.thread.start()

    def put(self, blocks: list[tuple[int, int]], kv_cache: torch.Tensor) -> int:
        """Queue a copy of these (block id, hash) blocks; the ticket to wait for."""
        ids = torch.tensor([block_id for block_id, _ in blocks], device=kv_cache.device)
        nbytes = len(blocks) * kv_cache[:, :, 0].nbytes
        with self.progress:   # (back-pressure; a copy larger than the bound goes alone)
            self.progress.wait_for(lambda: self.bytes_put == self.bytes_done or
                                   self.bytes_put + nbytes - self.bytes_done <= self.max_bytes)
        kv = kv_cache.index_select(2, ids).movedim(2, 0).contiguous()
        copied = None
        if kv.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        self.queue.put(([block_hash for _, block_hash in blocks], kv, copied, nbytes))
        self.num_put, self.bytes_put = self.num_put + 1, self.bytes_put + nbytes   # (after: see
        return self.num_put   # wait; an interrupt between the two reports a step early, no hang)

    def wait(self, ticket: int) -> None:
        with self.progress:
            self.progress.wait_for(lambda: self.num_done >= ticket)

    def run(self) -> None:
        stream = None   # on a GPU: this thread's own stream (the engine's runs the next step)
        while (item := self.queue.get()) is not None:
            hashes, kv, copied, nbytes = item
            try:
                if copied is not None and stream is None:
                    torch.cuda.set_device(kv.device)
                    stream = torch.cuda.Stream()
                if copied is not None:
                    copied.synchronize()
                with torch.cuda.stream(stream):
                    self.write(hashes, kv)
                if stream is not None:   # (saved means written, not just queued)
                    stream.synchronize()
            except Exception:
                logger.exception("saving %d KV blocks failed", len(hashes))
            with self.progress:
                self.num_done, self.bytes_done = self.num_done + 1, self.bytes_done + nbytes
                self.progress.notify_all()

    def close(self, timeout: float = 60) -> None:
        """Save what is queued (for at most `timeout` seconds), then stop the thread."""
        self.queue.put(None)
        self.thread.join(timeout)
