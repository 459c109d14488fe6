"""AsyncLLM over engine-core processes: streamed outputs equal the offline engine's, aborts free
blocks, bad requests fail alone, data parallelism spreads the load, a dead core is an error."""
import asyncio
import threading
import time

import pytest
from conftest import random_prompts

from nanoinfer import LLM, RequestOutputKind, SamplingParams
from nanoinfer.engine.async_llm import AsyncLLM
from nanoinfer.utils import core_gpus
from nanoinfer.engine.exceptions import EngineDeadError
from nanoinfer.engine.output_processor import RequestState

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


@pytest.fixture(scope="module")
def engine(llama_dir):
    engine = AsyncLLM(llama_dir, data_parallel_size=2, max_model_len=256)
    yield engine
    engine.shutdown()
    assert not any(proc.is_alive() for proc in engine.client.procs)


async def stream(engine, prompt, params, request_id) -> list[int]:
    token_ids = []
    async for out in engine.generate(prompt, params, request_id):
        token_ids += out.outputs[0].token_ids
    return token_ids


def test_streams_equal_the_offline_engine_over_two_cores(engine, llama_dir):
    prompts = random_prompts([5 + 3 * i for i in range(16)], seed=4)

    async def run():
        return await asyncio.gather(*[stream(engine, p, GREEDY, f"s{i}") for i, p in enumerate(prompts)])
    got = asyncio.run(run())
    want = LLM(llama_dir, max_model_len=256).generate(prompts, GREEDY, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in want]
    assert all(stats.prefix_cache_queries > 0 for stats in engine.client.stats)   # both cores had requests


def wait_until_idle(engine) -> list:
    for _ in range(100):
        stats = engine.client.stats
        if all(s.num_running == s.num_waiting == 0 and s.kv_cache_usage == 0 for s in stats):
            return stats
        time.sleep(0.05)
    return engine.client.stats


def test_a_cancelled_stream_is_aborted_and_frees_its_blocks(engine):
    """A client that disconnects: the server cancels the task reading its stream."""
    long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run():
        started = asyncio.Event()

        async def read():
            async for _ in engine.generate([7] * 40, long, "leaver"):
                started.set()
        task = asyncio.create_task(read())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.output_processor.requests == {} and engine.streams == {}
    asyncio.run(run())
    assert all(s.kv_cache_usage == 0 and s.num_running == 0 for s in wait_until_idle(engine))


def test_a_bad_request_fails_alone(engine):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await stream(engine, [5] * 300, GREEDY, "too-long")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await stream(engine, [10**9], GREEDY, "bad-id")
        return await stream(engine, [5, 6, 7], GREEDY, "fine")
    assert len(asyncio.run(run())) == 24


@pytest.mark.parametrize("where", ["a step", "a final output"])
def test_an_error_in_the_front_end_fails_the_requests_it_touched(engine, monkeypatch, where):
    broken_once = []
    if where == "a step":   # before any of the step's outputs is processed
        real = engine.output_processor.process_outputs

        def broken(core_outputs, *stats):
            if core_outputs and not broken_once:
                broken_once.append(True)
                raise RuntimeError("a bug in the front end")
            return real(core_outputs, *stats)
        monkeypatch.setattr(engine.output_processor, "process_outputs", broken)
    else:   # half-way: the finished request is already forgotten when it raises
        real = RequestState.make_output

        def broken(self, finished):
            if finished and not broken_once:
                broken_once.append(True)
                raise RuntimeError("a bug in the front end")
            return real(self, finished)
        monkeypatch.setattr(RequestState, "make_output", broken)

    async def run():
        with pytest.raises(RuntimeError, match="a bug"):
            await asyncio.wait_for(stream(engine, [5, 6, 7], GREEDY, "victim"), 30)
        return await stream(engine, [5, 6, 7], GREEDY, "after")
    assert len(asyncio.run(run())) == 24   # the engine serves on
    assert engine.output_processor.requests == {} and engine.streams == {}
    assert all(s.kv_cache_usage == 0 and s.num_running == 0 for s in wait_until_idle(engine))


def test_abort_ends_the_stream(engine):
    long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run():
        outs = []
        async for out in engine.generate([7] * 20, long, "to-abort"):
            outs.append(out)
            if len(outs) == 1:
                engine.abort("to-abort")
        return outs
    outs = asyncio.run(asyncio.wait_for(run(), 30))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 200
    assert all(s.kv_cache_usage == 0 and s.num_running == 0 for s in wait_until_idle(engine))


def test_a_core_that_stops_reading_holds_up_no_other(engine):
    """Core 0's socket blocks (as when a core hangs): core 1's requests still finish meanwhile."""
    conn, gate, done_while_closed = engine.client.conns[0], threading.Event(), []
    send, send_bytes = conn.send, conn.send_bytes
    conn.send = lambda message: (gate.wait(60), send(message))
    conn.send_bytes = lambda data: (gate.wait(60), send_bytes(data))
    try:
        async def one(i):
            tokens = await stream(engine, [5, 6, 7 + i], GREEDY, f"blocked-{i}")
            done_while_closed.append(not gate.is_set())
            gate.set()   # one finished: enough
            return tokens

        async def run():
            threading.Timer(30, gate.set).start()   # (else, from a thread: the event loop may be stuck)
            return await asyncio.gather(*[one(i) for i in range(4)])   # spread over both cores
        assert [len(t) for t in asyncio.run(run())] == [24] * 4
    finally:
        conn.send, conn.send_bytes = send, send_bytes
        gate.set()
    assert any(done_while_closed)   # core 1's, before core 0's socket opened again


def test_data_parallel_size_must_be_positive(llama_dir):
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        AsyncLLM(llama_dir, data_parallel_size=0, max_model_len=256)


def test_each_core_gets_its_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7,9")
    assert core_gpus(2, 2) == ["3,5", "7,9"] and core_gpus(3, 1) == ["3", "5", "7"]
    with pytest.raises(ValueError, match="needs 6 GPUs, 4 are visible"):
        core_gpus(3, 2)   # (2: tensor x pipeline parallel ranks per core)


def test_merged_delta_outputs_are_the_outputs_in_one(engine):
    """A consumer that falls behind gets the DELTA outputs that piled up as one."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1,
                            output_kind=RequestOutputKind.DELTA)

    async def run(slow: bool):
        outs = []
        async for out in engine.generate([5, 6, 7, 8], params, f"slow-{slow}"):
            outs.append(out)
            if slow:
                await asyncio.sleep(0.2)   # meanwhile several steps finish
        return outs
    fast, slow = asyncio.run(run(False)), asyncio.run(run(True))
    assert len(slow) < len(fast) and slow[-1].finished
    joined = [[t for out in outs for t in out.outputs[0].token_ids] for outs in (fast, slow)]
    assert joined[0] == joined[1] and len(joined[0]) == 24
    logprobs = [[lp for out in outs for lp in out.outputs[0].logprobs] for outs in (fast, slow)]
    assert [list(e) for e in logprobs[0]] == [list(e) for e in logprobs[1]]
    assert slow[-1].outputs[0].finish_reason == fast[-1].outputs[0].finish_reason == "length"


def test_a_killed_core_is_an_error_not_a_hang(llama_dir):
    engine = AsyncLLM(llama_dir, max_model_len=512)
    try:
        async def run():
            params = SamplingParams(max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            outputs = engine.generate([5, 6, 7], params, "victim")
            await outputs.__anext__()   # it runs
            engine.client.procs[0].kill()

            async def drain():   # (the outputs it sent before it died come first)
                async for _ in outputs:
                    pass
            with pytest.raises(EngineDeadError, match="engine core 0 died") as first:
                await asyncio.wait_for(drain(), 30)
            with pytest.raises(EngineDeadError) as second:
                await stream(engine, [5, 6], GREEDY, "again")
            assert first.value is not second.value   # (each its own, with a traceback of its own)
            with pytest.raises(EngineDeadError):
                await stream(engine, [5, 6], GREEDY, "after")
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_shutdown_ends_live_requests_with_an_error(llama_dir):
    engine = AsyncLLM(llama_dir, max_model_len=512)

    async def run():
        params = SamplingParams(max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        outputs = engine.generate([5, 6, 7], params, "live")
        await outputs.__anext__()
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(outputs.__anext__(), 30)
        with pytest.raises(EngineDeadError):
            await stream(engine, [5, 6], GREEDY, "after")
        assert engine.output_processor.requests == {} and engine.streams == {}
    asyncio.run(run())
    assert not any(proc.is_alive() for proc in engine.client.procs)
