"""The event log: what the engine core did, step by step, written down so that it can be watched.

Off by default. On (`LLM(model, event_log=PATH)`, `serve --event-log PATH`, or a viewer of a
server's live stream), the core records one JSON object per event, in the order they happen:

- `header` (first): the format's version `v`, the number of blocks and their size, the budget;
- `add`: a request, once: its sequences, prompt length, max_tokens, arrival time, a grammar;
- `step`: what a step scheduled (per sequence its tokens, where they start, its drafts), whom
  it admitted and preempted, the queues it left, its start time, the blocks a KV connector saves;
- `alloc`, `free`, `reset`: the block manager's changes, in the order it makes them (those made
  while a step is planned come right after its `step` record): blocks appended to a sequence's
  table (the first `hits` of them found in the prefix cache), a sequence's blocks let go (those
  that keep their hash: `kept`), the prefix cache emptied;
- `out`: the tokens the sequences got when a step's output came back;
- `finish`: a sequence ended, and why (a stop, its length, an abort, a stop string);
- `snapshot`: the whole state at a moment (a live viewer that joins late starts from one).

From these alone the state after any step can be rebuilt: who holds which block, each block's
reference count and whether it keeps a hash, the queues, each sequence's progress (view/replay.py
does it, and the tests hold it against the engine's own). docs/ARCHITECTURE.md section 15 gives
every field. The scheduler and the block manager record what they do themselves: while a core
records, its own objects become the recording kinds below (their class is set; their state is
untouched), so that a core that records nothing runs exactly the plain code. A file's records are
encoded and written by a thread of their own, and stop at NANOINFER_EVENT_LOG_MAX_MB (2048) with
an `end` record and a warning; a live viewer's go out with the core's outputs (`take`).
"""
import json
import logging
import os
import queue
import threading
import time

from nanoinfer.core.block_manager import BlockManager
from nanoinfer.core.messages import EngineCoreRequest, SchedulerOutput
from nanoinfer.core.scheduler import Scheduler

logger = logging.getLogger("nanoinfer")
VERSION = 1


class RecordingScheduler(Scheduler):
    """The scheduler, telling the event log what each step schedules, what its outputs bring and
    how each sequence ends."""

    def schedule(self) -> SchedulerOutput:
        """The step's record first, then what the block manager did while it was planned."""
        start = time.time()
        self.log.planning = []
        out = super().schedule()
        planned, self.log.planning = self.log.planning, None
        if out.num_scheduled_tokens or out.preempted_seq_ids or out.kv_loads:
            self.log.step(out, start)
        for record in planned:
            self.log.put(record)
        return out

    def update_from_output(self, runner_output):
        outputs = super().update_from_output(runner_output)
        self.log.put({"t": "out", "time": time.time(),
                      "out": [[o.seq_id, len(o.new_token_ids)] for o in outputs]})
        return outputs

    def finish(self, seq, reason: str, stop_reason=None) -> None:
        super().finish(seq, reason, stop_reason)
        self.log.put({"t": "finish", "seq": seq.seq_id, "reason": reason})


class RecordingBlockManager(BlockManager):
    """The block manager, telling the event log of each change as it makes it."""

    def allocate_slots(self, seq, num_new_tokens, *, computed_blocks=(), num_lookahead_tokens=0):
        new_blocks = super().allocate_slots(seq, num_new_tokens, computed_blocks=computed_blocks,
                                            num_lookahead_tokens=num_lookahead_tokens)
        if new_blocks:
            self.log.put({"t": "alloc", "seq": seq.seq_id, "blocks": new_blocks,
                          "hits": len(computed_blocks)})
        return new_blocks

    def free(self, seq) -> None:
        kept = [b for b in seq.block_table if b in self.block_hash]
        super().free(seq)
        self.log.put({"t": "free", "seq": seq.seq_id, "kept": kept})

    def reset_prefix_cache(self) -> bool:
        if done := super().reset_prefix_cache():
            self.log.put({"t": "reset"})
        return done


class EventLog:
    """A core's recorder: to a file (`path`), to a live viewer (`live`, the records the core
    takes after each step), or both."""

    def __init__(self, scheduler: Scheduler, path: str | None = None):
        self.scheduler = scheduler
        self.live: list | None = None
        self.planning: list | None = None   # (a step's records while it is planned)
        self.queue: queue.Queue | None = None
        if path is not None:
            try:
                file = open(path, "w", encoding="utf-8")
            except OSError as e:
                raise ValueError(f"event_log: cannot write {path!r} ({e.strerror})") from None
            limit = float(os.environ.get("NANOINFER_EVENT_LOG_MAX_MB", "2048")) * 2**20
            self.queue = queue.SimpleQueue()   # (never full: the step loop never waits on it)
            self.writer = threading.Thread(target=self.write, args=(file, limit), daemon=True,
                                           name="nanoinfer-event-log")
            self.writer.start()
        bm = scheduler.block_manager
        self.header = {"t": "header", "v": VERSION, "num_blocks": bm.num_blocks,
                       "block_size": bm.block_size,
                       "max_num_batched_tokens": scheduler.max_num_batched_tokens}
        self.put(self.header)
        self.plain = type(scheduler), type(bm)   # (what they go back to)
        scheduler.__class__, bm.__class__ = RecordingScheduler, RecordingBlockManager
        scheduler.log = bm.log = self

    def put(self, record: dict) -> None:
        if self.planning is not None:   # (to be put after the step's own record)
            self.planning.append(record)
            return
        if (file_queue := self.queue) is not None:   # (read once: a stopping writer clears it)
            file_queue.put(record)
        if self.live is not None:
            self.live.append(record)

    def add(self, request: EngineCoreRequest) -> None:
        self.put({"t": "add", "time": time.time(), "request": request.request_id,
                  "seqs": request.seq_ids, "prompt": len(request.prompt_token_ids),
                  "max_tokens": request.max_tokens, "guided": request.grammar is not None})

    def step(self, sched: SchedulerOutput, start: float) -> None:
        cached = sched.scheduled_cached_reqs
        starts = dict(zip(cached.seq_ids, cached.num_computed_tokens))
        starts |= {r.seq_id: r.num_computed_tokens for r in sched.scheduled_new_reqs}
        drafts = sched.scheduled_spec_decode_tokens
        scheduled = [[s, n, starts[s], len(drafts.get(s, ()))]
                     for s, n in sched.num_scheduled_tokens.items()]
        s = self.scheduler   # (the queues as they are, whatever the scheduler's own policy)
        self.put({"t": "step", "time": start, "sched": scheduled,
                  "admitted": [r.seq_id for r in sched.scheduled_new_reqs],
                  "preempted": sorted(sched.preempted_seq_ids), "kv_saved": len(sched.kv_saves),
                  "waiting": [q.seq_id for q in s.waiting],
                  "running": [q.seq_id for q in s.running]})

    def snapshot(self) -> dict:
        """The state now: each live sequence (prompt, max_tokens, computed, generated, blocks),
        the queues, the blocks that keep a hash."""
        s = self.scheduler
        return {"t": "snapshot", "time": time.time(),
                "seqs": {q.seq_id: [q.num_prompt_tokens, q.max_tokens, q.num_computed_tokens,
                                    q.num_output_tokens, list(q.block_table)]
                         for q in s.requests.values()},
                "waiting": [q.seq_id for q in s.waiting], "running": [q.seq_id for q in s.running],
                "hashed": list(s.block_manager.block_hash)}

    def watch(self, on: bool) -> "EventLog | None":
        """A live viewer came (its records start from a header and a snapshot), or left; the
        log that goes on recording (None: none, when there is no file either)."""
        self.live = (self.live or []) + [self.header, self.snapshot()] if on else None
        if not on and self.queue is None:
            self.close()
            return None
        return self

    def take(self) -> list:
        """The live records since the last take."""
        records = self.live or []
        if self.live:
            self.live = []
        return records

    def write(self, file, limit: float) -> None:
        """The writer thread: each record a line, until the size limit or an error; then it says
        why, once, and the recording to the file stops (the step loop never waits on a disk)."""
        size = 0
        try:
            with file:
                for record in iter(self.queue.get, None):
                    line = json.dumps(record, separators=(",", ":")) + "\n"
                    size += len(line)
                    if size > limit:
                        file.write(json.dumps({"t": "end", "why": "the size limit"}) + "\n")
                        raise OSError(f"NANOINFER_EVENT_LOG_MAX_MB={limit / 2**20:g} reached")
                    file.write(line)
        except Exception as e:   # (a full disk, the limit)
            self.queue = None
            logger.warning("event log %s stops here: %s", file.name, e)

    def close(self) -> None:
        """Stop recording: the core's scheduler and block manager are the plain ones again, and
        a file is written to its end."""
        self.scheduler.__class__, self.scheduler.block_manager.__class__ = self.plain
        if (file_queue := self.queue) is not None:
            file_queue.put(None)
            self.writer.join()
        self.queue = None
