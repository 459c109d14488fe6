"""Token-exact greedy parity with transformers, for each model family and each engine mechanism:
mixed prompt lengths in one batch, prefix-cache hits, chunked prefill, and preemption."""
import pytest
import torch

from conftest import hf_greedy, random_prompts
from nanoinfer import LLM, SamplingParams

FAMILIES = ["llama", "qwen2", "qwen3"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY
                 ) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def expected(model_dir: str, prompts: list[list[int]], max_tokens: int = GREEDY.max_tokens
             ) -> list[list[int]]:
    return [hf_greedy(model_dir, p, max_tokens) for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_mixed_lengths(model_dirs, family):
    prompts = random_prompts([1, 7, 16, 33, 60], seed=1)
    llm = LLM(model_dirs[family])
    assert generate_ids(llm, prompts) == expected(model_dirs[family], prompts)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits(model_dirs, family):
    prompts = random_prompts([5, 20, 37], seed=2, prefix=random_prompts([40], seed=3)[0])
    llm = LLM(model_dirs[family])
    bm = llm.llm_engine.scheduler.block_manager
    first = generate_ids(llm, prompts[:1])
    assert bm.num_prefix_hit_tokens == 0
    rest = generate_ids(llm, prompts[1:])   # share the first prompt's two full blocks
    assert bm.num_prefix_hit_tokens == 2 * 32
    again = generate_ids(llm, prompts)      # whole prompts now cached (but their last token)
    assert first + rest == again == expected(model_dirs[family], prompts)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_mixed_steps(model_dirs, family):
    prompts = random_prompts([3, 45, 70, 9], seed=4)
    llm = LLM(model_dirs[family], max_num_batched_tokens=16)
    steps = []
    schedule = llm.llm_engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        cached = out.scheduled_cached_reqs
        start = dict(zip(cached.seq_ids, cached.num_computed_tokens))
        start.update((r.seq_id, r.num_computed_tokens) for r in out.scheduled_new_reqs)
        steps.append([(start[seq_id], n) for seq_id, n in out.num_scheduled_tokens.items()])
        return out
    llm.llm_engine.scheduler.schedule = recording_schedule
    assert generate_ids(llm, prompts) == expected(model_dirs[family], prompts)
    assert all(sum(n for _, n in step) <= 16 for step in steps)
    chunked = any(computed > 0 and n > 1 for step in steps for computed, n in step)
    mixed = any({n == 1 for _, n in step} == {True, False} for step in steps)
    assert chunked and mixed


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_keeps_outputs(model_dirs, family):
    prompts = random_prompts([30, 41, 25, 50, 36], seed=5)
    llm = LLM(model_dirs[family], num_kvcache_blocks=12, max_model_len=128)
    assert generate_ids(llm, prompts) == expected(model_dirs[family], prompts)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.scheduler.block_manager.num_free_blocks == 12


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_backend(model_dirs, family):
    """The whole engine on the Triton kernels (under the interpreter on a CPU-only machine):
    prefill chunks after cached prefixes, mixed steps and pure decode steps."""
    prompts = random_prompts([20, 45], seed=9, prefix=random_prompts([32], seed=10)[0])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(model_dirs[family], attention_backend="triton", max_num_batched_tokens=48, device=device,
              dtype="float32", enforce_eager=True)
    # (few tokens: every interpreted step takes a while)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = generate_ids(llm, prompts[:1], params) + generate_ids(llm, prompts[1:], params)
    assert llm.llm_engine.scheduler.block_manager.num_prefix_hit_tokens == 32
    assert ids == expected(model_dirs[family], prompts, params.max_tokens)
