"""GPU tests (run on a CUDA machine: `python -m pytest -q -m gpu`): the Triton kernels in
bfloat16 at real model shapes, and the whole engine, with and without CUDA graphs."""
import random

import pytest
import torch

from conftest import VOCAB_SIZE, hf_greedy, random_prompts, write_eagle_head, write_medusa_head
from nanoinfer import LLM, SamplingParams
from test_kernels import make_step, reference, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama-8b": (32, 8, 128), "smollm2": (9, 3, 64)}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_seqs, max_len", [(64, 2048), (2, 8192)])
def test_decode_kernel_bf16(shape, num_seqs, max_len):
    from nanoinfer.kernels.decode_attention import decode_attention
    rng = random.Random(num_seqs)
    context_lens = [rng.randint(1, max_len) for _ in range(num_seqs)]
    query, k_cache, v_cache, meta = make_step([1] * num_seqs, context_lens, *SHAPES[shape], torch.bfloat16)
    out = decode_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.088)
    assert rel_err(out, reference(query, k_cache, v_cache, meta, 0.088)) < 2e-2


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_kernel_bf16(shape):
    from nanoinfer.kernels.prefill_attention import prefill_attention
    query_lens, context_lens = [2048, 700, 1, 513, 1, 129], [2048, 1500, 900, 513, 77, 4000]
    query, k_cache, v_cache, meta = make_step(query_lens, context_lens, *SHAPES[shape], torch.bfloat16)
    out = prefill_attention(query, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                            meta.max_seqlen_q, 0.088)
    assert rel_err(out, reference(query, k_cache, v_cache, meta, 0.088)) < 2e-2


@pytest.mark.parametrize("k, n", [(1024, 4096), (2048, 1024), (3072, 1024), (4096, 24576)])
def test_gemv_bf16_at_model_shapes(k, n):
    """A decode step's linear layers (up to 16 bf16 rows) go through the gemv kernel, within
    bf16 rounding of an exact product; more rows go to torch."""
    from nanoinfer.kernels.gemv import MAX_ROWS, gemv, linear
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 7, MAX_ROWS, MAX_ROWS + 1):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        out = linear(x, weight, bias)
        assert rel_err(out, x.double() @ weight.double().T + bias.double()) < 1e-2
        # which of the two ran (the same bits as a direct call)
        picked = gemv(x, weight, bias) if rows <= MAX_ROWS else torch.nn.functional.linear(
            x, weight, bias)
        assert torch.equal(out, picked)
    # float32 (the exactness runs) stays with torch
    x = torch.randn(3, k, device="cuda")
    assert torch.equal(linear(x, weight.float()), torch.nn.functional.linear(x, weight.float()))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_engine_matches_transformers_on_gpu(model_dirs, family, enforce_eager):
    """float32 on the GPU, Triton attention, CUDA graphs or not, prefix hits and chunked prefill."""
    prompts = random_prompts([3, 17, 40, 64, 100], seed=31, prefix=random_prompts([16], seed=32)[0])
    llm = LLM(model_dirs[family], dtype="float32", enforce_eager=enforce_eager, max_num_batched_tokens=64, max_num_seqs=64,
              max_model_len=256)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert outs == [hf_greedy(model_dirs[family], p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefill_graphs_match_transformers(model_dirs, family):
    """float32: prompt chunks and mixed steps of up to 16 sequences replay the prefill graphs
    (padded to a graph's token count, with spare sequences), prefix hits and chunks too, then
    fewer sequences than the graph ran before (the spare ones must not keep their queries); every
    token stays transformers'. A step of 17 sequences runs eagerly."""
    llm = LLM(model_dirs[family], dtype="float32", max_num_batched_tokens=256, max_model_len=512)
    runner, steps = llm.llm_engine.model_executor.graph_runner, []
    graph_size = runner.graph_size
    runner.graph_size = lambda meta, n: steps.append((graph_size(meta, n), len(meta.context_lens))) or steps[-1][0]
    prefix = random_prompts([16], seed=32)[0]
    for prompts in (random_prompts([3, 17, 40, 64, 100, 300], seed=37, prefix=prefix), random_prompts([150, 7], seed=39),
                    random_prompts([5] * 17, seed=38)):
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert outs == [hf_greedy(model_dirs[family], p, GREEDY.max_tokens) for p in prompts]
    del runner.graph_size   # a reference cycle
    assert any(size and not size[1] for size, seqs in steps if seqs == 2)   # a prefill graph, 2 sequences
    assert any(size is None for size, seqs in steps if seqs == 17)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_prompt_logprobs_and_logit_bias_on_gpu(llama_dir, enforce_eager):
    """float32: every prompt token's logprob equals transformers', over prefill chunks; a logit
    bias holds in CUDA graph decode steps."""
    from conftest import hf_logits
    llm = LLM(llama_dir, dtype="float32", enforce_eager=enforce_eager, max_num_batched_tokens=32,
              max_model_len=256)
    prompt = random_prompts([70], seed=36)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1,
                                              logit_bias={99: 100}, ignore_eos=True), use_tqdm=False)[0]
    ref = hf_logits(llama_dir, prompt).log_softmax(-1)
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, 70)])
    assert torch.allclose(got, ref[torch.arange(69), torch.tensor(prompt[1:])], atol=1e-3)
    assert out.outputs[0].token_ids == [99] * 8


def test_async_llm_on_gpu_equals_offline(llama_dir):
    """The engine core in its own process on the GPU: streamed tokens equal the offline engine's."""
    import asyncio

    from nanoinfer import RequestOutputKind
    from nanoinfer.engine.async_llm import AsyncLLM
    prompts, params = random_prompts([5, 30, 77, 120], seed=35), dict(temperature=0, max_tokens=32, ignore_eos=True)
    engine = AsyncLLM(llama_dir, dtype="float32", max_model_len=256, max_num_seqs=64)
    try:
        async def one(i, prompt):
            tokens = []
            async for out in engine.generate(prompt, SamplingParams(**params, output_kind=RequestOutputKind.DELTA),
                                             f"r{i}"):
                tokens += out.outputs[0].token_ids
            return tokens

        async def run():
            return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
        got = asyncio.run(run())
    finally:
        engine.shutdown()
    want = LLM(llama_dir, dtype="float32", max_model_len=256, max_num_seqs=64).generate(
        prompts, SamplingParams(**params), use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("num_seqs", [5, 8, 33])
def test_cuda_graph_decode_equals_eager(llama_dir, num_seqs):
    prompts = random_prompts([random.Random(i).randint(1, 90) for i in range(num_seqs)], seed=33)
    runs = [LLM(llama_dir, dtype="float32", enforce_eager=eager, max_model_len=256, max_num_seqs=64).generate(
        prompts, GREEDY, use_tqdm=False) for eager in (True, False)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


def test_graphs_are_used_for_decode(llama_dir):
    llm = LLM(llama_dir, max_model_len=256, max_num_seqs=64)
    runner = llm.llm_engine.model_executor
    assert runner.graph_runner is not None and 1 in runner.graph_runner.graphs
    replays = []
    run = runner.graph_runner.run
    runner.graph_runner.run = lambda *a: replays.append(1) or run(*a)
    llm.generate(random_prompts([10, 20]), GREEDY, use_tqdm=False)
    assert len(replays) == GREEDY.max_tokens   # the prefill step's graph, then every decode's
    del runner.graph_runner.run   # a reference cycle: the engine's memory would outlive the test


def test_sampling_kernel_at_real_vocab():
    """bf16 logits over a 151,936-token vocabulary: greedy rows take a maximum, and random rows
    follow softmax(logits / T)."""
    from nanoinfer.kernels.sampling import gumbel_max_sample
    logits = torch.randn(64, 151936, device="cuda").bfloat16()
    out = gumbel_max_sample(logits, torch.zeros(64, device="cuda"), torch.arange(64, device="cuda"))
    assert torch.equal(logits.gather(1, out.unsqueeze(1)).squeeze(1), logits.max(-1).values)
    row = torch.randn(151936, device="cuda") * 4
    rows = 4096
    draws = gumbel_max_sample(row.bfloat16().expand(rows, -1), torch.full((rows,), 0.8, device="cuda"),
                              torch.arange(rows, device="cuda") + 10**12)
    probs = (row.bfloat16().float() / 0.8).softmax(-1)
    top = probs.topk(5).indices
    assert torch.allclose(torch.bincount(draws, minlength=151936)[top].float() / rows, probs[top], atol=0.03)


def test_bitmask_kernel_at_real_vocab():
    from nanoinfer.layers.sampler import apply_token_bitmask   # (torch on the CPU, the kernel here)
    logits = torch.randn(64, 151936, device="cuda", dtype=torch.bfloat16)
    masks = torch.randint(-2**31, 2**31 - 1, (300, 4748), device="cuda", dtype=torch.int64).to(torch.int32)
    rows = torch.randint(0, 300, (64,), device="cuda", dtype=torch.int32)
    want, got = logits.cpu(), logits.clone()
    apply_token_bitmask(want, masks.cpu(), rows.cpu())
    apply_token_bitmask(got, masks, rows)
    assert torch.equal(want, got.cpu())


def test_seeded_sampling_on_gpu(llama_dir):
    llm = LLM(llama_dir, max_model_len=256, max_num_seqs=64)
    prompts = random_prompts([9, 21, 14], seed=6)
    seeded = SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompts[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    together = llm.generate(prompts, [seeded, other, other], use_tqdm=False)[0].outputs[0].token_ids
    assert alone == together


def test_a_step_launches_without_waiting_for_the_gpu(llama_dir):
    """execute_model and sample_tokens never synchronise with the GPU, also with min_tokens
    blocking, penalties, seeds, top-k/top-p and logprobs: async scheduling depends on it."""
    llm = LLM(llama_dir, max_model_len=256, max_num_seqs=64)
    runner = llm.llm_engine.model_executor
    execute_model, sample_tokens = runner.execute_model, runner.sample_tokens

    def strict(fn):
        def run(*args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run
    llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)   # compiles the kernels first
    runner.execute_model, runner.sample_tokens = strict(execute_model), strict(sample_tokens)
    params = [SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=list(range(3, 300))),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, repetition_penalty=1.2, frequency_penalty=0.5,
                             presence_penalty=0.3, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=10, top_p=0.9, min_p=0.05, max_tokens=12, logprobs=3,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, logit_bias={77: 100}, prompt_logprobs=2, ignore_eos=True)]
    outs = llm.generate(random_prompts([9, 21, 14, 30], seed=6), params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) >= 6 and len(outs[2].outputs[0].logprobs) == 12
    assert outs[3].outputs[0].token_ids == [77] * 12 and len(outs[3].prompt_logprobs) == 30
    del runner.execute_model, runner.sample_tokens   # reference cycles, which would keep the memory


@pytest.mark.parametrize("method, max_num_seqs", [("ngram", 64), ("medusa", 64), ("eagle", 64), ("ngram", 4)])
def test_speculative_decoding_on_gpu(llama_dir, tmp_path, method, max_num_seqs):
    """float32: verification steps replay the decode CUDA graphs (a row per token; with 4
    sequences at most, the decode graphs are too small for that and they replay the prefill
    graphs, a sequence of k + 1 queries each) and every greedy and seeded token stays what it is
    without speculation."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    else:
        spec["model"] = write_medusa_head(str(tmp_path / "head"), 64, VOCAB_SIZE, 3) if method == "medusa" \
            else write_eagle_head(str(tmp_path / "head"), llama_dir)
    prompts = random_prompts([5, 40, 3, 90, 17], seed=3)
    prompts[1] = [9, 8, 7, 6] * 10   # repeats itself: n-gram drafts
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True)]
    settings = dict(dtype="float32", max_model_len=256, max_num_seqs=max_num_seqs)
    want = LLM(llama_dir, **settings).generate(prompts, params, use_tqdm=False)
    llm = LLM(llama_dir, speculative_config=spec, **settings)
    graphs, steps = llm.llm_engine.model_executor.graph_runner, []
    graph_size = graphs.graph_size
    graphs.graph_size = lambda meta, n: steps.append((graph_size(meta, n), n, meta.max_seqlen_q)) or steps[-1][0]
    got = llm.generate(prompts, params, use_tqdm=False)
    del graphs.graph_size   # a reference cycle
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    if max_num_seqs == 64:   # steps with drafts ran as decode graphs
        assert any(size and size[1] and n > len(prompts) for size, n, _ in steps)
    else:   # steps that only verify drafts ran as prefill graphs
        assert any(size and not size[1] and 1 < max_q <= 4 for size, _, max_q in steps)
    assert llm.llm_engine.scheduler.spec_stats.num_draft_tokens > 0


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@two_gpus
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tensor_parallel_matches_transformers_on_gpus(model_dirs, family):
    """Two GPUs, NCCL inside the CUDA graphs, float32: prefix hits, chunked prefill, async scheduling."""
    prompts = random_prompts([3, 17, 40, 64, 100], seed=31, prefix=random_prompts([16], seed=32)[0])
    llm = LLM(model_dirs[family], tensor_parallel_size=2, dtype="float32", max_num_batched_tokens=64,
              max_num_seqs=64, max_model_len=256)
    try:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert outs == [hf_greedy(model_dirs[family], p, GREEDY.max_tokens) for p in prompts]


@two_gpus
def test_tensor_parallel_bf16_equals_one_gpu(llama_dir):
    prompts = random_prompts([5, 30, 77, 12], seed=40)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        llm = LLM(llama_dir, tensor_parallel_size=tp, dtype="bfloat16", max_num_seqs=64, max_model_len=256)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
    assert runs[0] == runs[1]


@two_gpus
def test_killed_gpu_worker_raises_within_seconds(llama_dir):
    """Rank 0, whose CUDA graph would wait for the dead rank forever (NCCL's abort does not return
    from a graph's collective), is killed with it: the engine raises within seconds."""
    import os
    import signal
    import threading
    import time
    from nanoinfer.executor.multiproc_executor import WorkerDiedError
    llm = LLM(llama_dir, tensor_parallel_size=2, max_num_seqs=64, max_model_len=512)
    workers, killed = llm.llm_engine.model_executor.workers, []
    worker = workers[1]
    llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)
    threading.Timer(0.5, lambda: (killed.append(time.monotonic()), os.kill(worker.pid, signal.SIGKILL))).start()
    with pytest.raises(WorkerDiedError, match="exit code -9"):
        for _ in range(100):
            llm.generate(random_prompts([9] * 4), SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - killed[0] < 10
    llm.shutdown()
    assert not any(w.is_alive() for w in workers)


def test_shared_storage_connector_on_gpu(llama_dir, tmp_path):
    """The saver's CUDA path: each step's blocks copied on the device behind its forward, written
    by a thread, and saved before the step is reported; a consumer on the GPU loads them and gets
    transformers' tokens (float32), computing only the prompts' last blocks."""
    def transfer(role: str) -> dict:
        return {"kv_connector": "SharedStorageConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    prompts = random_prompts([40, 57, 16, 100], seed=37)
    producer = LLM(llama_dir, dtype="float32", max_model_len=256, kv_transfer_config=transfer("kv_producer"))
    producer.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(list(tmp_path.glob("*/*.safetensors"))) == 2 + 3 + 1 + 6   # (before shutdown)
    producer.shutdown()
    consumer = LLM(llama_dir, dtype="float32", max_model_len=256, kv_transfer_config=transfer("kv_consumer"))
    outputs = consumer.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(llama_dir, p, GREEDY.max_tokens) for p in prompts]
    assert [o.num_cached_tokens for o in outputs] == [32, 48, 0, 96]
    consumer.shutdown()
