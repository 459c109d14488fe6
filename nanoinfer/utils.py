"""Small helpers that several parts of the engine share: numbers, settings, and processes."""
import functools
import math
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
import time
import traceback

import torch


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: the blocks that `a` tokens take at `b` tokens a block."""
    return -(-a // b)


def is_int(value, low: float = -math.inf, high: float = math.inf) -> bool:
    """Is `value` an integer (not a bool) in [low, high]?"""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def require(ok: bool, message: str) -> None:
    """A ValueError saying `message`, unless `ok`."""
    if not ok:
        raise ValueError(message)


def check_int(name: str, value, minimum: int) -> None:
    require(is_int(value, minimum), f"{name} must be an integer >= {minimum}, got {value!r}")


def engine_num_threads(device: str, num_procs: int) -> int:
    """torch's intra-op threads for each of the `num_procs` processes that run the model on this
    host. On the CPU, an equal share of the cores this process may run on less one, at least one:
    vLLM's CPU workers each take the cores they are bound to (a share of the host's, not all of
    them each, which would make the processes' threads wait on each other), less the cores
    reserved for the rest (VLLM_CPU_NUM_OF_RESERVED_CPU). One core is always left to the process
    that drives them (the server's front end, or the engine core of tensor-parallel workers):
    an OpenMP region ends when its slowest thread does, so a thread that waits for a core taken
    by other work holds up the whole step (docs/ARCHITECTURE.md, section 12, has the figures).
    On a GPU, one, as vLLM gives its GPU workers: their host work is launching kernels, and spare
    threads only contend for the cores (docs/BENCHMARKS.md: the eager prefill launched 3x
    slower)."""
    if device != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores - 1) // num_procs)


def core_gpus(data_parallel_size: int, ranks_per_core: int) -> list[str]:
    """Each core's CUDA_VISIBLE_DEVICES: core r takes the r-th `ranks_per_core` visible GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    n = ranks_per_core
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    require(len(gpus) >= data_parallel_size * n, f"data_parallel_size={data_parallel_size} x {n} "
            f"ranks per core needs {data_parallel_size * n} GPUs, {len(gpus)} are visible")
    return [",".join(gpus[r * n:(r + 1) * n]) for r in range(data_parallel_size)]


def stop_processes(procs: list, timeout: float) -> None:
    """Join each process for `timeout` seconds, then kill it (one never started is skipped)."""
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()


def exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)   # the parent is gone: nobody will send another message


def child_process(main):
    """A process the engine starts (an engine core, a worker rank) runs `main` this way: Ctrl-C
    and SIGTERM are its parent's to handle (a service manager sends them to the whole group, and
    the parent stops its children itself), it exits when its parent is gone, and it ends with
    `exit_now` once `main` returns (status 0), or raises (printed, status 1: `main` reports its
    own errors, so that is a bug)."""
    @functools.wraps(main)
    def run(*args) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        parent = multiprocessing.parent_process().pid   # (not getppid: it may have gone already)
        threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()
        try:
            main(*args)
        except BaseException:
            traceback.print_exc()
            exit_now(1)
        exit_now(0)
    return run


def exit_now(status: int = 0, stop_tracker: bool = False) -> None:
    """End this process now, without the interpreter's teardown (a garbage collection over every
    object it made: seconds, on a busy machine); what it printed is flushed first. The process
    that started the others (`stop_tracker`) first stops multiprocessing's resource tracker, so
    that no process of ours outlives its exit status."""
    if stop_tracker:   # (waited for 2 s at most: a process we lost may still hold it open)
        stopping = threading.Thread(target=multiprocessing.resource_tracker._resource_tracker._stop,
                                    daemon=True)
        stopping.start()
        stopping.join(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
