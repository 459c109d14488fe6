"""The view beside the engine (view/): a recording's windows give the state the whole replay
gives; bad logs get a message naming the line, never a traceback; the Perfetto export is Chrome's
trace-event format; a server's live stream is behind its API key, starts from a snapshot, has no
gap, and a viewer that stops reading is let go while 64 streams finish (the step loop never waits
on it); a viewer that leaves turns the core's recording off."""
import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from conftest import random_prompts
from nanoinfer import LLM, RequestOutputKind, SamplingParams
from nanoinfer.engine import async_llm
from nanoinfer.engine.async_llm import AsyncLLM
from test_server import start_server, stop_server
from view import recording as recording_module

from view.recording import Recording
from view.replay import Replay

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def log(llama_dir, tmp_path_factory) -> str:
    """A run with preemption, chunks and prefix hits, recorded."""
    path = str(tmp_path_factory.mktemp("log") / "run.jsonl")
    llm = LLM(llama_dir, event_log=path, num_kvcache_blocks=12, max_num_batched_tokens=40,
              max_num_seqs=5, max_model_len=192)
    shared = random_prompts([33], seed=1)[0]
    llm.generate(random_prompts([10, 50, 20, 5, 30, 12], seed=2, prefix=shared), GREEDY,
                 use_tqdm=False)
    llm.shutdown()
    return path


def records_of(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def after(records: list, step: int) -> Replay:
    replay = Replay()
    for record in records:
        if record["t"] == "step" and replay.step == step:
            break
        replay.apply(record)
    return replay


def drawn(state: dict) -> dict:
    """What a page draws of a state, in JSON's form (as the server sends it)."""
    keep = ("waiting", "running", "holders", "cached", "counts")
    return json.loads(json.dumps({k: state[k] for k in keep} | {"seqs": state["seqs"]}))


@pytest.mark.parametrize("live", [False, True])
def test_windows_give_the_whole_replays_state(log, monkeypatch, live):
    monkeypatch.setattr(recording_module, "WINDOW", 7)
    records = records_of(log)
    if live:   # (fed record by record, as from a server's stream)
        recording = Recording()
        for record in records:
            recording.append(record)
    else:
        recording = Recording.read(log)
    info = recording.info()
    assert info["first"] == 0 and info["last"] == after(records, 10**9).step > 20
    assert len(recording.windows) == info["last"] // 7 + 1
    for step in range(info["last"] + 1):
        whole = after(records, step)
        want = {"waiting": whole.waiting, "running": whole.running, "holders": whole.holders,
                "cached": whole.cached, "counts": whole.counts,
                "seqs": {s: vars(q) for s, q in whole.seqs.items()}}
        assert drawn(recording.state(step)) == drawn(want), step
    rows = [row for w in range(len(recording.windows)) for row in recording.timeline(w)]
    assert [row[0] for row in rows] == list(range(info["last"] + 1))
    assert sum(row[1] + row[2] for row in rows) == after(records, 10**9).counts["prefill"] + \
        after(records, 10**9).counts["decode"]
    assert any(row[6] for row in rows) and any(row[7] for row in rows)   # (preempted, hits)


@pytest.mark.parametrize("content, message", [
    (b"", "the log is empty"),
    (b'{"t": "header", "v": 1, "num_blocks": 4, "block_size": 16, "max_num_batched_tokens": 8}\n',
     "the log holds no step"),
    (b'{"t": "header", "v": 2, "num_blocks": 4}\n', "newer than this replay's 1"),
    (b'{"hello": "world"}\n', "line 1: not an event log of nanoinfer's"),
    (b"\x89PNG\r\n\x1a\n", "line 1: not JSON"),
    (b'[1, 2]\n', "line 1: not a record"),
])
def test_bad_logs_are_named_by_their_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    assert message in Recording.read(str(path)).error
    run = subprocess.run([sys.executable, "-m", "view", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 1 and message in run.stderr and "Traceback" not in run.stderr


def test_a_log_cut_short_or_bad_in_the_middle_is_shown_up_to_there(log, tmp_path):
    data = open(log, "rb").read()
    lines = data.splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[:len(lines) // 2]) + lines[len(lines) // 2][:9])
    recording = Recording.read(str(cut))
    assert f"line {len(lines) // 2 + 1}: not JSON (the log is cut short here)" in recording.error
    assert recording.info()["last"] > 0
    recording.state(recording.info()["last"])   # (the last whole step is there)
    odd = tmp_path / "odd.jsonl"
    step = next(i for i, line in enumerate(lines) if b'"step"' in line and i > 10)
    odd.write_bytes(b"".join(lines[:step]) + b'{"t": "free", "seq": 999, "kept": []}\n' +
                    b"".join(lines[step:]))
    error = Recording.read(str(odd)).error
    assert f"line {step + 1}: a free record that does not fit the log before it" in error


def test_the_perfetto_export_is_chromes_trace_format(log, tmp_path):
    out = tmp_path / "trace.json"
    run = subprocess.run([sys.executable, "-m", "view", log, "--perfetto", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    events = json.loads(out.read_text())["traceEvents"]
    steps = [e for e in events if e["ph"] == "X" and e["pid"] == 1]
    assert len(steps) == after(records_of(log), 10**9).step + 1
    assert all({"ph", "pid", "name"} <= e.keys() for e in events)
    assert all(e["dur"] >= 1 and e["ts"] > 0 for e in events if e["ph"] == "X")
    assert {e["name"] for e in events if e["ph"] == "C"} == {"queues", "KV blocks"}
    sequences = [e for e in events if e["ph"] == "X" and e["pid"] == 2]
    assert len(sequences) == 6 and any(e["ph"] == "i" for e in events)   # (a preemption)
    names = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert len(names) == 6
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    run = subprocess.run([sys.executable, "-m", "view", str(empty), "--perfetto", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "the log is empty" in run.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe not a log")
    run = subprocess.run([sys.executable, "-m", "view", str(bad), "--perfetto", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "line 1: not JSON" in run.stderr


def test_the_live_stream_is_behind_the_api_key_and_starts_from_a_snapshot(llama_dir):
    proc, url = start_server(llama_dir, "--api-key", "k", "--max-num-batched-tokens", "64")
    try:
        assert httpx.get(url + "/engine/events").status_code == 401
        headers = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/engine/events?core=3", headers=headers).status_code == 404
        recording = Recording()
        with httpx.stream("GET", url + "/engine/events", headers=headers, timeout=60) as events:
            lines = events.iter_lines()
            for _ in range(2):   # a header, then the core's state
                recording.append(json.loads(next(line for line in lines if line)[6:]))
            body = {"prompt": [5, 6, 7] * 30, "max_tokens": 12, "n": 2, "ignore_eos": True}
            answer = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
            assert answer.status_code == 200
            record = {}
            while record.get("t") != "out" or recording.replay.seqs:   # (to the last tokens)
                record = json.loads(next(line for line in lines if line)[6:])
                recording.append(record)
        info = recording.info()
        assert info["last"] >= 12 and recording.replay.counts["generated"] == 24
        assert recording.replay.counts["hits"] > 0   # (the second sample found the first's)
    finally:
        stop_server(proc)


def test_a_viewer_that_stops_reading_is_let_go_and_one_that_leaves_stops_the_recording(
        llama_dir, monkeypatch):
    monkeypatch.setattr(async_llm, "VIEWER_BACKLOG", 200)
    engine = AsyncLLM(llama_dir, max_model_len=256)
    sent = []
    send = engine.client.send
    engine.client.send = lambda rank, message: (sent.append(message), send(rank, message))[1]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def one(i: int) -> int:
        n = 0
        async for out in engine.generate(random_prompts([8], seed=i)[0], params, f"r{i}"):
            n += len(out.outputs[0].token_ids)
        return n

    async def run():
        stalled = engine.watch(0)
        first = await stalled.__anext__()   # (then it reads no more)
        counts = await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(64)]), 300)
        assert 0 not in engine.viewers   # let go: it fell VIEWER_BACKLOG records behind
        queued = engine.viewers.get(0)
        assert queued is None and ("view", False) in sent
        await stalled.aclose()
        reading = engine.watch(0)
        lines = [await reading.__anext__() for _ in range(2)]   # header and snapshot
        await one(99)
        await reading.aclose()
        return first, counts, lines
    try:
        first, counts, lines = asyncio.run(run())
        assert json.loads(first[6:])["t"] == "header"
        assert counts == [40] * 64
        assert [json.loads(line[6:])["t"] for line in lines] == ["header", "snapshot"]
        assert sent[-1] == ("view", False) and not engine.viewers
    finally:
        engine.shutdown()
