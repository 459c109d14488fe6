"""The engine under a random stream of requests: every accepted request finishes (or is
aborted), outputs (greedy, and seeded sampling) equal those of the same requests run alone,
through preemptions and prefix hits, and no block leaks."""
import random

from conftest import random_prompts
from nanoinfer import LLM, SamplingParams


def test_random_stream_with_aborts(llama_dir):
    llm = LLM(llama_dir, num_kvcache_blocks=12, max_model_len=160, max_num_batched_tokens=40, max_num_seqs=6)
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
