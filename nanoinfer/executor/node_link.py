"""Links between the head and the other nodes: one TCP connection each, made at start-up,
authenticated before anything is unpickled, to nodes that run what the head runs.

Two kinds of node use them (`python -m nanoinfer.serve ... --headless`): a node of a model's
pipeline stages (multinode.py), whose process passes the head's calls to its ranks, and a node of
data-parallel engine cores (`run_headless_cores`, engine/core_client.py), each core's link
carrying what a local core's socket pair carries.

Trust. A link is made only after both ends proved they hold the secret in NANOINFER_CLUSTER_KEY:
each sends a random challenge and checks the other's HMAC-SHA256 of it (with its role, so that a
proof cannot be sent back to its maker). Then the node says what it runs, its fingerprint (the
model's config.json, the dtype, the layout, a hash of nanoinfer's code), and the head refuses one
that differs, naming what, and goes on waiting; an accepted node is sent the head's
configuration, so every other setting is the head's. The head listens only on the address it is
given, and only until every node has joined. torch.distributed's store and its collectives
authenticate nobody: like vLLM's, they must sit on a trusted network.

Faults. The kernel watches each link (TCP keep-alive probes, and a limit on data left
unacknowledged): a peer that is killed closes it at once, and a machine that is gone or cut off
ends it within about NANOINFER_NODE_TIMEOUT seconds (20 by default). Either end then knows: the
head fails what depended on that node, and a node stops. A peer whose machine answers while its
process hangs is not seen this way. At start-up each side waits for the other up to
NANOINFER_NODE_START_TIMEOUT seconds (600 by default), and says what it waits for.
"""
import collections
import contextlib
import dataclasses
import hmac
import logging
import os
import pathlib
import secrets
import socket
import time
from hashlib import sha256
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection

from nanoinfer.config import Config
from nanoinfer.utils import require

logger = logging.getLogger("nanoinfer")


def node_timeout() -> float:
    return float(os.environ.get("NANOINFER_NODE_TIMEOUT", "20"))


def start_timeout() -> float:
    return float(os.environ.get("NANOINFER_NODE_START_TIMEOUT", "600"))


def cluster_key() -> bytes:
    key = os.environ.get("NANOINFER_CLUSTER_KEY", "")
    require(key != "", "nodes need the same secret in NANOINFER_CLUSTER_KEY, on every node")
    return key.encode()


def handshake(sock: socket.socket, role: bytes) -> Connection:
    """Prove the key to the peer and check its proof (`role` is b"head" or b"node": a proof is
    never valid the other way round); the link's connection."""
    key = cluster_key()
    timeout = node_timeout()
    deadline = time.monotonic() + timeout   # (for the whole of it: no slow drip)
    sock.settimeout(timeout)
    challenge = secrets.token_bytes(32)
    sock.sendall(challenge)
    sock.sendall(hmac.digest(key, role + recv_exactly(sock, 32, deadline), "sha256"))
    other = b"node" if role == b"head" else b"head"
    if not hmac.compare_digest(recv_exactly(sock, 32, deadline),
                               hmac.digest(key, other + challenge, "sha256")):
        raise AuthenticationError(f"the {other.decode()} holds another NANOINFER_CLUSTER_KEY")
    sock.settimeout(None)
    # The kernel ends the link when the peer's machine is gone or cut off: probes once it has
    # been idle for half the timeout, and a limit on data left unacknowledged.
    for option, value in ((socket.TCP_KEEPIDLE, timeout / 2), (socket.TCP_KEEPINTVL, timeout / 8),
                          (socket.TCP_KEEPCNT, 4), (socket.TCP_USER_TIMEOUT, timeout * 1000)):
        sock.setsockopt(socket.IPPROTO_TCP, option, max(1, int(value)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return Connection(sock.detach())


def hang_up(conn: Connection) -> None:
    """Close a link at once, also while another thread waits on it (which then reads its end)."""
    with contextlib.suppress(OSError), socket.fromfd(conn.fileno(), socket.AF_INET,
                                                     socket.SOCK_STREAM) as sock:
        sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        if not (chunk := sock.recv(n - len(data))):
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return data


def fingerprint(config: Config) -> dict:
    """What every node must run alike. The code: a hash of nanoinfer's sources."""
    sources = sorted(pathlib.Path(__file__).parents[1].rglob("*.py"))
    model = pathlib.Path(config.model, "config.json").read_bytes()
    return {"model": f"{config.hf_config.architectures[0]} {sha256(model).hexdigest()[:12]}",
            "dtype": str(config.torch_dtype),
            "(tensor, pipeline, nodes)": (config.tensor_parallel_size,
                                          config.pipeline_parallel_size, config.nnodes),
            "code version": sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]}


def accept(config: Config, address: tuple[str, int], what: str, ranks: range) -> list:
    """The head: a connection from each of `ranks` (of nodes, or of data-parallel cores: `what`),
    in order, each authenticated and checked. Anything else is refused, logged, and waited past;
    if not all join in time, the error names the last refusals and their reasons."""
    cluster_key()   # (set, before any wait)
    mine = fingerprint(config)
    joined: dict[int, Connection] = {}
    refused = collections.deque(maxlen=3)   # (the last refusals, for the error)
    deadline = time.monotonic() + start_timeout()
    with socket.create_server(address) as server, contextlib.ExitStack() as unless_all_join:
        logger.warning("waiting for %ss %s at %s:%d", what, list(ranks), *address)
        while len(joined) < len(ranks):
            server.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                sock, peer = server.accept()
            except TimeoutError:
                raise RuntimeError(f"{what}s {sorted(set(ranks) - set(joined))} did not join in "
                                   f"{start_timeout():g} s (`serve ... --headless`)"
                                   + "".join(f"; {why}" for why in refused)) from None
            try:
                rank, conn = admit(sock, mine, ranks, joined)
                joined[rank] = unless_all_join.enter_context(conn)   # (closed on an error)
            except Exception as e:   # (a wrong key, a stray client, a silent one, another model)
                sock.close()
                refused.append(f"{what} from {peer[0]}:{peer[1]} refused: {e}")
                logger.warning(refused[-1])
        for conn in joined.values():   # (all at once: every node's ranks start together)
            conn.send(config)
        unless_all_join.pop_all()
    return [joined[r] for r in ranks]


def admit(sock: socket.socket, mine: dict, ranks: range, joined: dict) -> tuple[int, Connection]:
    """A connection, authenticated, then checked: a refused peer hears why."""
    conn = handshake(sock, b"head")   # (on an error below, the caller's drop of it closes it)
    rank, theirs = conn.recv() if conn.poll(node_timeout()) else (None, {})
    if (refusal := refuse(mine, rank, theirs, ranks, joined)) is not None:
        conn.send(refusal)
        conn.close()
        raise ValueError(refusal)
    return rank, conn


def refuse(mine: dict, rank, theirs: dict, ranks: range, joined: dict) -> str | None:
    """Why a peer that proved the key is refused (None: it is not)."""
    if rank not in ranks or rank in joined:
        return f"rank {rank!r} is taken or not one of {list(ranks)}"
    wrong = [f"{k}: the head's is {v}, this node's {theirs.get(k)}"
             for k, v in mine.items() if theirs.get(k) != v]
    return f"it differs from the head in {'; '.join(wrong)}" if wrong else None


def join(config: Config, address: tuple[str, int], rank: int, what: str) -> tuple:
    """Connect to the head (waiting for it, bounded), authenticate, be checked as `what` `rank`;
    the connection, and the head's configuration with this node's own model path and rank."""
    cluster_key()   # (set, before any wait)
    deadline = time.monotonic() + start_timeout()
    print(f"nanoinfer: {what} {rank} waiting for the head at {address}", flush=True)
    while True:
        try:   # (again, until the deadline, also when the handshake times out)
            conn = handshake(socket.create_connection(address, timeout=node_timeout()), b"node")
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no head at {address[0]}:{address[1]} in {start_timeout():g} "
                                   f"s ({e}): is it started, with this address and port?") from None
            time.sleep(1)
    conn.send((rank, fingerprint(config)))
    reply = conn.recv() if conn.poll(start_timeout()) else "no answer"   # (once all have joined)
    require(not isinstance(reply, str), f"the head refused {what} {rank}: {reply}")
    return conn, dataclasses.replace(reply, model=config.model, node_rank=config.node_rank,
                                     master_addr=config.master_addr)

