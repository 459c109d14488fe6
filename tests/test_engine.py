"""The engine under a random stream of requests, and async scheduling against sync.

After every step of the stream: each running request's block table equals the runner's copy,
the runner's tokens are a prefix of the scheduler's, reference counts equal live users, and no
block is both free and used. At the end every block is free, and every greedy or seeded request
returned what it returns when run alone (tokens, text, finish reason, logprobs)."""
import math
import pickle
import random

import pytest

from conftest import random_prompts
from nanoinfer import LLM, CompletionOutput, SamplingParams
from nanoinfer.sampling_params import RequestOutputKind


def check_consistency(engine) -> None:
    scheduler, batch = engine.scheduler, engine.model_executor.input_batch
    bm = scheduler.block_manager
    held = set(batch.rows) - scheduler.finished_seq_ids   # those still to forget are told next step
    assert held == {seq.seq_id for seq in scheduler.running}
    for seq in scheduler.running:
        row = batch.rows[seq.seq_id]
        assert batch.block_table[row, :batch.num_blocks[row]].tolist() == seq.block_table
        assert batch.token_ids[row, :batch.num_tokens[row]].tolist() == seq.token_ids[:batch.num_tokens[row]]
        assert seq.num_tokens - batch.num_tokens[row] <= 1   # all but the token sampled since it was sent
    live = [seq for seq in scheduler.requests.values() if seq.block_table]
    for block_id in range(bm.next_unused):   # (the blocks after have never been used)
        users = sum(seq.block_table.count(block_id) for seq in live)
        assert bm.ref_counts[block_id] == users
        assert (block_id in bm.free_block_queue) == (users == 0)


def stream():
    """30 requests: greedy and seeded, shared prefixes, stops of each kind, min_tokens, logprobs."""
    rng = random.Random(0)
    shared = random_prompts([33], seed=13)[0]
    requests = {}
    for i in range(30):
        prompt = shared[:rng.choice([0, 16, 33])] + random_prompts([rng.randrange(1, 40)], seed=100 + i)[0]
        sampling = dict(temperature=0.8, seed=i) if i % 3 == 0 else dict(temperature=0)
        extra = rng.choice([{}, {"ignore_eos": True}, {"min_tokens": 3}, {"logprobs": 2}, {"n": 2},
                            {"repetition_penalty": 1.3, "frequency_penalty": 0.4},
                            {"stop": ["e"]},
                            {"stop_token_ids": rng.sample(range(3, 512), 150), "min_tokens": rng.choice([0, 3])}])
        requests[str(1000 + i)] = (prompt, SamplingParams(max_tokens=rng.randrange(3, 20), **sampling, **extra,
                                                          output_kind=rng.choice(list(RequestOutputKind))))
    return requests


def collect(samples: dict, out, kind: RequestOutputKind) -> None:
    """Follow one request's outputs as its output_kind returns them, keeping each sample whole."""
    assert kind != RequestOutputKind.FINAL_ONLY or out.finished
    for c in out.outputs:
        old = samples.get(c.index)
        if kind == RequestOutputKind.DELTA and old is not None:
            c = CompletionOutput(index=c.index, text=old.text + c.text, token_ids=old.token_ids + c.token_ids,
                                 cumulative_logprob=c.cumulative_logprob, finish_reason=c.finish_reason,
                                 stop_reason=c.stop_reason,
                                 logprobs=None if c.logprobs is None else old.logprobs + c.logprobs)
        samples[c.index] = c


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_random_stream_with_aborts(llama_dir, async_scheduling):
    llm = LLM(llama_dir, num_kvcache_blocks=12, max_model_len=160, max_num_batched_tokens=40, max_num_seqs=6,
              async_scheduling=async_scheduling)
    engine = llm.llm_engine
    rng = random.Random(1)
    requests = stream()
    pending, finished, aborted, collected = list(requests), set(), set(), {}
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                request_id = pending.pop(0)
                engine.add_request(request_id, *requests[request_id])
        if rng.random() < 0.05 and engine.scheduler.running:
            victim = rng.choice(engine.scheduler.running)
            request_id = next(r for r, state in engine.output_processor.requests.items()
                              if victim.seq_id in state.seq_ids)
            engine.abort_request([request_id])
            aborted.add(request_id)
        if engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id not in aborted and out.request_id not in finished
                collect(collected.setdefault(out.request_id, {}), out, requests[out.request_id][1].output_kind)
                if out.finished:
                    finished.add(out.request_id)
            check_consistency(engine)
    assert set(finished) | aborted == set(requests) and not set(finished) & aborted
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == 12 and not bm.ref_counts.any()
    assert engine.scheduler.num_preemptions > 0 and bm.num_prefix_hit_tokens > 0
    alone = LLM(llama_dir, max_model_len=160)
    for request_id in finished:
        prompt, params = requests[request_id]
        expected = alone.generate(prompt, params, use_tqdm=False)[0].outputs
        assert sorted(collected[request_id]) == list(range(params.n))
        for b in expected:
            a = collected[request_id][b.index]
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                              b.stop_reason)
            assert_logprobs_close(a.logprobs, b.logprobs)


def assert_logprobs_close(a, b):
    assert (a is None) == (b is None)
    for x, y in zip(a or [], b or []):   # batches differ: float rounding too
        assert x.keys() == y.keys()
        assert all(math.isclose(x[t].logprob, y[t].logprob, abs_tol=1e-4) and x[t].rank == y[t].rank for t in x)


def test_async_scheduling_matches_sync(llama_dir):
    """With async scheduling a step is planned before the previous step's tokens are known, so a
    sequence that stops on a token (stop ids, stop strings) has one more token in flight, which
    is dropped: tokens, text, logprobs and stop reasons equal those of the engine that waits."""
    prompts = random_prompts([5, 17, 30, 9, 12], seed=21)
    sync, asynchronous = LLM(llama_dir, async_scheduling=False), LLM(llama_dir)
    free = [o.outputs[0] for o in sync.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                         ignore_eos=True), use_tqdm=False)]
    params = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free[0].token_ids[6]]),
              SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free[1].token_ids[3]], min_tokens=8),
              SamplingParams(temperature=0, max_tokens=24, stop=[free[2].text[10:13]]),
              SamplingParams(temperature=0.8, seed=4, max_tokens=24, logprobs=2, ignore_eos=True,
                             presence_penalty=0.5, repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=1)]
    in_flight = []
    schedule = asynchronous.llm_engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        in_flight.append(max((seq.num_output_placeholders for seq in asynchronous.llm_engine.scheduler.running),
                             default=0))
        return out
    asynchronous.llm_engine.scheduler.schedule = recording_schedule
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = asynchronous.generate(prompts, params, use_tqdm=False)
    assert max(in_flight) == 2   # a step was planned with the previous step's token still in flight
    for a, b in zip(got, expected):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                          b.stop_reason)
        assert_logprobs_close(a.logprobs, b.logprobs)
    assert [o.outputs[0].finish_reason for o in got[::2]] == ["stop", "stop", "length"]
    assert len(got[1].outputs[0].token_ids) >= 8


def test_block_completed_by_the_last_token_is_cached(llama_dir):
    """A block whose last slot is filled by a token that was in flight is hashed when the token
    arrives, even if its sequence never runs again: a follow-up hits it, as without async."""
    prompt = random_prompts([30], seed=40)[0]
    hits = []
    for async_scheduling in (True, False):
        llm = LLM(llama_dir, async_scheduling=async_scheduling)
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
        follow_up = prompt + out.outputs[0].token_ids + [5]
        hits.append(llm.generate(follow_up, SamplingParams(max_tokens=1), use_tqdm=False)[0].num_cached_tokens)
    assert hits == [32, 32]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_step_message_round_trip(llama_dir, async_scheduling):
    """Each step's SchedulerOutput, pickled and applied to a second model runner built from the
    same config, gives the same sampled tokens: what a tensor-parallel worker will do. Greedy,
    seeded and unseeded requests, penalties and min_tokens, prefix hits, chunks and preemption."""
    from nanoinfer.worker.model_runner import ModelRunner
    llm = LLM(llama_dir, num_kvcache_blocks=14, max_model_len=160, max_num_batched_tokens=32, max_num_seqs=8,
              async_scheduling=async_scheduling)
    engine = llm.llm_engine
    second = ModelRunner(engine.config)
    execute_model, sample_tokens = engine.model_executor.execute_model, engine.model_executor.sample_tokens
    pairs, executed = [], []

    def execute_both(sched):
        message = pickle.dumps(sched)
        executed.append(second.execute_model(pickle.loads(message)))
        return execute_model(sched)

    def sample_both(step, grammar=None):
        out = sample_tokens(step, grammar)
        pairs.append((out, second.sample_tokens(executed.pop(), pickle.loads(pickle.dumps(grammar)))))
        return out
    engine.model_executor.execute_model, engine.model_executor.sample_tokens = execute_both, sample_both
    shared = random_prompts([20], seed=50)[0]
    prompts = [shared + p for p in random_prompts([3, 30, 12, 41, 7, 25], seed=51)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True, frequency_penalty=0.8),
              SamplingParams(temperature=1.0, max_tokens=18, ignore_eos=True, top_k=20, top_p=0.9),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=10, stop_token_ids=list(range(3, 200)),
                             repetition_penalty=1.3),
              SamplingParams(temperature=0.7, seed=8, n=2, max_tokens=10, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=15, presence_penalty=-1.0, ignore_eos=True)]
    llm.generate(prompts, params, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.block_manager.num_prefix_hit_tokens > 0
    for a, b in pairs:
        a, b = a.get_output(), b.get_output()
        assert (a.seq_ids, a.sampled_token_ids) == (b.seq_ids, b.sampled_token_ids)
        assert (a.logprobs is None) == (b.logprobs is None)
    assert len(pairs) > 20


def test_decode_step_message_is_a_few_kb(llama_dir):
    """The message of a 256-sequence decode step, pickled: a few KB (recorded in BENCHMARKS.md)."""
    llm = LLM(llama_dir, max_num_seqs=256, max_model_len=64, num_kvcache_blocks=600)
    engine, sizes = llm.llm_engine, []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        if len(out.num_scheduled_tokens) == 256 and out.total_num_scheduled_tokens == 256:
            sizes.append(len(pickle.dumps(out)))
        return out
    engine.scheduler.schedule = recording_schedule
    llm.generate(random_prompts([5] * 256, seed=52), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    assert sizes and max(sizes) < 8192
    print(f"256-sequence decode step message: {max(sizes)} bytes pickled")
