"""Model parallelism over several nodes: which ranks a node runs, and how the others get a step.

With `nnodes` N the P x T ranks split evenly, in order: node n runs ranks [n W / N, (n + 1) W / N)
of the W, whole pipeline stages, so every tensor-parallel group (an all-reduce in every layer)
stays inside one node and only the stage boundaries (one send of hidden states a step) cross the
network. The head (node_rank 0) runs the engine and its own ranks as one node does; every other
node runs `python -m nanoinfer.serve --model M ... --nnodes N --node-rank n --master-addr HEAD
--master-port PORT --headless`, which starts that node's ranks only and waits for them.
Everything meets at torch.distributed's rendezvous on the head (`tcp://HEAD:PORT`), and what
crosses the network goes over torch.distributed, on gloo CPU groups of its own:

    engine ──shm ring──> the head's ranks; rank 0's thread ──broadcast──> every remote rank
    engine <──shm ring── rank 0's other thread <──── the driver (last stage, on the last node)

Why this way. The engine's process is no rank (section 9 of docs/ARCHITECTURE.md: only a rank's
end frees its GPU), but rank 0 reads every call anyway: it passes each on, pickled, in one
broadcast over the group of itself and every remote rank. A leader rank per node writing into its
node's own ring would save the other nodes' ranks nothing but add a hop and a thread, for a
message of a few KB. Rank 0 relays from threads, so it never waits for a later stage's node to
take a call (that would undo the pipelining), and the ranks of the head keep the shared memory.
With one node none of this runs: not a line of it is on that path.

Lifecycle. "shutdown" reaches the remote ranks like any call; when the head's ranks die instead,
their connections close and the remote ranks' next receive fails, so they exit too; the headless
process exits once its ranks have. Whoever reaches the rendezvous port can join the world and
have what it sends unpickled: torch.distributed's store and gloo must sit on a trusted network.
"""
import queue
import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from nanoinfer.config import Config
from nanoinfer.executor.message_queue import MessageQueue

# A remote rank waits for the next call as long as the engine is idle; a node that dies closes
# its connections, which ends the wait at once.
IDLE_TIMEOUT = timedelta(days=365)


class GroupChannel:
    """Pickled messages from rank `src` to the other ranks of a gloo group, with the ring's calls
    (`enqueue` by the writer, `dequeue` by each reader; `check` is not needed: a dead peer's
    closed connection ends the wait)."""

    def __init__(self, ranks: list[int], src: int):
        self.group = dist.new_group(ranks, timeout=IDLE_TIMEOUT, backend="gloo")
        self.src = src

    def enqueue(self, obj, check: Callable[[], None] | None = None) -> None:
        dist.broadcast_object_list([obj], src=self.src, group=self.group)

    def dequeue(self, check: Callable[[], None] | None = None):
        received = [None]
        dist.broadcast_object_list(received, src=self.src, group=self.group)
        return received[0]


class Relay:
    """Rank 0's calls when there are other nodes: read from the ring, and passed on by a thread."""

    def __init__(self, calls: MessageQueue, steps: GroupChannel, fail: Callable):
        self.calls = calls
        self.steps = steps
        self.pending = queue.SimpleQueue()
        self.sender = threading.Thread(target=forward, args=(self.pending, steps, fail),
                                       daemon=True)
        self.sender.start()

    def dequeue(self, check: Callable[[], None]):
        call = self.calls.dequeue(check)
        if call[0] != "shutdown":
            self.pending.put(call)
            return call
        self.pending.put(None)   # the calls before it first; the other nodes have it before
        self.sender.join()       # this rank exits
        self.steps.enqueue(call)
        return call


def forward(pending: queue.SimpleQueue, steps: GroupChannel, fail: Callable) -> None:
    try:
        while (call := pending.get()) is not None:
            steps.enqueue(call)
    except BaseException as e:
        fail(e)


def bring_back(outputs: GroupChannel, responses: MessageQueue, fail: Callable) -> None:
    """The driver's outputs, from the network into the engine's ring."""
    try:
        while True:
            responses.enqueue(outputs.dequeue(), check=lambda: None)
    except BaseException as e:
        fail(e)


def connect(config: Config, rank: int, calls: MessageQueue | None,
            responses: MessageQueue | None, fail: Callable[[BaseException], None]) -> tuple:
    """Rank `rank`'s calls (what it reads them from) and responses (what the driver writes its
    outputs to) across nodes. Every rank makes both groups, in the same order; `fail(error)`
    ends rank 0 when a relay thread fails."""
    remote = list(range(config.world_size // config.nnodes, config.world_size))
    driver = driver_rank(config)
    steps = GroupChannel([0, *remote], src=0)
    outputs = GroupChannel([0, driver], src=driver)
    if rank == 0:
        threading.Thread(target=bring_back, args=(outputs, responses, fail), daemon=True).start()
        return Relay(calls, steps, fail), None
    if rank in remote:
        return steps, outputs if rank == driver else None
    return calls, responses


def node_ranks(config: Config) -> range:
    """The ranks this node runs."""
    per_node = config.world_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def driver_rank(config: Config) -> int:
    """The rank that samples and sends the outputs: the last stage's first."""
    return config.world_size - config.tensor_parallel_size
