"""The engine core in a process of its own, stepping in a busy loop, and the client that feeds it.

A server's front end (AsyncLLM) tokenizes, detokenizes and answers HTTP; the core process only
schedules and runs the model, so none of that front-end work ever holds up the GPU:

    front end (the server's process)                          engine core process (per DP rank)
    AsyncLLM.generate -> InputProcessor
        client.add_request: ("add", EngineCoreRequest)   ---->  EngineCore.add_request
        client.abort:       ("abort" or "stop", [seq ids]) -->  EngineCore.abort_requests
        AsyncLLM.watch:     ("view", on or off)          ---->  EngineCore.watch (event_log.py)
                                                                 loop: take what came, step()
        output thread <-- ("outputs", [EngineCoreOutput], SchedulerStats, [records]), every step
    OutputProcessor (detokenize, stop strings) -> each request's queue

The channel is `multiprocessing.connection` over a socket pair (a core on another node: over its
link, executor/node_link.py): pickled Python objects, no extra package, and `wait()` watches
every core's socket and process at once; a step's message is a few KB (vLLM uses ZeroMQ and
msgpack, for lower serialisation cost). The core never waits while it has work: between steps it
takes the messages that have come; idle, it blocks on them. Each core's messages go through a
queue and a writer thread of its own: a core that stops reading (a step that hangs) holds up
neither the event loop nor the other cores. A core's exception reaches the client as ("dead",
traceback), and the core exits; one killed outright is seen by its process handle or closed
socket (what it left is read first): its requests get an error, never silence. A core exits
when the front end is gone. Data parallelism: N cores, each with its own GPUs (or the CPU); a
new request goes to the core with the lowest 4 x waiting + running (as each last reported, plus
what was sent to it since), vLLM's first load balancer; its aborts go to the core that has it.
"""
import copy
import logging
import multiprocessing as mp
import os
import queue
import threading
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

from nanoinfer.config import Config, check_int
from nanoinfer.engine.core import EngineCore
from nanoinfer.core.messages import EngineCoreRequest, SchedulerStats
from nanoinfer.engine.exceptions import EngineDeadError
from nanoinfer.executor.node_link import accept, join, start_timeout
from nanoinfer.utils import (child_process, core_gpus, engine_num_threads, require,
                             stop_processes)

logger = logging.getLogger("nanoinfer")


@child_process   # (Ctrl-C and SIGTERM are the front end's)
def run_engine_core(config: Config, conn) -> None:
    """The core process: step while there is work, take messages between steps."""
    core = None

    def handle(kind, payload) -> bool:
        if kind == "add":
            core.add_request(payload)
        elif kind in ("abort", "stop"):   # ("stop": a stop string the front end found)
            core.abort_requests(payload, kind)
        elif kind == "view":   # (a live viewer came, or left: engine/event_log.py)
            core.watch(payload)
        return kind != "shutdown"

    try:
        from nanoinfer.engine.front_end import load_tokenizer
        core = EngineCore(config, load_tokenizer(config))
        # Ready, with its number of KV-cache blocks (the server's metrics report it).
        conn.send(("ready", core.scheduler.block_manager.num_blocks))
        while True:
            while conn.poll(0):
                if not handle(*conn.recv()):
                    return
            busy = core.has_unfinished()
            outputs = core.step() if busy else []
            # (and the event log's records since the last, for a live viewer)
            records = core.event_log.take() if core.event_log is not None else []
            conn.send(("outputs", outputs, core.stats(), records))
            # Idle: wait for the next message.
            if not busy and not handle(*conn.recv()):
                return
    # The front end is gone.
    except (EOFError, BrokenPipeError):
        pass
    except BaseException:
        try:
            conn.send(("dead", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if core is not None:
            core.shutdown()


def start_cores(config: Config, data_parallel_size: int, links: list | None = None) -> tuple:
    """Start the core processes, each on its own GPUs and share of CPU threads (OMP_NUM_THREADS,
    unless set); their connections and processes. `links`: their links to another node's head."""
    ctx = mp.get_context("spawn")
    conns = []
    procs = []
    saved = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")}
    ranks = len(config.node_ranks)   # (of this node: other nodes run theirs)
    gpus = core_gpus(data_parallel_size, ranks) if config.device == "cuda" else None
    threads = engine_num_threads(config.device, data_parallel_size * ranks)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        for rank in range(data_parallel_size):
            if gpus is not None:   # (read as the child starts)
                os.environ["CUDA_VISIBLE_DEVICES"] = gpus[rank]
            parent, child = ctx.Pipe() if links is None else (None, links[rank])
            core_config = copy.copy(config)   # (several cores: each its own event log)
            if config.event_log and data_parallel_size > 1:
                core_config.event_log = f"{config.event_log}.{rank}"
            procs.append(ctx.Process(target=run_engine_core, args=(core_config, child),
                                     name=f"nanoinfer-core-{rank}"))
            procs[-1].start()
            child.close()
            conns.append(parent)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return conns, procs


def run_headless_cores(config: Config, address: tuple[str, int], ranks: range) -> int:
    """A node of data-parallel cores `ranks` for the head's front end (`serve ... --headless`):
    each core joins the head (executor/node_link.py), then runs as a local one does, over its
    link. Returns once they have all exited."""
    joined = [join(config, address, rank, "data-parallel core") for rank in ranks]
    procs = start_cores(joined[0][1], len(ranks), [conn for conn, _ in joined])[1]
    try:
        for proc in procs:
            proc.join()
    finally:
        stop_processes(procs, 0)
    return int(any(proc.exitcode for proc in procs))


class EngineCoreClient:
    """Starts the core processes and talks to them. `on_message(rank, message)` is called from the
    reader thread for every message a core sends, and with ("dead", reason) when a core dies."""

    def __init__(self, config: Config, on_message: Callable, data_parallel_size: int = 1,
                 data_parallel_size_local: int | None = None,
                 data_parallel_address: tuple[str, int] | None = None):
        check_int("data_parallel_size", data_parallel_size, 1)
        local = data_parallel_size_local or data_parallel_size
        require(1 <= local <= data_parallel_size and min(data_parallel_size, config.nnodes) == 1,
                f"data_parallel_size_local={local} must be in 1..{data_parallel_size}, and data "
                f"parallelism with nnodes={config.nnodes} > 1 is not supported yet")
        self.on_message = weakref.WeakMethod(on_message)   # (the reader must not keep it alive)
        rest = range(local, data_parallel_size)   # other nodes' cores, first (node_link.py)
        links = accept(config, data_parallel_address, "data-parallel core", rest) if rest else []
        self.conns, self.procs = start_cores(config, local)
        self.conns += links
        self.alive = [True] * data_parallel_size
        self.closing = False
        self.reader = None
        self.outboxes = [queue.SimpleQueue() for _ in self.conns]   # (each core's writer's)
        for rank in range(data_parallel_size):
            threading.Thread(target=self.write, args=(rank,), daemon=True,
                             name=f"nanoinfer-core-writer-{rank}").start()
        # Wait for every core to start (and stop them on Ctrl-C meanwhile): each one's KV blocks.
        self.num_gpu_blocks = []
        try:
            for rank in range(data_parallel_size):
                self.num_gpu_blocks.append(self.wait_until_ready(rank))
        except BaseException:
            # A core still loading reads no message: stopped at once (its workers follow it).
            for proc in self.procs[len(self.num_gpu_blocks):]:
                proc.kill()
            self.shutdown()
            raise
        self.stats = [SchedulerStats() for _ in self.conns]
        # Requests sent to each core (its stats count those received); request_id -> its core.
        self.num_sent = [0] * len(self.conns)
        self.owner: dict[str, int] = {}
        self.reader = threading.Thread(target=self.read, name="nanoinfer-core-reader", daemon=True)
        self.reader.start()

    def wait_until_ready(self, rank: int) -> int:
        """Core `rank`'s number of KV-cache blocks once started; else a RuntimeError saying why."""
        try:
            conn = self.conns[rank]
            ready = conn.poll(600 + start_timeout())   # (loading, after waiting for other nodes)
            message = conn.recv() if ready else ("dead", "it did not start in time")
        except (EOFError, OSError):
            message = ("dead", self.ended(rank))
        if message[0] != "ready":
            raise RuntimeError(f"engine core {rank} failed to start:\n{message[1]}")
        return message[1]

    def add_request(self, request: EngineCoreRequest) -> None:
        live = [r for r in range(len(self.conns)) if self.alive[r]]
        if not live:
            raise EngineDeadError("every engine core has died")
        rank = min(live, key=self.load)
        # Sent first, so that a message that cannot be pickled leaves no trace.
        self.send(rank, ("add", request))
        self.owner[request.request_id] = rank
        self.num_sent[rank] += 1

    def load(self, rank: int) -> int:
        """4 x waiting + running, where waiting counts the requests still on their way to it."""
        s = self.stats[rank]
        return 4 * (s.num_waiting + self.num_sent[rank] - s.num_requests_added) + s.num_running

    def abort(self, request_id: str, seq_ids: list[int]) -> None:
        """Abort a request's sequences (or those that a stop string ended) in its core."""
        rank = self.owner.get(request_id)
        if rank is not None and seq_ids:
            self.send(rank, ("abort", seq_ids))

    def finished(self, request_id: str) -> None:
        self.owner.pop(request_id, None)

    def send(self, rank: int, message) -> None:
        """Pickled here, in the caller's thread: its errors are the caller's, and a later change
        does not reach the core."""
        self.outboxes[rank].put(bytes(ForkingPickler.dumps(message)))

    def write(self, rank: int) -> None:
        """A core's writer thread: its messages, in order, until None."""
        while (message := self.outboxes[rank].get()) is not None:
            try:
                self.conns[rank].send_bytes(message)
            except OSError:   # (it died: the reader reports that)
                return

    def read(self) -> None:
        """The reader thread: every core's messages to `on_message`, and any core's death."""
        try:
            self.read_messages()
        # A bug: the cores are dead to the front end, which must hear it.
        except BaseException:
            reason = f"the front end's reader failed:\n{traceback.format_exc()}"
            logger.error(reason)
            for rank in [r for r in range(len(self.conns)) if self.alive[r]]:
                self.alive[rank] = False
                if (on_message := self.on_message()) is not None:
                    on_message(rank, ("dead", reason))

    def read_messages(self) -> None:
        sources = {conn: rank for rank, conn in enumerate(self.conns)}
        sources |= {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while any(self.alive):
            for source in wait([s for s, r in sources.items() if self.alive[r]]):
                rank = sources[source]
                conn = self.conns[rank]
                if self.closing:
                    return
                if not self.alive[rank]:
                    continue
                # A message; or, if it ended, all it left, then (if it gave no word) how it ended.
                try:
                    self.deliver(rank, conn.recv())
                    while source is not conn and self.alive[rank]:
                        self.deliver(rank, conn.recv())
                except (EOFError, OSError) as e:
                    if self.alive[rank]:
                        self.deliver(rank, ("dead", self.ended(rank, e)))

    def ended(self, rank: int, error: BaseException | None = None) -> str:
        """How core `rank`, whose connection closed, ended."""
        if rank >= len(self.procs):   # (on another node)
            return f"its node's link was lost: {str(error or '') or 'it closed'}"
        self.procs[rank].join(1)
        return f"its process ended (exit code {self.procs[rank].exitcode})"

    def deliver(self, rank: int, message: tuple) -> None:
        if message[0] == "outputs":
            self.stats[rank] = message[2]
        elif message[0] == "dead":
            self.alive[rank] = False
            logger.error("engine core %d died: %s", rank, message[1])
        if (on_message := self.on_message()) is not None:
            on_message(rank, message)

    def shutdown(self) -> None:
        """Stop every core (a last resort: kill it) and close the sockets. Idempotent."""
        self.closing = True
        # After what was queued; then the writer stops.
        for outbox in self.outboxes:
            outbox.put(bytes(ForkingPickler.dumps(("shutdown", None))))
            outbox.put(None)
        stop_processes(self.procs, 10)
        if self.reader is not None:
            self.reader.join(5)
        self.alive = [False] * len(self.conns)
        for conn in self.conns:
            conn.close()
