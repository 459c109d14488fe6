"""Small helpers that several parts of the engine share."""
import math
import os


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
