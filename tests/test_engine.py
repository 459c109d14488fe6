"""The engine under a random stream of requests: every accepted request finishes (or is
aborted), outputs (greedy, and seeded sampling) equal those of the same requests run alone,
through preemptions and prefix hits, and no block leaks; with async scheduling and without."""
import random

import pytest

from conftest import random_prompts
from nanoinfer import LLM, SamplingParams


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_random_stream_with_aborts(llama_dir, async_scheduling):
    llm = LLM(llama_dir, num_kvcache_blocks=12, max_model_len=160, max_num_batched_tokens=40, max_num_seqs=6,
              async_scheduling=async_scheduling)
    engine = llm.llm_engine
    rng = random.Random(0)
    shared = random_prompts([33], seed=13)[0]
    requests = {}
    for i in range(30):
        prompt = (shared[:rng.choice([0, 16, 33])] + random_prompts([rng.randrange(1, 40)], seed=100 + i)[0])
        sampled = dict(temperature=0.8, seed=i) if i % 3 == 0 else dict(temperature=0)   # seeded: reproducible
        requests[str(1000 + i)] = (prompt, SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True, **sampled))
    pending, finished, aborted = list(requests), {}, set()
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                request_id = pending.pop(0)
                engine.add_request(*requests[request_id], request_id=request_id)
        if rng.random() < 0.05 and engine.scheduler.running:
            request_id = rng.choice(engine.scheduler.running).request_id
            assert engine.abort_request(request_id).outputs[0].finish_reason == "abort"
            aborted.add(request_id)
        if engine.has_unfinished_requests():
            for out in engine.step():
                finished[out.request_id] = out
    assert set(finished) | aborted == set(requests) and not set(finished) & aborted
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == 12 and all(b.ref_count == 0 for b in bm.blocks)
    assert engine.scheduler.num_preemptions > 0 and bm.num_prefix_hit_tokens > 0
    alone = LLM(llama_dir)
    for request_id, out in finished.items():
        prompt, params = requests[request_id]
        assert out.outputs[0].token_ids == alone.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


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
              SamplingParams(temperature=0.8, seed=4, max_tokens=24, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1)]
    in_flight = []
    schedule = asynchronous.llm_engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        in_flight.append(max((seq.num_output_placeholders for seq in out.seqs), default=0))
        return out
    asynchronous.llm_engine.scheduler.schedule = recording_schedule
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = asynchronous.generate(prompts, params, use_tqdm=False)
    assert max(in_flight) == 2   # a step was planned with the previous step's token still in flight
    for a, b in zip(got, expected):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                          b.stop_reason)
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):   # batches differ: float rounding too
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
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
