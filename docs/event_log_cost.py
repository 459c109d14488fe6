"""What recording the event log costs the engine's host: `python docs/event_log_cost.py`.

The scheduler's loop alone, without a model: 256 sequences of nano-vllm's workload shape (prompts
of 100 to 1024 tokens, 100 to 1024 output tokens, a budget of 16,384 tokens a step), each step
scheduled (`Scheduler.schedule`) and its tokens appended (`update_from_output`, one token for
each sequence whose step reaches its end), as `EngineCore.step` does around the GPU's work. Timed
without the event log and with it (to a file in /tmp), three rounds alternated; the medians of
the per-step host time are printed, and the writer thread's time per record (off the step loop).
This is the host's share; on a GPU, `python bench.py --event-log PATH` against `python bench.py`
is the figure that counts (docs/BENCHMARKS.md, "The event log").
"""
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, "tests")   # (a test model's config: conftest.save_model)


def run(model: str, event_log: str | None) -> float:
    """Median µs of one step's host work (schedule and update)."""
    from nanoinfer import SamplingParams
    from nanoinfer.config import Config
    from nanoinfer.core.block_manager import BlockManager
    from nanoinfer.core.messages import ModelRunnerOutput
    from nanoinfer.core.scheduler import Scheduler
    from nanoinfer.core.sequence import Sequence
    from nanoinfer.engine.event_log import EventLog
    config = Config(model, max_num_batched_tokens=16384, max_model_len=2048, device="cpu")
    scheduler = Scheduler(config, BlockManager(30_000, 16, True, 2048))
    log = EventLog(scheduler, event_log) if event_log else None
    rng = random.Random(0)
    for i in range(256):
        prompt = [rng.randint(0, 400) for _ in range(rng.randint(100, 1024))]
        scheduler.add(Sequence(i, prompt, SamplingParams(ignore_eos=True), rng.randint(100, 1024),
                               16))
    times = []
    while scheduler.requests:
        start = time.perf_counter_ns()
        sched = scheduler.schedule()
        done = [s for s in sched.num_scheduled_tokens
                if scheduler.requests[s].num_output_placeholders]
        scheduler.update_from_output(ModelRunnerOutput(done, [[7]] * len(done)))
        times.append((time.perf_counter_ns() - start) / 1e3)
    if log is not None:
        log.close()
    return statistics.median(times)


def encode_cost(log: str) -> float:
    """µs to encode and write one record of `log`, as the writer thread does."""
    records = [json.loads(line) for line in open(log)]
    with open(os.devnull, "w") as out:
        start = time.perf_counter()
        for record in records:
            out.write(json.dumps(record, separators=(",", ":")) + "\n")
    return (time.perf_counter() - start) / len(records) * 1e6


if __name__ == "__main__":
    from conftest import save_model
    model = save_model("qwen2", "/tmp/nanoinfer-event-log-cost", max_position_embeddings=2048)
    log = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    rows = {"off": [], "on": []}
    for _ in range(3):
        for name in rows:
            rows[name].append(run(model, log if name == "on" else None))
    for name, runs in rows.items():
        print(f"event log {name}: one step's host work {statistics.median(runs):.0f} µs "
              f"(median of each run's median; runs: {[round(r) for r in runs]})")
    size = os.path.getsize(log) / 1e6
    print(f"the writer: {encode_cost(log):.1f} µs a record, {sum(1 for _ in open(log))} records "
          f"({size:.1f} MB) for one run")
