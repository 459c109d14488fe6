"""How a step reaches the worker processes: a ring of slots in shared memory, one writer, N readers.

The engine pickles each call (a method name and its arguments, e.g. the step's `SchedulerOutput`,
a few KB) into the next slot of a `multiprocessing.shared_memory` buffer and signals every reader;
each worker copies it out, marks the slot read, and unpickles it. Nothing goes through a pipe or
a socket, and the writer only waits when it is a whole ring ahead of the slowest reader. A second
ring carries rank 0's sampled tokens back, with rank 0 as its writer and the engine its reader.

    slot i % num_slots:  [ length: u32 | last: u32 | payload ... ]

A message longer than a slot (a step that admits many long prompts) is cut into chunks that follow
each other through the ring. The signals are semaphores, two per reader: `written` counts the
slots it may read, `free` the slots it has finished with (the writer takes one from every reader
before it overwrites a slot). Every wait has a timeout, after which `check()` runs (the engine
checks that its workers are alive), so that it never waits forever on a process that has died;
a worker exits by itself when the engine's process is gone.
"""
import contextlib
import multiprocessing as mp
import pickle
import struct
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory

HEADER = struct.Struct("<II")


class MessageQueue:

    def __init__(self, num_readers: int, slot_bytes: int = 1 << 20, num_slots: int = 8):
        ctx = mp.get_context("spawn")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.shm = SharedMemory(create=True, size=slot_bytes * num_slots)
        self.written = [ctx.Semaphore(0) for _ in range(num_readers)]
        self.free = [ctx.Semaphore(num_slots) for _ in range(num_readers)]
        self.reader: int | None = None   # which reader this process is (None: the writer)
        self.index = 0                   # the next slot to write or read, counting from 0
        self.owner = True                # this process made the segment and removes it

    def __getstate__(self):   # what a worker process receives: the segment's name, not its memory
        return {**self.__dict__, "shm": self.shm.name, "reader": None, "owner": False}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.shm = SharedMemory(name=state["shm"])

    def as_reader(self, reader: int) -> None:
        self.reader = reader

    def enqueue(self, obj, check: Callable[[], None]) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        chunk = self.slot_bytes - HEADER.size
        for start in range(0, max(len(data), 1), chunk):
            part = data[start:start + chunk]
            for reader in range(len(self.free)):   # every reader has read what this slot held
                wait(self.free, reader, check)
            offset = (self.index % self.num_slots) * self.slot_bytes
            HEADER.pack_into(self.shm.buf, offset, len(part), start + chunk >= len(data))
            self.shm.buf[offset + HEADER.size:offset + HEADER.size + len(part)] = part
            self.index += 1
            for reader in range(len(self.written)):
                self.written[reader].release()

    def dequeue(self, check: Callable[[], None]):
        parts = []
        while True:
            wait(self.written, self.reader, check)
            offset = (self.index % self.num_slots) * self.slot_bytes
            length, last = HEADER.unpack_from(self.shm.buf, offset)
            parts.append(bytes(self.shm.buf[offset + HEADER.size:offset + HEADER.size + length]))
            self.index += 1
            self.free[self.reader].release()
            if last:
                return pickle.loads(b"".join(parts))

    def close(self) -> None:
        """Detach; the owner also removes the segment (the others must have detached or died)."""
        try:
            if self.owner:
                self.shm.unlink()   # the name goes now, the memory once every process has detached
        finally:
            self.written.clear()   # the last references: the named semaphores are removed (the
            # lists, not the semaphores, are what a failed wait's traceback holds)
            self.free.clear()
            with contextlib.suppress(BufferError):   # a thread being stopped still reads a slot
                self.shm.close()


def wait(sems: list, i: int, check: Callable[[], None], timeout: float = 0.5) -> None:
    """Take semaphore `sems[i]`, running `check()` every `timeout` seconds meanwhile."""
    while not sems[i].acquire(timeout=timeout):
        check()
