"""An event log as Chrome's trace-event JSON, which Perfetto (ui.perfetto.dev) and
chrome://tracing open: `python -m view RUN.jsonl --perfetto OUT.json`.

    process "engine core"   a slice per step on the track "steps", from its planning to the next
                            step's (its tokens, sequences, who it admitted and preempted in its
                            args); counters "queues" (waiting, running) and "KV blocks" (in use,
                            cached-free) after each step is planned
    process "requests"      a track per sequence, named by its request and sample: a slice from
                            its arrival to its end, an instant where it was preempted

Times are the engine's host clock, in microseconds (the format's unit). A sequence's end is the
time of the last record with a time before it; one that has not ended when the log does (cut
short, or bad at some line: then the trace stops there, and `export` says why) ends there.
"""
import json

from view.recording import parse
from view.replay import BadLog, Replay


def export(log: str, out: str) -> tuple[int, str | None]:
    """Write `log`'s trace to `out`; the number of steps, and why it stopped early (or None)."""
    replay = Replay()
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
              for pid, name in ((1, "engine core"), (2, "requests"))]
    arrived: dict[int, float] = {}
    step = None   # the step whose slice is still open (it ends where the next begins)
    now = 0.0
    error = None
    with open(log, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                record = parse(line, number)
                replay.apply(record, number)
            except BadLog as e:
                if replay.header is None:
                    raise
                error = str(e)
                break
            now = record.get("time", now)
            if record["t"] == "snapshot":
                arrived |= dict.fromkeys(replay.seqs, now)
            if record["t"] == "add":
                arrived |= dict.fromkeys(record["seqs"], now)
                events += [{"ph": "M", "name": "thread_name", "pid": 2, "tid": s,
                            "args": {"name": f"{record['request']} [{j}]"}}
                           for j, s in enumerate(record["seqs"])]
            elif record["t"] == "step":
                events += step_events(step, now) + counters(record, replay, now)
                step = record
            elif record["t"] == "finish":
                events.append(sequence(record["seq"], arrived.pop(record["seq"], now), now,
                                       record["reason"]))
    if replay.header is None:
        raise BadLog("the log is empty")
    events += step_events(step, now)
    events += [sequence(s, start, now, "not ended in the log") for s, start in arrived.items()]
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return replay.counts["steps"], error


def sequence(seq_id: int, start: float, end: float, why: str) -> dict:
    return {"ph": "X", "name": f"sequence {seq_id}", "pid": 2, "tid": seq_id, "ts": us(start),
            "dur": max(us(end) - us(start), 1), "args": {"end": why}}


def us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


def step_events(r: dict | None, end: float) -> list[dict]:
    """The slice of step `r`, which ends at `end`."""
    if r is None:
        return []
    return [{"ph": "X", "name": "step", "pid": 1, "tid": 1, "ts": us(r["time"]),
             "dur": max(us(end) - us(r["time"]), 1),
             "args": {"tokens": sum(n for _, n, _, _ in r["sched"]), "sequences": len(r["sched"]),
                      "preempted": r["preempted"], "admitted": r["admitted"]}}]


def counters(r: dict, replay: Replay, now: float) -> list[dict]:
    ts = us(now)
    return [{"ph": "C", "name": "queues", "pid": 1, "ts": ts,
             "args": {"waiting": len(replay.waiting), "running": len(replay.running)}},
            {"ph": "C", "name": "KV blocks", "pid": 1, "ts": ts,
             "args": {"in use": len(replay.holders), "cached-free": len(replay.cached)}}] + [
        {"ph": "i", "s": "t", "name": "preempted", "pid": 2, "tid": s, "ts": ts}
        for s in r["preempted"]]
