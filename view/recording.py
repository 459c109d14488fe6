"""A recording: an event log cut into windows of steps, each opening with a snapshot, so that the
state after any step is a short replay away and a log of millions of steps never has to be held
whole.

From a file (`Recording.read`), one pass makes the windows: every `WINDOW` steps the replay's
state is kept as a snapshot with the file offset where the window's records begin; a step's
state is then that snapshot and at most `WINDOW` steps of records, read again from the file.
Live (`append`), the records are kept in memory, the oldest windows dropped past `MAX_WINDOWS`.
A log that is cut short, or bad at some line, is read up to there: `error` names the line.

What the page asks for (server.py): `info()`, `state(step)` and `timeline(window)`.
"""
import json
import threading

from view.replay import BadLog, Replay

WINDOW = 500
MAX_WINDOWS = 40


class Window:
    def __init__(self, first: int, snapshot: dict, offset: int | None = None):
        self.first = first   # its first step
        self.snapshot = snapshot
        self.offset = offset   # where its records start in the file (live: None, `records`)
        self.records: list[dict] = []
        self.num_steps = 0


class Recording:

    def __init__(self, path: str | None = None):
        self.path = path
        self.replay = Replay()
        self.windows: list[Window] = []
        self.error: str | None = None
        self.end: int | None = None   # (from a file: where its bad line begins)
        self.lock = threading.Lock()   # (live: appended by one thread, read by the server's)

    @classmethod
    def read(cls, path: str) -> "Recording":
        recording = cls(path)
        with open(path, "rb") as f:
            for number, line in enumerate(iter(f.readline, b""), start=1):
                try:
                    recording.add(parse(line, number), number, f.tell() - len(line))
                except BadLog as e:
                    recording.error = str(e)
                    recording.end = f.tell() - len(line)
                    break
        if not recording.windows and recording.error is None:
            recording.error = "the log holds no step" if recording.replay.header else \
                "the log is empty"
        return recording

    def add(self, record: dict, line: int = 0, offset: int | None = None) -> None:
        """One record (from the file: `offset`, where its line starts). A step that begins a
        window first keeps the state before it, as the window's snapshot; a window's records are
        its steps' and what follows each (live: in memory; from a file: where they start)."""
        if record.get("t") in ("header", "snapshot"):   # (a fresh start: live, the engine's)
            self.windows = []
        new = record.get("t") == "step" and (not self.windows
                                             or self.windows[-1].num_steps == WINDOW)
        before = self.replay.snapshot() if new else None
        self.replay.apply(record, line)
        if new:
            self.windows.append(Window(self.replay.step, before, offset))
            if offset is None and len(self.windows) > MAX_WINDOWS:
                del self.windows[0]
        if self.windows and offset is None:
            self.windows[-1].records.append(record)
        if record["t"] == "step":
            self.windows[-1].num_steps += 1

    def append(self, record: dict) -> None:
        with self.lock:
            if record.get("t") in ("header", "snapshot") or self.replay.header is not None:
                self.add(record)

    def info(self) -> dict:
        with self.lock:
            first = self.windows[0].first if self.windows else 0
            last = self.windows[-1].first + self.windows[-1].num_steps - 1 if self.windows else -1
            return {"first": first, "last": last, "window": WINDOW, "error": self.error,
                    "header": self.replay.header, "live": self.path is None}

    def window_of(self, step: int) -> Window:
        for window in self.windows:
            if window.first <= step < window.first + window.num_steps:
                return window
        raise KeyError(f"step {step} is not in the recording")

    def records(self, window: Window):
        """A window's records: its steps' and what follows each, up to the next window's first
        step (or, read again from the file, up to the line that was bad)."""
        if window.offset is None:
            with self.lock:
                yield from list(window.records)
            return
        steps = 0
        with open(self.path, "rb") as f:
            f.seek(window.offset)
            for line in iter(f.readline, b""):
                if self.end is not None and f.tell() > self.end:
                    return
                record = parse(line, 0)
                steps += record.get("t") == "step"
                if steps > window.num_steps:
                    return
                yield record

    def replay_to(self, step: int) -> Replay:
        """The state after `step`: its window's snapshot, then the records up to the next step."""
        with self.lock:
            window = self.window_of(step)
        replay = Replay()
        replay.apply(window.snapshot)
        for record in self.records(window):
            if record["t"] == "step" and replay.step == step:
                break
            replay.apply(record)
        return replay

    def state(self, step: int) -> dict:
        """What the page draws after `step`."""
        r = self.replay_to(step)
        return {"step": step, "record": r.last, "counts": r.counts, "header": r.header,
                "waiting": r.waiting, "running": r.running, "holders": r.holders,
                "cached": r.cached, "seqs": {s: vars(q) for s, q in r.seqs.items()},
                "ended": {s: q.finished for s, q in r.ended.items()}}

    def timeline(self, index: int) -> list[list]:
        """A window's steps, one row each: [step, prefill, decode, drafts, sequences, ms (to the
        next step, or the last record), preempted, prompt tokens found in the prefix cache]: what
        its record and the records after it, up to the next step's, counted."""
        with self.lock:
            window = self.windows[index]
        replay = Replay()
        replay.apply(window.snapshot)
        rows = []
        now = 0.0
        for record in self.records(window):
            if record["t"] == "step":
                self.close_row(rows, replay, record["time"])
                rows.append([replay.step + 1, dict(replay.counts), len(record["sched"]),
                             record["time"], len(record["preempted"])])
            replay.apply(record)
            now = record.get("time", now)
        self.close_row(rows, replay, now)
        return rows

    @staticmethod
    def close_row(rows: list, replay: Replay, now: float) -> None:
        if not rows or not isinstance(rows[-1][1], dict):
            return
        step, before, seqs, start, preempted = rows[-1]
        c = replay.counts
        rows[-1] = [step, *(c[k] - before[k] for k in ("prefill", "decode", "drafts")), seqs,
                    round(max(now - start, 0) * 1e3, 3), preempted, c["hits"] - before["hits"]]


def parse(line: bytes, number: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError as e:
        cut = "" if line.endswith(b"\n") else " (the log is cut short here)"
        raise BadLog(f"line {number}: not JSON{cut}: {e}") from None
    if not isinstance(record, dict):
        raise BadLog(f"line {number}: not a record (a JSON object)")
    return record
