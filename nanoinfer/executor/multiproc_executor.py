"""Tensor parallelism's processes: rank 0 in the engine's own process, ranks 1..N-1 in workers.

Every rank holds a shard of the model, a KV cache for its own KV heads, its own CUDA graphs and
the same persistent batch, and runs the same forward; the collectives inside the forward (the
all-reduces of the row-parallel layers) keep the shards in step. Rank 0 is also the engine: it
schedules, samples from the logits gathered to it, and detokenizes. A step reaches the workers as
the scheduler's own message (`SchedulerOutput`, only what changed since the last step), written by
rank 0 into shared memory (`message_queue.py`), and the workers apply it to their persistent
batch exactly as rank 0's runner does:

    rank 0 (engine process)                      rank r (worker process)
    executor.execute_model(sched)
      queue <- ("execute_model", sched)   --->   ("execute_model", sched) <- queue
      runner.execute_model(sched)                runner.execute_model(sched)
        forward ........ all-reduce per layer ........ forward
        logits <-------- gather ---------------------- logit shard
    executor.sample_tokens()
      queue <- ("sample_tokens",)         --->   runner.sample_tokens()
      sample; broadcast tokens ------------------->  next step's decode inputs

Lifecycle. Workers are started with the spawn method and exit on "shutdown" (`shutdown()`, called
by the engine, also when it is dropped or at interpreter exit), when rank 0's process is gone, or
on their own error, which they report before exiting. A monitor thread on rank 0 waits on the
workers' process handles: when one dies it records why, stops the others and, on GPUs, aborts the
NCCL groups so that nothing waits on the GPU for the dead rank any more; rank 0's next call
raises `WorkerDiedError` saying which worker died and why. Workers ignore Ctrl-C: rank 0 takes it
and shuts them down.
"""
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import traceback
from multiprocessing.connection import wait as wait_for_any

import torch

from nanoinfer import distributed
from nanoinfer.config import Config
from nanoinfer.engine.messages import SchedulerOutput
from nanoinfer.engine.model_runner import AsyncModelRunnerOutput, ModelRunner
from nanoinfer.executor.message_queue import MessageQueue, wait


class WorkerDiedError(RuntimeError):
    pass


class MultiprocExecutor:

    def __init__(self, config: Config):
        if mp.current_process().name.startswith("nanoinfer-tp"):
            raise RuntimeError("a tensor-parallel worker, importing the main script, was asked to start an "
                               "LLM itself: create it under `if __name__ == '__main__':` in your script")
        if torch.distributed.is_initialized():
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}: this process already "
                             "belongs to a torch.distributed group (another tensor-parallel LLM still "
                             "running? call its shutdown() first)")
        self.world_size = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self.queue = MessageQueue(num_readers=self.world_size - 1)
        self.errors = ctx.SimpleQueue()   # a failing worker's traceback
        started = ctx.Semaphore(0)        # released by each worker once its device works
        self.workers: list[mp.Process] = []
        self.runner: ModelRunner | None = None
        self.failure: str | None = None   # why a worker died, once one has
        self.closed = False
        self.lock = threading.Lock()   # between shutdown() and the monitor thread
        init_method = f"tcp://127.0.0.1:{free_port()}"
        try:
            for rank in range(1, self.world_size):
                self.workers.append(ctx.Process(target=worker_main, name=f"nanoinfer-tp{rank}", daemon=True,
                                                args=(config, rank, init_method, self.queue, self.errors,
                                                      started)))
                self.workers[-1].start()
            threading.Thread(target=self.monitor_workers, daemon=True).start()
            for _ in self.workers:   # one that fails before the rendezvous would leave us waiting there
                wait(started, self.check_health)
            distributed.init_distributed(0, self.world_size, init_method, backend(config))
            self.runner = ModelRunner(config)
        except BaseException as e:
            died = self.worker_died(e)
            self.shutdown(graceful=False)
            if died:
                raise WorkerDiedError(self.failure) from e
            raise
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks

    def execute_model(self, sched: SchedulerOutput) -> None:
        self.call("execute_model", sched)

    def sample_tokens(self) -> AsyncModelRunnerOutput:
        return CheckedOutput(self.call("sample_tokens"), self)

    def call(self, method: str, *args):
        """Run `method` of the model runner on every rank: the workers through the queue, then here."""
        self.check_health()
        try:
            self.queue.enqueue((method, args), self.check_health)
            return getattr(self.runner, method)(*args)
        except Exception as e:
            if self.worker_died(e):
                raise WorkerDiedError(self.failure) from e
            raise

    def check_health(self) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def worker_died(self, error: BaseException) -> bool:
        """Was `error` a worker's death? A collective fails when a peer dies, and the monitor thread
        notices the death within milliseconds. A ValueError (a bad setting or checkpoint, which
        every rank finds) and Ctrl-C are rank 0's own."""
        if not isinstance(error, Exception) or isinstance(error, ValueError):
            return False
        deadline = time.monotonic() + 1.0
        while self.failure is None and self.workers and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.failure is not None

    def monitor_workers(self) -> None:
        handles = {w.sentinel: w for w in self.workers}
        dead = handles[wait_for_any(list(handles))[0]]
        with self.lock:
            if self.closed:   # a worker stopped by shutdown()
                return
            reports = []
            while not self.errors.empty():
                reports.append(self.errors.get())
            dead.join(timeout=1)
            self.failure = (f"tensor-parallel worker {dead.name} (pid {dead.pid}) died with exit code "
                            f"{dead.exitcode}" + ("".join(f"\n{r}" for r in reports) or " (its output may say why)"))
            self.stop_workers(graceful=False)
            if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
                distributed.destroy_distributed()   # aborted: what waits on the dead rank returns

    def stop_workers(self, graceful: bool) -> None:
        for w in self.workers:
            w.join(timeout=5 if graceful else 0)
            if w.is_alive():
                w.terminate()
                w.join(timeout=5)
            if w.is_alive():
                w.kill()
                w.join()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers, leave the process groups, remove the shared memory. Idempotent.
        `graceful=False` (after an error in a step: the ranks may be in different places) does not
        wait for the workers to finish. Ctrl-C is held off meanwhile, so nothing is left half-done."""
        main_thread = threading.current_thread() is threading.main_thread()
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            with self.lock:
                if self.closed:
                    return
                self.closed = True
            self.stop(graceful)
        finally:
            if sigint is not None:
                signal.signal(signal.SIGINT, sigint)

    def stop(self, graceful: bool) -> None:
        try:
            graceful = graceful and self.runner is not None and self.failure is None
            if graceful:   # every worker waits for its next message
                deadline = time.monotonic() + 5

                def check():
                    if time.monotonic() > deadline or not all(w.is_alive() for w in self.workers):
                        raise WorkerDiedError("a worker did not take the shutdown message")
                try:
                    self.queue.enqueue(("shutdown", ()), check)
                except WorkerDiedError:
                    graceful = False
            self.stop_workers(graceful)
            if self.runner is not None and self.runner.graph_runner is not None:
                if graceful:
                    torch.cuda.synchronize(self.runner.device)
                self.runner.graph_runner.release()
        finally:
            distributed.destroy_distributed()
            self.queue.close()
            self.errors.close()
            self.errors = self.runner = None   # (the model and KV cache; the queue's named semaphores)


class CheckedOutput:
    """A step's output that is only handed on if no worker died while it ran."""

    def __init__(self, output: AsyncModelRunnerOutput, executor: MultiprocExecutor):
        self.output, self.executor = output, executor

    def get_output(self):
        output = self.output.get_output()
        self.executor.check_health()
        return output


def worker_main(config: Config, rank: int, init_method: str, queue: MessageQueue, errors, started) -> None:
    """A worker's life: join the group, build the model shard, then run calls until "shutdown"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is rank 0's to handle
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    queue.as_reader(rank - 1)
    try:
        if config.device == "cuda":   # a device that fails, fails here, not in the rendezvous
            torch.cuda.set_device(rank % torch.cuda.device_count())
            torch.zeros(1, device="cuda")
        started.release()
        distributed.init_distributed(rank, config.tensor_parallel_size, init_method, backend(config))
        if config.device == "cpu":   # share the cores with the other ranks
            torch.set_num_threads(max(1, os.cpu_count() // config.tensor_parallel_size))
        runner = ModelRunner(config)
        while (call := queue.dequeue(check=lambda: None))[0] != "shutdown":
            method, args = call
            getattr(runner, method)(*args)
        if runner.device.type == "cuda":   # the last step's collectives finish (rank 0 waits on them)
            torch.cuda.synchronize(runner.device)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()[-4000:]}")
        os._exit(1)
    os._exit(0)   # rank 0 removes the shared memory and aborts the groups: nothing to tear down here


def exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)   # rank 0's process is gone: nobody will send another step


def backend(config: Config) -> str:
    return "nccl" if config.device == "cuda" else "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
