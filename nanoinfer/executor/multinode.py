"""Model parallelism over several nodes: which ranks a node runs, and how they get their calls.

With `nnodes` N the P x T ranks split evenly, in order: node n runs ranks [n W / N, (n + 1) W / N)
of the W, whole pipeline stages, so every tensor-parallel group (an all-reduce in every layer)
stays inside one node and only the stage boundaries (one send of hidden states a step) cross the
network. The head (node_rank 0) runs the engine and its own ranks as one node does; every other
node runs `python -m nanoinfer.serve --model M ... --nnodes N --node-rank n --master-addr HEAD
--master-port PORT --headless`, a process that starts its node's ranks and passes them the calls.

    engine ──shm ring──> the head's ranks
      └──── link (TCP) ──> node n's process ──shm ring──> node n's ranks
    engine <──── link <─── the driver's outputs (last stage, last node) <──shm ring──┘

What crosses the network, and on what:
- The calls (the step message, a few KB) and the driver's outputs (a step's tokens) go over a
  link: one TCP connection between the head's engine and each node's process, made at start-up
  to HEAD:PORT+1, carrying `multiprocessing.connection` messages (pickles). Every rank of a node
  reads its calls from its own node's shared-memory ring, as on one node: the ranks never know
  where they run. A torch.distributed CPU group could carry the calls too, but it would unpickle
  what any member of the world sends, and the world is formed through an unauthenticated store.
- The activations between stages go point to point over torch.distributed (gloo or NCCL), as on
  one node; its rendezvous (a TCPStore) is at HEAD:PORT.

The link's trust (a shared key) and faults: node_link.py. A lost node (its link closed or timed
out) is a lost rank: the head stops its own ranks and the engine's next wait raises, so every
request in flight fails with an error (on a server, /health turns 503; an idle engine finds it at
its next step); a node that loses the
head, or one of its own ranks, stops its ranks and exits.
With one node none of this runs: not a line of it is on that path.
"""
import contextlib
import multiprocessing as mp
import sys
import threading
from multiprocessing.connection import Connection, wait

from nanoinfer.config import Config
from nanoinfer.executor.message_queue import MessageQueue
from nanoinfer.executor.multiproc_executor import start_workers
from nanoinfer.executor.node_link import hang_up, join
from nanoinfer.utils import stop_processes


def run_headless(config: Config) -> int:
    """A node other than the head: join it, start this node's ranks, pass them the head's calls,
    and return an exit status: 0 after the head's "shutdown", 1 when the head or a rank is lost."""
    conn, config = join(config, (config.master_addr, config.master_port + 1), config.node_rank,
                        "node")
    calls = MessageQueue(num_readers=len(config.node_ranks))
    responses = MessageQueue(num_readers=1)   # (written if the driver is on this node)
    errors = mp.get_context("spawn").SimpleQueue()
    workers = []
    try:
        start_workers(workers, config, calls, responses, errors)
        threading.Thread(target=send_outputs, args=(responses, conn), daemon=True).start()
        return relay_calls(conn, calls, workers, errors)
    except (EOFError, OSError) as e:
        print(f"nanoinfer: lost the head ({str(e) or 'it closed the link'}): stopping this "
              "node's ranks", flush=True)
        return 1
    finally:
        stop_processes(workers, 0)
        hang_up(conn)
        calls.close()
        responses.close()


def relay_calls(conn: Connection, calls: MessageQueue, workers: list, errors) -> int:
    """The head's calls, into this node's ring, until "shutdown" (0) or a rank's death (1: its
    error is printed here; the head finds the link closed)."""
    def check():
        if not all(w.is_alive() for w in workers):
            raise ChildProcessError
    with contextlib.suppress(ChildProcessError):
        while conn in wait([conn, *[w.sentinel for w in workers]]):
            call = conn.recv()
            calls.enqueue(call, check)
            if call[0] == "shutdown":
                stop_processes(workers, 5)
                return 0
    while not errors.empty():
        print(f"nanoinfer: {errors.get()[1]}", file=sys.stderr, flush=True)
    return 1


def send_outputs(responses: MessageQueue, conn: Connection) -> None:
    while True:
        conn.send(responses.dequeue(check=lambda: None))

