"""The event log (nanoinfer/engine/event_log.py) and its replay (view/replay.py): from the log
alone, the state after every step equals the engine's own: every block's reference count, each
live sequence's block table, the blocks that are free but keep their hash, and the two queues in
order. Checked on runs with preemption, chunked prefill, prefix hits, aborts, stop strings and
n > 1; with n-gram speculation; with a KV connector; and on random workloads. Recording changes
no token, and a core that records nothing runs the plain scheduler and block manager."""
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.core.block_manager import BlockManager
from nanoinfer.core.scheduler import Scheduler
from nanoinfer.engine import event_log
from view.recording import Recording
from view.replay import Replay


def engine_state(scheduler) -> dict:
    bm = scheduler.block_manager
    refs = {b: int(n) for b, n in enumerate(bm.ref_counts) if n}
    return {"refs": refs, "tables": {s: list(q.block_table) for s, q in scheduler.requests.items()},
            "cached": {b for b in bm.block_hash if not bm.ref_counts[b]},
            "waiting": [q.seq_id for q in scheduler.waiting],
            "running": [q.seq_id for q in scheduler.running],
            "counts": (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens,
                       scheduler.num_preemptions)}


def replay_state(replay: Replay) -> dict:
    return {"refs": replay.ref_counts(), "tables": {s: q.table for s, q in replay.seqs.items()},
            "cached": set(replay.cached), "waiting": replay.waiting, "running": replay.running,
            "counts": tuple(replay.counts[k] for k in ("queried", "hits", "preemptions"))}


@pytest.fixture
def watched(monkeypatch):
    """Every record as it is put, and at the start of each step's planning the engine's own
    state with the number of records put before it."""
    records, moments = [], []
    init, schedule = event_log.EventLog.__init__, event_log.RecordingScheduler.schedule

    def init_and_keep(self, *args):   # (the records, in the order the file gets them)
        init(self, *args)
        self.live = records
        records.append(self.header)

    def schedule_and_look(self):
        moments.append((len(records), engine_state(self)))
        return schedule(self)
    monkeypatch.setattr(event_log.EventLog, "__init__", init_and_keep)
    monkeypatch.setattr(event_log.RecordingScheduler, "schedule", schedule_and_look)
    return records, moments


def check_replay(records: list, moments: list) -> Replay:
    """The replay of the records up to each moment equals the engine's state then."""
    records[:] = json.loads(json.dumps(records))   # (as a file holds them)
    replay, applied = Replay(), 0
    assert len(moments) > 3
    for count, want in moments:
        for record in records[applied:count]:
            replay.apply(record)
        applied = count
        assert replay_state(replay) == want, f"after {replay.step + 1} steps"
    for record in records[applied:]:
        replay.apply(record)
    return replay


def drive(llm: LLM, requests: list, abort_at: dict) -> dict:
    """Add the requests, step until done, aborting request ids at the steps `abort_at` says."""
    engine = llm.llm_engine
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        engine.abort_request(abort_at.get(steps, []))
        for out in engine.step():
            outputs[out.request_id] = out
        steps += 1
    return outputs


def test_replay_equals_the_engine_through_preemption_chunks_prefix_hits_aborts_and_n(
        llama_dir, tmp_path, watched):
    records, moments = watched
    path = tmp_path / "run.jsonl"
    llm = LLM(llama_dir, event_log=str(path), num_kvcache_blocks=14, max_num_batched_tokens=48,
              max_num_seqs=5, max_model_len=224)
    shared = random_prompts([40], seed=1)[0]
    prompts = random_prompts([20, 70, 9, 33, 15, 50], seed=2, prefix=shared)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    requests = [(f"r{i}", p, greedy) for i, p in enumerate(prompts)]
    requests.append(("n3", prompts[0], SamplingParams(n=3, temperature=0.8, seed=3,
                                                      max_tokens=10, ignore_eos=True)))
    requests.append(("stop", [5, 6, 7], SamplingParams(max_tokens=40, stop=["e"], seed=1)))
    outputs = drive(llm, requests, {4: ["r2"], 9: ["r4"]})
    llm.reset_prefix_cache()
    llm.shutdown()
    replay = check_replay(records, moments)
    assert replay.counts["preemptions"] > 0 and replay.counts["hits"] > 0
    assert any(n > 1 and start > 0 for r in records if r["t"] == "step"
               for _, n, start, _ in r["sched"])   # (a chunk that is not a prompt's first)
    assert not replay.cached   # (the prefix cache was emptied at the end)
    finishes = [r["reason"] for r in records if r["t"] == "finish"]
    assert finishes.count("abort") >= 1 and "stop" in outputs
    with open(path) as f:   # the file holds what was recorded, and a recording reads it
        assert [json.loads(line) for line in f] == records
    recording = Recording.read(str(path))
    assert recording.error is None and recording.info()["last"] == replay.step
    step = replay.step // 2
    assert recording.state(step)["running"] == Replay_after(records, step).running


def Replay_after(records: list, step: int) -> Replay:
    replay = Replay()
    for record in records:
        if record["t"] == "step" and replay.step == step:
            break
        replay.apply(record)
    return replay


def test_a_stop_string_is_recorded_as_a_stop(llama_dir, tmp_path, watched):
    records, moments = watched
    llm = LLM(llama_dir, event_log=str(tmp_path / "run.jsonl"))
    prompts = random_prompts([6] * 8, seed=4)
    out = llm.generate(prompts, SamplingParams(max_tokens=60, stop=["e"], seed=2), use_tqdm=False)
    llm.shutdown()
    stopped = [o for o in out if o.outputs[0].stop_reason == "e"]
    assert stopped, "no output held the stop string (change the seed)"
    reasons = [r["reason"] for r in records if r["t"] == "finish"]
    assert "abort" not in reasons and reasons.count("stop") >= len(stopped)


def test_replay_with_ngram_speculation(llama_dir, tmp_path, watched):
    records, moments = watched
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    llm = LLM(llama_dir, event_log=str(tmp_path / "run.jsonl"), speculative_config=spec,
              num_kvcache_blocks=16, max_num_batched_tokens=64, max_model_len=256)
    prompts = [[7, 8, 9] * 10, random_prompts([25], seed=5)[0], [4, 5] * 12]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                 use_tqdm=False)
    llm.shutdown()
    replay = check_replay(records, moments)
    assert replay.counts["drafts"] > 0


def test_replay_with_a_kv_connector(llama_dir, tmp_path, watched):
    records, moments = watched
    def transfer(role):
        return {"kv_connector": "SharedStorageConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}
    prompts = random_prompts([40, 57, 33], seed=6)
    producer = LLM(llama_dir, kv_transfer_config=transfer("kv_producer"))
    producer.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    producer.shutdown()
    consumer = LLM(llama_dir, event_log=str(tmp_path / "run.jsonl"),
                   kv_transfer_config=transfer("kv_consumer"))
    out = consumer.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    consumer.shutdown()
    assert [o.num_cached_tokens for o in out] == [32, 48, 32]   # (loaded, not computed)
    check_replay(records, moments)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 20), st.integers(1, 3)), min_size=1,
                max_size=7),
       st.integers(6, 24), st.booleans(), st.booleans(), st.integers(0, 2**20))
def test_replay_equals_the_engine_on_random_workloads(llama_dir, tmp_path, watched, requests,
                                                      num_blocks, prefix_caching, asynchronous,
                                                      seed):
    records, moments = watched
    records.clear()
    moments.clear()
    rng = random.Random(seed)
    llm = LLM(llama_dir, event_log=str(tmp_path / "run.jsonl"), num_kvcache_blocks=num_blocks,
              max_num_batched_tokens=32, max_num_seqs=4, max_model_len=num_blocks * 16,
              enable_prefix_caching=prefix_caching, async_scheduling=asynchronous)
    shared = random_prompts([rng.randint(0, 40)], seed=seed)[0]
    work = [(f"q{i}", (shared + random_prompts([n], seed=seed + i)[0])[:num_blocks * 16 - m - 1],
             SamplingParams(n=k, temperature=0.7, seed=i, max_tokens=m, ignore_eos=True))
            for i, (n, m, k) in enumerate(requests)]
    aborts = {rng.randint(0, 12): [f"q{rng.randrange(len(work))}"] for _ in range(2)}
    drive(llm, work, aborts)
    llm.shutdown()
    if len(moments) > 3:
        check_replay(records, moments)


def test_recording_changes_no_token_and_a_quiet_core_is_plain(llama_dir, tmp_path):
    prompts = random_prompts([30, 12, 45], seed=7)
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=16)
    plain = LLM(llama_dir, num_kvcache_blocks=8, max_model_len=128)
    assert type(plain.llm_engine.scheduler) is Scheduler
    assert type(plain.llm_engine.scheduler.block_manager) is BlockManager
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.shutdown()
    recorded = LLM(llama_dir, num_kvcache_blocks=8, max_model_len=128, event_log=str(tmp_path / "run.jsonl"))
    got = [o.outputs[0].token_ids for o in recorded.generate(prompts, params, use_tqdm=False)]
    recorded.shutdown()
    assert got == want
    assert type(recorded.llm_engine.scheduler) is Scheduler   # (back to plain once stopped)


def test_a_bad_path_and_the_size_limit(llama_dir, tmp_path, monkeypatch, caplog):
    with pytest.raises(ValueError, match="event_log: cannot write"):
        LLM(llama_dir, event_log=str(tmp_path / "no-such-folder" / "run.jsonl"))
    monkeypatch.setenv("NANOINFER_EVENT_LOG_MAX_MB", "0.002")
    llm = LLM(llama_dir, event_log=str(tmp_path / "run.jsonl"))
    llm.generate(random_prompts([20] * 4, seed=8), SamplingParams(max_tokens=20), use_tqdm=False)
    llm.shutdown()
    lines = (tmp_path / "run.jsonl").read_text().splitlines()
    assert json.loads(lines[-1]) == {"t": "end", "why": "the size limit"}
    assert sum(map(len, lines)) <= 0.002 * 2**20 + 100
    assert any("NANOINFER_EVENT_LOG_MAX_MB=0.002 reached" in r.getMessage() for r in caplog.records)


def test_a_log_is_written_to_its_end_without_a_shutdown(llama_dir, tmp_path):
    """A script that exits without `llm.shutdown()` still leaves the whole log (the writer thread
    is waited for at exit)."""
    import subprocess
    import sys
    path = tmp_path / "run.jsonl"
    script = (f"from nanoinfer import LLM, SamplingParams\n"
              f"llm = LLM({llama_dir!r}, event_log={str(path)!r})\n"
              "llm.generate([[5, 6, 7]] * 8, SamplingParams(max_tokens=40, ignore_eos=True), "
              "use_tqdm=False)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    replay = Replay()
    for record in records:
        replay.apply(record)
    assert replay.counts["generated"] == 8 * 40 and not replay.seqs
