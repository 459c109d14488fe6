"""Model parallelism over several nodes: which ranks a node runs, and how they get their calls.

With `nnodes` N the P x T ranks split evenly, in order: node n runs ranks [n W / N, (n + 1) W / N)
of the W, whole pipeline stages, so every tensor-parallel group (an all-reduce in every layer)
stays inside one node and only the stage boundaries (one send of hidden states a step) cross the
network. The head (node_rank 0) runs the engine and its own ranks as one node does; every other
node runs `python -m nanoinfer.serve --model M ... --nnodes N --node-rank n --master-addr HEAD
--master-port PORT --headless`, a process that starts its node's ranks and passes them the calls.

    engine ──shm ring──> the head's ranks
      └──── link (TCP) ──> node n's process ──shm ring──> node n's ranks
    engine <──── link <─── the driver's outputs (last stage, on the last node) <──shm ring──┘

What crosses the network, and on what:
- The calls (the step message, a few KB) and the driver's outputs (a step's tokens) go over a
  link: one TCP connection between the head's engine and each node's process, made at start-up
  to HEAD:PORT+1, carrying `multiprocessing.connection` messages (pickles). Every rank of a node
  reads its calls from its own node's shared-memory ring, as on one node: the ranks never know
  where they run. A torch.distributed CPU group could carry the calls too, but it would unpickle
  what any member of the world sends, and the world is formed through an unauthenticated store.
- The activations between stages go point to point over torch.distributed (gloo or NCCL), as on
  one node; its rendezvous (a TCPStore) is at HEAD:PORT.

Trust. A link is made only after both ends proved they hold the secret in NANOINFER_CLUSTER_KEY
(each sends a random challenge and checks the other's HMAC-SHA256 of it, before anything is
unpickled); then the node says what it runs (its fingerprint: model, dtype, layout, code), and the
head refuses a node that differs, naming what, and goes on waiting. The head listens only on the
address it is given, and only until every node has joined. torch.distributed's store and its
collectives authenticate nobody: like vLLM's, they must sit on a trusted network.

Faults. Each end of a link sends a heartbeat when it has had nothing else to send for a quarter
of NANOINFER_NODE_TIMEOUT seconds (20 by default). A node whose link closes or goes silent for
that long is lost: the head stops its own ranks and the engine's next wait raises, so every
request in flight fails with an error (on a server, /health turns 503). A node that loses the
head stops its ranks and exits. Nodes wait for each other at start-up up to
NANOINFER_NODE_START_TIMEOUT seconds (600 by default), saying what they wait for.
With one node none of this runs: not a line of it is on that path.
"""
import dataclasses
import hashlib
import hmac
import logging
import multiprocessing as mp
import os
import pathlib
import queue
import secrets
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler

from nanoinfer.config import Config
from nanoinfer.executor.message_queue import MessageQueue

logger = logging.getLogger("nanoinfer")
HEARTBEAT = bytes(ForkingPickler.dumps("heartbeat"))


def node_timeout() -> float:
    return float(os.environ.get("NANOINFER_NODE_TIMEOUT", "20"))


def start_timeout() -> float:
    return float(os.environ.get("NANOINFER_NODE_START_TIMEOUT", "600"))


class NodeLink:
    """One end of a link: pickled messages both ways, sent by a thread of its own (which sends
    heartbeats when there is nothing else), and a peer that stays silent counted as gone."""

    def __init__(self, conn: Connection, peer: str):
        self.conn = conn
        self.peer = peer
        self.outbox = queue.SimpleQueue()
        self.writer = threading.Thread(target=self.write, daemon=True)
        self.writer.start()

    def send(self, message) -> None:
        self.outbox.put(bytes(ForkingPickler.dumps(message)))

    def write(self) -> None:
        while True:
            try:
                message = self.outbox.get(timeout=node_timeout() / 4)
            except queue.Empty:
                message = HEARTBEAT
            if message is None:
                return
            try:
                self.conn.send_bytes(message)
            except OSError:   # (the reader finds the peer gone)
                return

    def recv(self, also: list = ()):
        """The next message, or None once one of `also` (process sentinels) is ready. EOFError or
        ConnectionError when the peer is gone or has been silent for too long."""
        while True:
            ready = wait([self.conn, *also], node_timeout())
            if not ready:
                raise ConnectionError(f"{self.peer} sent nothing for {node_timeout():g} s")
            if self.conn not in ready:
                return None
            message = self.conn.recv()
            if message != "heartbeat":
                return message

    def close(self) -> None:
        """After what was sent: a "shutdown" reaches the peer."""
        self.outbox.put(None)
        self.writer.join(5)
        self.conn.close()


class Inbox(queue.SimpleQueue):
    """The head's ring for the driver's outputs when the driver runs on another node: the link's
    reader thread puts them here."""

    def as_reader(self, reader: int) -> None:
        pass

    def dequeue(self, check):
        while True:
            try:
                return self.get(timeout=0.5)
            except queue.Empty:
                check()

    def close(self) -> None:
        pass


def cluster_key() -> bytes:
    key = os.environ.get("NANOINFER_CLUSTER_KEY", "")
    if not key:
        raise ValueError("a model over several nodes needs the same secret in the environment "
                         "variable NANOINFER_CLUSTER_KEY on every node")
    return key.encode()


def handshake(sock: socket.socket, role: bytes) -> Connection:
    """Prove the key to the peer and check its proof (`role` is b"head" or b"node": a proof is
    never valid the other way round); the link's connection."""
    key = cluster_key()
    sock.settimeout(node_timeout())
    challenge = secrets.token_bytes(32)
    sock.sendall(challenge)
    sock.sendall(hmac.digest(key, role + recv_exactly(sock, 32), "sha256"))
    other = b"node" if role == b"head" else b"head"
    if not hmac.compare_digest(recv_exactly(sock, 32), hmac.digest(key, other + challenge,
                                                                  "sha256")):
        raise AuthenticationError("the peer does not hold NANOINFER_CLUSTER_KEY's secret")
    sock.settimeout(None)
    return Connection(sock.detach())


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        if not (chunk := sock.recv(n - len(data))):
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return data


def fingerprint(config: Config) -> dict:
    """What every node must run alike. The code: a hash of nanoinfer's sources."""
    model = config.hf_config.to_dict()
    for local in ("_name_or_path", "transformers_version"):
        model.pop(local, None)
    sources = sorted(pathlib.Path(__file__).parents[1].rglob("*.py"))
    return {"model": f"{config.hf_config.architectures} {digest(repr(sorted(model.items())))}",
            "dtype": str(config.torch_dtype),
            "layout": f"tensor_parallel_size={config.tensor_parallel_size} pipeline_parallel_size="
                      f"{config.pipeline_parallel_size} nnodes={config.nnodes}",
            "code version": digest(b"".join(p.read_bytes() for p in sources))}


def digest(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:12]


def accept_nodes(config: Config) -> list[NodeLink]:
    """The head: every other node's link, in node order, each node authenticated and checked."""
    cluster_key()   # (set, before any wait)
    mine = fingerprint(config)
    links: dict[int, NodeLink] = {}
    host = config.master_addr
    port = config.master_port + 1
    deadline = time.monotonic() + start_timeout()
    with socket.create_server((host, port)) as server:
        logger.warning("waiting for nodes 1 to %d at %s:%d", config.nnodes - 1, host, port)
        while len(links) < config.nnodes - 1:
            server.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                sock, peer = server.accept()
            except TimeoutError:
                missing = sorted(set(range(1, config.nnodes)) - set(links))
                raise RuntimeError(f"nodes {missing} did not join in {start_timeout():g} s: start "
                                   "each with `python -m nanoinfer.serve ... --headless`") from None
            try:
                node_rank, link = admit(sock, peer, config, mine, links)
                links[node_rank] = link
            except Exception as e:   # (a wrong key, a stray client, a silent one, another model)
                sock.close()
                logger.warning("refused a connection from %s:%d: %s", *peer[:2], e)
    return [links[n] for n in sorted(links)]


def admit(sock: socket.socket, peer: tuple, config: Config, mine: dict,
          links: dict) -> tuple[int, NodeLink]:
    """A node's connection, authenticated, then checked: a refused node hears why."""
    conn = handshake(sock, b"head")
    try:
        node_rank, theirs = conn.recv() if conn.poll(node_timeout()) else (None, {})
        refusal = node_refusal(config, mine, node_rank, theirs, links)
        conn.send(refusal or config)
    except BaseException:
        conn.close()
        raise
    if refusal is not None:
        conn.close()
        raise ValueError(f"node {node_rank}: {refusal}")
    return node_rank, NodeLink(conn, f"node {node_rank} ({peer[0]})")


def node_refusal(config: Config, mine: dict, node_rank, theirs: dict, links: dict) -> str | None:
    if node_rank not in range(1, config.nnodes) or node_rank in links:
        return f"node_rank {node_rank!r} is taken or not one of 1..{config.nnodes - 1}"
    wrong = [f"{k}: the head's is {v}, this node's {theirs.get(k)}"
             for k, v in mine.items() if theirs.get(k) != v]
    return f"it differs from the head in {'; '.join(wrong)}" if wrong else None


def join_head(config: Config) -> tuple[NodeLink, Config]:
    """A node: connect to the head (waiting for it, bounded), authenticate, be checked; the link,
    and the head's configuration with this node's model path and rank."""
    cluster_key()   # (set, before any wait)
    address = (config.master_addr, config.master_port + 1)
    deadline = time.monotonic() + start_timeout()
    print(f"nanoinfer: node {config.node_rank} waiting for the head (node_rank 0) at "
          f"{address[0]}:{address[1]}, up to {start_timeout():g} s", flush=True)
    while True:
        try:
            sock = socket.create_connection(address, timeout=node_timeout())
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no head at {address[0]}:{address[1]} in {start_timeout():g} "
                                   f"s ({e}): start node_rank 0 with the same --master-addr and "
                                   "--master-port") from None
            time.sleep(1)
    conn = handshake(sock, b"node")
    conn.send((config.node_rank, fingerprint(config)))
    reply = conn.recv() if conn.poll(node_timeout()) else "no answer"
    if isinstance(reply, str):
        raise ValueError(f"the head refused node {config.node_rank}: {reply}")
    local = {"model": config.model, "node_rank": config.node_rank, "headless": True}
    return NodeLink(conn, "the head"), dataclasses.replace(reply, **local)


def read_node(link: NodeLink, responses: Inbox, fail) -> None:
    """The head's thread for a node: its outputs into the engine's ring; `fail(why)` when the node
    is lost or reports a rank's death."""
    try:
        while True:
            kind, payload = link.recv()
            if kind != "outputs":
                raise RuntimeError(payload)
            responses.put(payload)
    except Exception as e:
        fail(f"{link.peer} was lost: {e}")


def run_headless(config: Config) -> int:
    """A node other than the head: join it, start this node's ranks, pass them the head's calls,
    and return an exit status: 0 after the head's "shutdown", 1 when the head or a rank is lost."""
    from nanoinfer.executor.multiproc_executor import rendezvous, start_worker, stop_processes
    link, config = join_head(config)
    ranks = node_ranks(config)
    calls = MessageQueue(num_readers=len(ranks))
    has_driver = driver_rank(config) in ranks
    responses = MessageQueue(num_readers=1) if has_driver else None
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    workers = []
    try:
        for rank in ranks:
            workers.append(start_worker(ctx, config, rank, rendezvous(config), calls, responses,
                                        errors))
        if has_driver:
            responses.as_reader(0)
            threading.Thread(target=send_outputs, args=(responses, link), daemon=True).start()
        return relay_calls(link, calls, workers, errors)
    finally:
        stop_processes(workers, 0)
        link.close()
        for ring in (calls, responses):
            if ring is not None:
                ring.close()


def relay_calls(link: NodeLink, calls: MessageQueue, workers: list, errors) -> int:
    def check():
        if not all(w.is_alive() for w in workers):
            raise ChildProcessError("a rank of this node died")
    try:
        while (call := link.recv(also=[w.sentinel for w in workers])) is not None:
            calls.enqueue(call, check)
            if call[0] == "shutdown":
                for worker in workers:
                    worker.join(5)
                return 0
    except ChildProcessError:
        pass
    except (EOFError, OSError) as e:
        print(f"nanoinfer: lost the head ({e or 'it closed the link'}): stopping this node's ranks",
              flush=True)
        return 1
    reports = []
    while not errors.empty():
        reports.append(errors.get()[1])
    link.send(("error", "".join(reports) or "a rank died (its output may say why)"))
    return 1


def send_outputs(responses: MessageQueue, link: NodeLink) -> None:
    while True:
        link.send(("outputs", responses.dequeue(check=lambda: None)))


def node_ranks(config: Config) -> range:
    """The ranks this node runs."""
    per_node = config.world_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def driver_rank(config: Config) -> int:
    """The rank that samples and sends the outputs: the last stage's first."""
    return config.world_size - config.tensor_parallel_size
