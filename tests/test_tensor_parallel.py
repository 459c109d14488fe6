"""Tensor parallelism on the CPU: two ranks (worker processes) over gloo.

Greedy tokens equal transformers' for every family (one of them with a single KV head, which both
ranks then hold); with chunked prefill, prefix caching, preemption, seeded sampling, logprobs and
guided decoding the tokens equal one rank's, with async scheduling and without; and the processes and shared
memory are gone after shutdown, after a worker is killed, and after Ctrl-C.
"""
import gc
import multiprocessing as mp
from multiprocessing import shared_memory, synchronize
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import VOCAB_SIZE, hf_greedy, random_prompts, save_model, write_eagle_head, write_medusa_head
from nanoinfer import LLM, GuidedDecodingParams, SamplingParams
from nanoinfer.config import Config
from nanoinfer.engine.exceptions import EngineDeadError
from nanoinfer.executor.message_queue import MessageQueue
from nanoinfer.executor.multiproc_executor import WorkerDiedError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


# the shared memory segments and named semaphores that this process made: a leak check looks at
# these alone, so that another program's (another test run's) never count
CREATED: set[str] = set()


def record_names(cls, name_of) -> None:
    init = cls.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        CREATED.add(name_of(self))   # (None: a semaphore without a name)
    cls.__init__ = recording


record_names(shared_memory.SharedMemory, lambda shm: shm.name.lstrip("/"))
record_names(synchronize.SemLock, lambda lock: lock._semlock.name and "sem." + lock._semlock.name.lstrip("/"))


def shm_entries() -> set[str]:
    """This process's shared memory and semaphores that are still there."""
    return set(os.listdir("/dev/shm")) & CREATED


def assert_all_stopped(pids: list[int], shm_before: set[str]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not mp.active_children()
    assert shm_entries() <= shm_before   # the ring and the named semaphores are removed


@pytest.fixture(scope="module")
def one_kv_head_dir(tmp_path_factory) -> str:
    return save_model("llama", str(tmp_path_factory.mktemp("kv1") / "llama"), num_key_value_heads=1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "one-kv-head"])
def test_greedy_matches_transformers(model_dirs, one_kv_head_dir, family):
    path = one_kv_head_dir if family == "one-kv-head" else model_dirs[family]
    prompts = random_prompts([5, 23, 40], seed=1)
    llm = LLM(path, tensor_parallel_size=2)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, 12) for p in prompts]


def engine_run(path: str, tp: int, async_scheduling: bool = True, pp: int = 1) -> tuple[list, int]:
    """Shared prefixes, 16-token chunks, a cache too small for all: greedy, seeded and unseeded
    requests with logprobs."""
    prefix = random_prompts([32], seed=3)[0]
    prompts = random_prompts([30, 9, 41, 25, 50, 17], seed=4, prefix=prefix)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=12, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=-3, max_tokens=12, ignore_eos=True)] * 2
    params[5] = SamplingParams(temperature=1.0, seed=5, max_tokens=12,   # guided: the bitmask reaches rank 0
                               guided_decoding=GuidedDecodingParams(regex="[a-z ]{4,30}"))
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_kvcache_blocks=10, max_model_len=128,
              max_num_batched_tokens=16, async_scheduling=async_scheduling)
    try:
        outputs = llm.generate(prompts[:1], params[:1], use_tqdm=False)   # the prefix enters the cache
        outputs += llm.generate(prompts[1:], params[1:], use_tqdm=False)
        scheduler = llm.llm_engine.scheduler
        assert scheduler.num_preemptions > 0 and scheduler.block_manager.num_prefix_hit_tokens >= 32
        assert llm.reset_prefix_cache()
        again = llm.generate(prompts[:1], params[:1], use_tqdm=False)[0]
        assert again.outputs[0].token_ids == outputs[0].outputs[0].token_ids and not again.num_cached_tokens
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts[::3], outputs[::3]):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 12)
    assert re.fullmatch("[a-z ]{1,30}", outputs[5].outputs[0].text)   # (a prefix, if cut by max_tokens)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.fixture(scope="module")
def one_rank_run(model_dirs):
    return engine_run(model_dirs["llama"], tp=1)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_features_match_one_rank(model_dirs, one_rank_run, async_scheduling):
    two_ranks = engine_run(model_dirs["llama"], tp=2, async_scheduling=async_scheduling)
    assert [ids for ids, _ in two_ranks] == [ids for ids, _ in one_rank_run]
    for (_, logprobs), (_, expected) in zip(two_ranks, one_rank_run):
        for step, expected_step in zip(logprobs or [], expected or []):
            assert step.keys() == expected_step.keys()
            assert all(abs(step[t].logprob - expected_step[t].logprob) < 1e-4 for t in step)


def test_shutdown_leaves_nothing_behind(llama_dir):
    shm_before = shm_entries()
    # another program's shared memory, made meanwhile, is not this engine's leak
    other = subprocess.Popen([sys.executable, "-c", "from multiprocessing.shared_memory import SharedMemory; "
                              "s = SharedMemory(create=True, size=64); print(s.name, flush=True); input()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert other.stdout.readline().strip() in os.listdir("/dev/shm")
    llm = LLM(llama_dir, tensor_parallel_size=2)
    pids = [w.pid for w in llm.llm_engine.model_executor.workers]
    llm.generate(random_prompts([7]), GREEDY, use_tqdm=False)
    llm.shutdown()
    assert_all_stopped(pids, shm_before)
    other.communicate("\n", timeout=30)   # (it ends, and its segment goes)
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(random_prompts([7]), GREEDY, use_tqdm=False)
    llm.shutdown()   # again: nothing to do


@pytest.mark.parametrize("rank", [0, 1])
def test_killed_worker_raises_within_seconds(llama_dir, rank):
    shm_before = shm_entries()
    llm = LLM(llama_dir, tensor_parallel_size=2)
    workers = llm.llm_engine.model_executor.workers
    worker = workers[rank]
    killed = []
    threading.Timer(1.0, lambda: (killed.append(time.monotonic()), os.kill(worker.pid, signal.SIGKILL))).start()
    with pytest.raises(WorkerDiedError, match=rf"nanoinfer-tp{rank} .* exit code -9"):
        llm.generate(random_prompts([9] * 4), SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - killed[0] < 5
    with pytest.raises(EngineDeadError, match="exit code -9"):
        llm.generate(random_prompts([7]), GREEDY, use_tqdm=False)
    llm.shutdown()
    assert_all_stopped([w.pid for w in workers], shm_before)


def test_worker_that_raises_reports_why(llama_dir):
    shm_before = shm_entries()
    llm = LLM(llama_dir, tensor_parallel_size=2)
    executor = llm.llm_engine.model_executor
    executor.queue.enqueue(("no_such_method", ()), executor.check_health)   # every rank raises
    with pytest.raises(WorkerDiedError, match=r"(?s)exit code 1.*rank \d: .*AttributeError.*no_such_method"):
        llm.generate(random_prompts([9]), GREEDY, use_tqdm=False)
    llm.shutdown()
    assert_all_stopped([w.pid for w in executor.workers], shm_before)


def test_ctrl_c_stops_the_workers(llama_dir):
    shm_before = shm_entries()
    llm = LLM(llama_dir, tensor_parallel_size=2)
    executor = llm.llm_engine.model_executor
    pids = [w.pid for w in executor.workers]
    steps = []

    def interrupted(*args):   # Ctrl-C arrives as the engine sends the third step
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return execute_model(*args)
    execute_model, executor.execute_model = executor.execute_model, interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts([9] * 2), SamplingParams(max_tokens=20), use_tqdm=False)
    assert_all_stopped(pids, shm_before)
    with pytest.raises(EngineDeadError):
        llm.generate(random_prompts([7]), GREEDY, use_tqdm=False)


def test_engines_side_by_side(llama_dir):
    """A one-rank engine and a second two-rank one next to a two-rank one; dropping an engine stops
    its workers; a bad setting found by the ranks is the engine's ValueError."""
    shm_before = shm_entries()
    two = LLM(llama_dir, tensor_parallel_size=2)
    pids = [w.pid for w in two.llm_engine.model_executor.workers]
    expected = two.generate(random_prompts([11]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    one = LLM(llama_dir)
    assert one.generate(random_prompts([11]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    other = LLM(llama_dir, tensor_parallel_size=2)
    assert other.generate(random_prompts([11]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    other.shutdown()
    assert two.generate(random_prompts([11]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    del two
    gc.collect()
    assert_all_stopped(pids, shm_before)
    with pytest.raises(ValueError, match="the KV cache holds 16 tokens"):
        LLM(llama_dir, tensor_parallel_size=2, num_kvcache_blocks=1, max_model_len=128)
    assert_all_stopped([], shm_before)


def test_sizes_that_do_not_split(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads=4"):
        LLM(llama_dir, tensor_parallel_size=3)
    assert not mp.active_children()   # refused before any process started
    config = Config(llama_dir, device="cpu")
    config.hf_config.num_attention_heads, config.hf_config.num_key_value_heads = 12, 3
    config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2 neither divides nor is a multiple of the "
                                         "model's num_key_value_heads=3"):
        config.check_model_parallel()


def read_all(queue: MessageQueue, out) -> None:
    queue.as_reader(0)
    for _ in range(3):
        out.put(queue.dequeue(check=lambda: None))
    queue.close()


def test_message_queue_carries_messages_longer_than_its_ring():
    ctx = mp.get_context("spawn")
    queue, out = MessageQueue(num_readers=1, slot_bytes=256, num_slots=2), ctx.SimpleQueue()
    reader = ctx.Process(target=read_all, args=(queue, out))
    reader.start()
    messages = [("execute_model", list(range(5000))), ("sample_tokens", ()), ("x", "y" * 1000)]
    for message in messages:
        queue.enqueue(message, check=lambda: None)
    assert [out.get() for _ in messages] == messages
    reader.join()
    queue.close()


def test_speculative_decoding_under_tensor_parallelism(llama_dir, tmp_path):
    """Drafts scored on both ranks, verified on the first (Medusa's heads there too, EAGLE's layer
    split over both): the same tokens as one rank without speculation, greedy and seeded."""
    medusa = write_medusa_head(str(tmp_path / "medusa"), 64, VOCAB_SIZE, 3)
    prompts = [[9, 8, 7, 6] * 6] + random_prompts([17, 40], seed=12)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True), GREEDY]
    want = [o.outputs[0].token_ids for o in LLM(llama_dir, max_model_len=128).generate(prompts, params, use_tqdm=False)]
    eagle = write_eagle_head(str(tmp_path / "eagle"), llama_dir)
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                 {"method": "medusa", "num_speculative_tokens": 3, "model": medusa},
                 {"method": "eagle", "num_speculative_tokens": 2, "model": eagle}):
        llm = LLM(llama_dir, tensor_parallel_size=2, max_model_len=128, speculative_config=spec)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
        assert got == want, spec["method"]
        assert llm.llm_engine.scheduler.spec_stats.num_draft_tokens > 0
