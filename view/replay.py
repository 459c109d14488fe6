"""The replay: the engine's state after any step, rebuilt from its event log alone.

The engine core writes what it does as it does it (nanoinfer/engine/event_log.py; every field in
docs/ARCHITECTURE.md section 15). `Replay.apply` takes the records one by one and keeps:

- each block's holders, the sequences whose block tables hold it (its reference count is their
  number, as `BlockManager.ref_counts` has it), and, for a block nobody holds, whether it keeps
  its hash (cached-free: a later request with that prefix finds it) and whose tokens those were;
- the queues, `waiting` and `running`, in the scheduler's order, and each sequence's progress
  (prompt tokens, tokens computed, tokens generated of max_tokens, times preempted);
- counts since the start: steps, prompt tokens looked up in the prefix cache and found there,
  cached blocks evicted to be reused, preemptions, tokens generated.

A step's record, written once `Scheduler.schedule` has planned it, says whom it preempted and
admitted and how it left the two queues (so that a scheduler of one's own, the course's, is shown
as it is). The block records of that planning follow it, in the order the block manager made each
change; `out` and `finish` records come when the step's tokens come back
(`update_from_output`). "After step N" is the state once everything before step N + 1's record
is applied. A `snapshot` puts a whole state in place: the engine sends one
to a live viewer that joins late, and `snapshot()` writes one for the windows of a long log.

The tests hold this against the engine's own block manager and scheduler after every step.
"""
from dataclasses import dataclass, field

VERSION = 1


class BadLog(ValueError):
    """A log this replay cannot read; the message names the line."""


@dataclass
class Seq:
    request: str
    prompt: int
    max_tokens: int
    computed: int = 0
    generated: int = 0
    table: list[int] = field(default_factory=list)
    preempted: int = 0
    finished: str | None = None   # (the reason)


class Replay:

    def __init__(self):
        self.header: dict | None = None
        self.seqs: dict[int, Seq] = {}
        self.waiting: list[int] = []
        self.running: list[int] = []
        self.holders: dict[int, list[int]] = {}   # block -> the sequences that hold it
        self.cached: dict[int, tuple[int, int]] = {}   # a free block that keeps its hash -> (seq,
        self.step = -1                                  # its block index in that seq's table)
        self.last: dict | None = None   # the last step's record
        self.ended: dict[int, Seq] = {}   # the sequences that ended since the last step
        self.counts = dict.fromkeys(("steps", "queried", "hits", "evictions", "preemptions",
                                     "generated", "prefill", "decode", "drafts"), 0)

    def apply(self, record: dict, line: int = 0) -> None:
        """One record (`line`: where it came from, for the error)."""
        kind = record.get("t") if isinstance(record, dict) else None
        if self.header is None and kind not in ("header", "snapshot"):
            raise BadLog(f"line {line}: not an event log of nanoinfer's (it begins with {kind!r},"
                         " not a header)")
        handler = getattr(self, f"on_{kind}", None)
        if handler is None:
            raise BadLog(f"line {line}: a record of unknown kind {kind!r}")
        try:
            handler(record)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise BadLog(f"line {line}: a {kind} record that does not fit the log before it "
                         f"({type(e).__name__}: {e})") from None

    def on_header(self, r: dict) -> None:
        if r["v"] > VERSION:
            raise BadLog(f"the log is of format {r['v']}, newer than this replay's {VERSION}: "
                         "use the nanoinfer that wrote it")
        self.__init__()
        self.header = r

    def on_add(self, r: dict) -> None:
        for seq_id in r["seqs"]:
            self.seqs[seq_id] = Seq(r["request"], r["prompt"], r["max_tokens"])
            self.waiting.append(seq_id)

    def on_alloc(self, r: dict) -> None:
        seq = self.seqs[r["seq"]]
        if not seq.table:   # (first blocks: its tokens were looked up in the prefix cache)
            self.counts["queried"] += seq.prompt + seq.generated
            self.counts["hits"] += r["hits"] * self.header["block_size"]
        for i, block in enumerate(r["blocks"]):
            if block in self.cached and i >= r["hits"]:
                self.counts["evictions"] += 1   # (reused for other tokens: its hash is gone)
            self.cached.pop(block, None)
            self.holders.setdefault(block, []).append(r["seq"])
        seq.table += r["blocks"]

    def on_free(self, r: dict) -> None:
        seq = self.seqs[r["seq"]]
        kept = set(r["kept"])
        for i, block in enumerate(seq.table):
            self.holders[block].remove(r["seq"])
            if not self.holders[block]:
                del self.holders[block]
                if block in kept:
                    self.cached[block] = (r["seq"], i)
        seq.table = []

    def on_reset(self, r: dict) -> None:
        self.cached.clear()

    def on_finish(self, r: dict) -> None:
        seq = self.ended[r["seq"]] = self.seqs.pop(r["seq"])
        seq.finished = r["reason"]
        for queue in (self.waiting, self.running):
            if r["seq"] in queue:
                queue.remove(r["seq"])

    def on_out(self, r: dict) -> None:
        for seq_id, n in r["out"]:   # (a sequence that ended with these tokens got them too)
            seq = self.seqs.get(seq_id) or self.ended[seq_id]
            seq.generated += n
            self.counts["generated"] += n

    def on_step(self, r: dict) -> None:
        for seq_id in r["preempted"]:
            self.seqs[seq_id].computed = 0
            self.seqs[seq_id].preempted += 1
        self.counts["preemptions"] += len(r["preempted"])
        self.waiting = list(r["waiting"])   # (as the scheduler left them: yours, in the course)
        self.running = list(r["running"])
        for seq_id, n, start, drafts in r["sched"]:
            seq = self.seqs[seq_id]
            seq.computed = start + n
            kind = "prefill" if n - drafts > 1 or start < seq.prompt else "decode"
            self.counts[kind] += n - drafts
            self.counts["drafts"] += drafts
        self.counts["steps"] += 1
        self.step += 1
        self.last = r
        self.ended = {}

    def on_snapshot(self, r: dict) -> None:
        header = self.header or r.get("header")
        self.__init__()
        self.header = header
        self.step = r.get("step", 0) - 1
        self.counts.update(r.get("counts", {}))
        for seq_id, (prompt, max_tokens, computed, generated, table, *rest) in r["seqs"].items():
            request, preempted = rest or (str(seq_id), 0)   # (the engine's: without these)
            self.seqs[int(seq_id)] = Seq(request, prompt, max_tokens, computed, generated,
                                         list(table), preempted)
            for block in table:
                self.holders.setdefault(block, []).append(int(seq_id))
        self.waiting = list(r["waiting"])
        self.running = list(r["running"])
        hashed = r["hashed"]
        owners = hashed if isinstance(hashed, dict) else dict.fromkeys(hashed)
        self.cached = {int(b): o and tuple(o) for b, o in owners.items()
                       if int(b) not in self.holders}

    def on_end(self, r: dict) -> None:
        """The engine stopped writing here (its size limit): nothing more to apply."""

    def snapshot(self) -> dict:
        """This state as a snapshot record (with what only the replay knows: the counts, each
        sequence's request, whose tokens a cached block keeps)."""
        return {"t": "snapshot", "step": self.step + 1, "header": self.header,
                "counts": dict(self.counts),
                "seqs": {s: [q.prompt, q.max_tokens, q.computed, q.generated, list(q.table),
                             q.request, q.preempted] for s, q in self.seqs.items()},
                "waiting": list(self.waiting), "running": list(self.running),
                "hashed": {b: list(o) if o else None for b, o in self.cached.items()}}

    def ref_counts(self) -> dict[int, int]:
        return {block: len(holders) for block, holders in self.holders.items()}
