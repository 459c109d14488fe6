"""Tensor and pipeline parallelism's processes: the engine in the user's process, every rank in a
worker.

Every rank holds a shard of the model, a KV cache for its own KV heads, its own CUDA graphs and
the same persistent batch, and runs the same forward; the collectives inside the forward (the
all-reduces of the row-parallel layers) keep the shards in step. The engine's process schedules
and detokenizes and never touches a GPU. A step reaches the ranks as the scheduler's own message
(`SchedulerOutput`, only what changed since the last step), written into shared memory
(`message_queue.py`); every rank applies it to its persistent batch, as a one-rank engine's
runner does. Rank 0 samples from the logits gathered to it and sends the tokens back through a
second queue, from a thread, once the GPU has them, so that it is already launching the next step:

    engine process                   rank 0 (worker)                  rank r (worker)
    execute_model(sched)
      queue <- ("execute_model", sched) ---> runner.execute_model ... runner.execute_model
                                              forward  ...... all-reduce per layer ...... forward
                                              logits <------- gather ------------------ logit shard
    sample_tokens(grammar)
      queue <- ("sample_tokens", grammar) -> runner.sample_tokens ... runner.sample_tokens
                                              sample; broadcast tokens --> next step's inputs
    get_output()  <-- responses <-- thread: tokens on the host

With pipeline parallelism every rank still gets every call, and each stage's ranks work as above
on their own layers, the hidden states going from stage to stage point to point (model_runner.py);
the driver, which samples and answers, is the last stage's first rank. The engine keeps up to one
step in flight per stage, over disjoint sequences (engine/core.py), so a stage starts the next
step while the one after it still runs the last.

Lifecycle. Workers are started with the spawn method and exit on "shutdown" (`shutdown()`, called
by the engine, also when it is dropped or at interpreter exit), when the engine's process is
gone, or on their own error, which they report before exiting. A monitor thread waits on the
workers' process handles: when one dies it records why and kills the others (a rank whose peer
died may wait inside a CUDA graph forever: only its process's end frees its GPU), and the
engine's next wait raises `WorkerDiedError` saying which worker died and why. Workers ignore
Ctrl-C: the engine takes it and shuts them down. Ranks on other nodes: multinode.py.
"""
import contextlib
import copy
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait as wait_for_any

import torch

from nanoinfer import distributed
from nanoinfer.config import Config
from nanoinfer.core.messages import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from nanoinfer.worker.model_runner import ModelRunner
from nanoinfer.executor.message_queue import MessageQueue
from nanoinfer.executor.node_link import accept, hang_up
from nanoinfer.utils import child_process, engine_num_threads, require, stop_processes


class WorkerDiedError(RuntimeError):
    """A worker process died, or the workers were shut down: the message says which and why."""


class MultiprocExecutor:

    def __init__(self, config: Config):
        if mp.current_process().name.startswith("nanoinfer-tp"):
            raise RuntimeError("a tensor-parallel worker, importing the main script, was asked to "
                               "start an LLM itself: create it under `if __name__ == '__main__':` "
                               "in your script")
        require(config.node_rank == 0, f"node_rank {config.node_rank} runs no engine, only its "
                "ranks: start it with `python -m nanoinfer.serve ... --headless`")
        # The other nodes' links first (multinode.py): a refused node never meets a rank.
        self.links = (accept(config, (config.master_addr, config.master_port + 1), "node",
                             range(1, config.nnodes)) if config.nnodes > 1 else [])
        self.queue = MessageQueue(num_readers=len(config.node_ranks))   # calls, to every rank here
        self.responses = MessageQueue(num_readers=1)   # the driver's outputs, to this process
        # what a dying worker reports: (its ValueError's message or None, its traceback)
        self.errors = mp.get_context("spawn").SimpleQueue()
        self.workers: list[mp.Process] = []
        self.failure: str | None = None   # why a worker died, once one has
        self.setting_error: str | None = None   # the message of a ValueError a worker died of
        self.closed = False
        self.lock = threading.Lock()   # between shutdown() and the monitor thread
        try:
            start_workers(self.workers, config, self.queue, self.responses, self.errors)
            threading.Thread(target=self.monitor_workers, daemon=True).start()
            for node, link in enumerate(self.links, start=1):   # (a writer of the ring each)
                threading.Thread(target=read_node, args=(link, node, copy.copy(self.responses),
                                                         self.fail), daemon=True).start()
            # the driver is ready
            self.num_kvcache_blocks = self.responses.dequeue(self.check_health)
        except BaseException as e:
            self.shutdown(graceful=False)
            if isinstance(e, WorkerDiedError) and self.setting_error is not None:
                raise ValueError(self.setting_error) from e   # a bad setting, found by the ranks
            raise

    def execute_model(self, sched: SchedulerOutput) -> None:
        """Every rank runs the step (each keeps its executed step for `sample_tokens`)."""
        self.check_health()
        self.send(("execute_model", (sched,)), self.check_health)

    def sample_tokens(self, executed: None, grammar: GrammarOutput | None = None) -> "FutureOutput":
        self.check_health()
        self.send(("sample_tokens", (grammar,)), self.check_health)
        return FutureOutput(self)

    def send(self, call: tuple, check) -> None:
        """A call to every rank: through the ring to this node's, over its link to another's."""
        for node, link in enumerate(self.links, start=1):
            try:
                link.send(call)
            except OSError as e:
                self.fail(f"node {node} was lost: {e}")
                self.check_health()
        self.queue.enqueue(call, check)

    def check_health(self) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)
        if self.closed:   # shut down by another thread
            raise WorkerDiedError("the tensor-parallel workers were shut down")

    def monitor_workers(self) -> None:
        handles = {w.sentinel: w for w in self.workers}
        dead = handles[wait_for_any(list(handles))[0]]
        dead.join(timeout=1)
        self.fail(f"tensor-parallel worker {dead.name} (pid {dead.pid}) died with exit code "
                  f"{dead.exitcode}", hint=" (its output may say why)")

    def fail(self, reason: str, hint: str = "") -> None:
        """A worker or a node is lost: stop the workers, and note why, with what they reported."""
        with self.lock:
            if self.closed or self.failure is not None:   # (stopped by shutdown(), or failed)
                return
            reports = []
            try:
                while not self.errors.empty():
                    reports.append(self.errors.get())
            finally:
                stop_processes(self.workers, 0)
                self.setting_error = next((m for m, _ in reports if m is not None), None)
                self.failure = reason + ("".join(f"\n{r}" for _, r in reports) or hint)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers and remove the shared memory. Idempotent. `graceful=False` (after an
        error: the ranks may be in different places) kills the workers without a word. Ctrl-C is
        held off meanwhile, so nothing is left half-done."""
        main_thread = threading.current_thread() is threading.main_thread()
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            with self.lock:
                if self.closed:
                    return
                self.closed = True
            try:
                if graceful and self.failure is None:   # every worker waits for its next message
                    limit = time.monotonic() + 5

                    def check():
                        if time.monotonic() > limit or not all(w.is_alive() for w in self.workers):
                            raise WorkerDiedError("a worker did not take the shutdown message")
                    try:
                        self.send(("shutdown", ()), check)
                    except (WorkerDiedError, OSError):
                        graceful = False
                stop_processes(self.workers, 5 if graceful else 0)
            finally:
                for link in self.links:
                    hang_up(link)
                for close in (self.queue.close, self.responses.close, self.errors.close):
                    with contextlib.suppress(OSError):   # (a segment someone else removed)
                        close()
                self.errors = None   # the last reference: its locks' named semaphores are removed
        finally:
            if sigint is not None:
                signal.signal(signal.SIGINT, sigint)


class FutureOutput:
    """A launched step's output, which the driver sends once its GPU has it."""

    def __init__(self, executor: MultiprocExecutor):
        self.executor = executor

    def get_output(self) -> ModelRunnerOutput:
        self.executor.check_health()
        return self.executor.responses.dequeue(self.executor.check_health)


def read_node(conn: Connection, node: int, responses: MessageQueue, fail) -> None:
    """The head's thread for a node: what it sends (the driver's outputs, if it is on that node)
    into the engine's ring; `fail(why)` once the node is lost."""
    try:
        while True:
            responses.enqueue(conn.recv(), check=lambda: None)
    except Exception as e:
        fail(f"node {node} was lost: {str(e) or 'it closed the link'}")


def start_workers(workers: list, config: Config, calls: MessageQueue, responses: MessageQueue,
                  errors) -> None:
    """Start this node's ranks, each added to `workers` once started (the caller stops them, also
    after a failed start); the driver, if it is one of them, writes `responses`, read here."""
    # torch.distributed's rendezvous: the head's TCPStore (one node's: at a free port)
    init_method = f"tcp://{config.master_addr}:{config.master_port or free_port()}"
    for rank in config.node_ranks:
        worker = mp.get_context("spawn").Process(
            target=worker_main, name=f"nanoinfer-tp{rank}", daemon=True,
            args=(config, rank, init_method, calls,
                  responses if rank == config.driver_rank else None, errors))
        worker.start()
        workers.append(worker)
    responses.as_reader(0)


@child_process   # (Ctrl-C is the engine's; the engine removes the shared memory)
def worker_main(config: Config, rank: int, init_method: str, calls: MessageQueue,
                responses: MessageQueue | None, errors) -> None:
    """A worker's life: join the group, build the model shard, then run calls until "shutdown"."""
    calls.as_reader(rank - config.node_ranks.start)   # (its node's ring)
    try:
        distributed.init_distributed(rank, config.world_size, init_method,
                                     "nccl" if config.device == "cuda" else "gloo",
                                     config.tensor_parallel_size)
        if "OMP_NUM_THREADS" not in os.environ:   # (set by the user, or by a server for its cores)
            torch.set_num_threads(engine_num_threads(config.device, len(config.node_ranks)))
        runner = ModelRunner(config)
        outputs = queue.SimpleQueue()   # the driver: launched steps' outputs, for the sender thread
        driver = rank == config.driver_rank
        if driver:
            responses.enqueue(runner.num_kvcache_blocks, check=lambda: None)
            threading.Thread(target=send_outputs, args=(outputs, responses, errors, rank),
                             daemon=True).start()
        executed = None   # the step executed last, for its sample_tokens
        while (call := calls.dequeue(check=lambda: None))[0] != "shutdown":
            method, args = call
            if method == "execute_model":
                executed = runner.execute_model(*args)
            elif method == "sample_tokens":
                output = runner.sample_tokens(executed, *args)
                executed = None
                if driver:
                    outputs.put(output)
            else:
                getattr(runner, method)(*args)
        if runner.kv_connector is not None:   # (a producer's queued blocks are saved first)
            runner.kv_connector.shutdown()
        if runner.device.type == "cuda":   # the last step's collectives finish on every rank
            torch.cuda.synchronize(runner.device)
    except BaseException as e:
        report(errors, rank, e)


def send_outputs(outputs: queue.SimpleQueue, responses: MessageQueue, errors, rank: int) -> None:
    try:
        while (output := outputs.get()) is not None:
            responses.enqueue(output.get_output(), check=lambda: None)   # waits for the GPU
    except BaseException as e:
        report(errors, rank, e)


def report(errors, rank: int, error: BaseException) -> None:
    """Tell the engine why this worker dies, and die. Only short strings go: a report must fit the
    pipe whole (nobody reads it until the worker is dead) and unpickle anywhere. The message of a
    ValueError (a bad setting, found at start-up) becomes the engine's own ValueError."""
    try:
        errors.put((str(error)[:2000] if isinstance(error, ValueError) else None,
                    f"rank {rank}: {traceback.format_exc()[-4000:]}"))
    finally:
        os._exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
