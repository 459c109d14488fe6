"""The OpenAI-compatible server, through real sockets on 127.0.0.1 and the official client."""
import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from unittest import mock

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from conftest import random_prompts

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

from nanoinfer import LLM, SamplingParams  # noqa: E402
from nanoinfer.utils import engine_num_threads  # noqa: E402

KEY = "secret-key"


def start_server(model: str, *args: str, stdout=None, new_session: bool = False, stderr=None
                 ) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nanoinfer.serve", "--model", model, "--port", str(port),
                             "--served-model-name", "tiny", "--max-model-len", "512", *args], stdout=stdout,
                            stderr=stderr, start_new_session=new_session)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
        assert proc.poll() is None, "the server exited"
    raise TimeoutError("the server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    cores = core_pids(proc.pid)
    proc.send_signal(signal.SIGINT)
    proc.wait(30)
    for pid in cores:   # none outlives the server
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def core_pids(pid: int) -> list[int]:
    """The server's engine-core processes."""
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [int(c) for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]


@pytest.fixture(scope="module")
def server(llama_dir):
    proc, url = start_server(llama_dir, "--api-key", KEY, "--data-parallel-size", "2")
    yield url
    stop_server(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY)


def metrics(url: str) -> dict[str, float]:
    """{'name{engine="r"}': value} (the model_name label left out)."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.replace('model_name="tiny",', "").replace(',model_name="tiny"', "")] = float(value)
    return out


def test_completions_and_chat_streamed_equal_not_streamed(client):
    for chat in (False, True):
        kwargs = dict(model="tiny", max_tokens=12, temperature=0)
        if chat:
            whole = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kwargs)
            parts = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], stream=True,
                                                   stream_options={"include_usage": True}, **kwargs)
            text, streamed = whole.choices[0].message.content, []
            for chunk in parts:
                streamed += [c.delta.content or "" for c in chunk.choices]
        else:
            whole = client.completions.create(prompt="hello there", **kwargs)
            parts = client.completions.create(prompt="hello there", stream=True,
                                              stream_options={"include_usage": True}, **kwargs)
            text, streamed = whole.choices[0].text, []
            for chunk in parts:
                streamed += [c.text for c in chunk.choices]
        assert "".join(streamed) == text and whole.usage.completion_tokens == 12
        assert chunk.usage.completion_tokens == 12 and chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_sampling_fields(client):
    a, b = (client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=8, temperature=1, seed=11)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text   # seeded
    out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and len(lp.top_logprobs) == 5   # (top: keyed by text, which may repeat)
    assert all(max(t.values()) >= lp_ for t, lp_ in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          logprobs=True, top_logprobs=3, temperature=0)
    assert [len(t.top_logprobs) for t in chat.choices[0].logprobs.content] == [3] * 4
    for token in chat.choices[0].logprobs.content:   # the most likely first
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
    long = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=30, temperature=0)
    stop = long.choices[0].text[5:8]
    cut = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text


def test_json_schema_response_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"]}
    for seed in range(3):
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "json"}], max_tokens=60, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        if out.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_64_concurrent_streams_equal_offline(server, llama_dir):
    prompts = random_prompts([4 + i % 30 for i in range(64)], seed=8)
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY)

    async def one(prompt):
        text = ""
        async for chunk in await client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                                           temperature=0, stream=True):
            text += chunk.choices[0].text
        return text

    async def run():
        return await asyncio.gather(*[one(p) for p in prompts])
    got = asyncio.run(run())
    want = LLM(llama_dir, max_model_len=256).generate(prompts, SamplingParams(temperature=0, max_tokens=16),
                                                      use_tqdm=False)
    assert got == [o.outputs[0].text for o in want]
    m = metrics(server)
    assert all(m[f'vllm:prefix_cache_queries_total{{engine="{r}"}}'] > 0 for r in (0, 1))   # both cores


@pytest.mark.parametrize("stream", [True, False])
def test_a_disconnect_aborts_the_request_and_frees_its_blocks(server, stream):
    def num_aborted() -> float:
        return sum(metrics(server)[f'nanoinfer:aborted_seqs_total{{engine="{r}"}}'] for r in (0, 1))
    before, headers = num_aborted(), {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": [5] * 10, "max_tokens": 490, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", server + "/v1/completions", json=body, headers=headers) as response:
            next(response.iter_lines())   # a token came: now go away
    else:
        with pytest.raises(httpx.ReadTimeout):   # it waits for the whole answer: go away meanwhile
            httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(30, read=0.1))
    for _ in range(200):
        if num_aborted() > before:
            break
        time.sleep(0.05)
    m = metrics(server)
    assert num_aborted() == before + 1   # ended by the abort, not by running to its end
    assert all(m[f'vllm:num_requests_running{{engine="{r}"}}'] == 0 for r in (0, 1))
    assert all(m[f'vllm:kv_cache_usage_perc{{engine="{r}"}}'] == 0 for r in (0, 1))


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": [5] * 600}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": "x"}}, 400, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"anyOf": 5}}}}, 400,
     "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "string", "maxLength": 2.5}}}}, 400, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": functools.reduce(
        lambda s, _: {"type": "array", "items": s}, range(30), {"type": "integer"})}}}, 400,
        "response_format"),   # (2^30 big)
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {   # too many DFA states
        "schema": {"type": "string", "pattern": "(a|b)*a(a|b){15}"}}}}, 400, "response_format"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(server + "/v1/completions", content=content, headers=headers)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["param"] == param and error["type"]
    ok = httpx.post(server + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, headers=headers)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3   # still serving


def test_the_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for route in ("/v1/completions", "/v1/chat/completions"):
            response = httpx.post(server + route, json={"prompt": "x"}, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server + "/v1/models", headers=headers).status_code == 401
        bad_body = httpx.post(server + "/v1/completions", content="{not json", headers=headers)
        assert bad_body.status_code == 401   # the key is checked first
    assert httpx.get(server + "/health").status_code == 200   # not a /v1 route


def test_an_unknown_route_gets_an_openai_error(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.get(server + "/v1/nothing-here", headers=headers)
    assert response.status_code == 404 and response.json()["error"]["code"] == 404
    response = httpx.get(server + "/v1/completions", headers=headers)
    assert response.status_code == 405 and response.headers["allow"] == "POST"


def test_chat_top_logprobs_need_logprobs(server):
    body = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    response = httpx.post(server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


def descendants(pid: int) -> dict[int, str]:
    """The processes under `pid`, children of each of their threads, recursively: pid -> its start
    time (so that a later process with the same pid is not taken for it)."""
    found, parents = {}, [pid]
    while parents:
        parent = parents.pop()
        with contextlib.suppress(FileNotFoundError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with contextlib.suppress(FileNotFoundError):
                    for child in map(int, open(f"/proc/{parent}/task/{task}/children").read().split()):
                        with contextlib.suppress(FileNotFoundError):
                            found[child] = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[19]
                            parents.append(child)
    return found


def running(pid: int, start_time: str) -> bool:
    """Whether that process still runs (a zombie has exited)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    if fields[0] in "ZX" or fields[19] != start_time:
        return False
    # A process whose exit the kernel is still tearing down (its memory gone) has no command line.
    with contextlib.suppress(FileNotFoundError):
        return open(f"/proc/{pid}/cmdline", "rb").read() != b""
    return False


def shared_memory(pids) -> set[str]:
    """The files of /dev/shm that these processes map: SharedMemory segments (psm_*) and named
    semaphores (sem.mp-*)."""
    names = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for line in open(f"/proc/{pid}/maps"):
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith("/dev/shm/"):
                    names.add(path[0].strip().removesuffix(" (deleted)").removeprefix("/dev/shm/"))
    return names


def command(pid: int) -> str:
    with contextlib.suppress(FileNotFoundError):
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    return "(gone)"


def is_tracker(pid: int) -> bool:
    with contextlib.suppress(FileNotFoundError):
        return b"resource_tracker" in open(f"/proc/{pid}/cmdline", "rb").read()
    return False


def check_all_gone(tree: dict[int, str], segments: set[str]) -> None:
    """Right after the server's exit, none of the processes it started runs, multiprocessing's
    resource tracker (which removes what shared memory is left) included, and no shared-memory
    segment of theirs is left."""
    left = [pid for pid, t in tree.items() if running(pid, t)]
    assert left == [], ["processes outlived the server:", *map(command, left)]
    assert segments & set(os.listdir("/dev/shm")) == set(), "shared memory outlived the server"


def kill_all(proc: subprocess.Popen, tree: dict[int, str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    for pid, t in tree.items():
        if running(pid, t):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("parallel, sig", [
    ("--data-parallel-size", signal.SIGTERM), ("--tensor-parallel-size", signal.SIGTERM),
    ("--tensor-parallel-size", signal.SIGINT),
    ("--data-parallel-size", "SIGTERM to the process group")])
def test_a_signal_stops_everything_the_server_started(llama_dir, tmp_path, parallel, sig,
                                                      monkeypatch):
    """SIGTERM or Ctrl-C (or SIGTERM to the whole process group, as a service manager sends it)
    with a long stream in flight: the stream goes on for the shutdown timeout, then the server
    aborts it itself, so the client gets a last chunk (finish_reason "abort") and [DONE], and
    nothing is cancelled under uvicorn (no traceback, no error in the log); the server exits with
    status 0 within that timeout and 2 s, and when its status is seen no process it started
    (engine cores, tensor-parallel workers, multiprocessing's resource tracker) runs and no shared
    memory is left. (Its start-up also says, in one line, where it serves what.)"""
    timeout, before = 2, set(os.listdir("/dev/shm"))
    # A stream longer than the timeout: 4,000 tokens (past the tiny model's 512 positions, which
    # does not matter here).
    monkeypatch.setenv("NANOINFER_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc, url = start_server(llama_dir, parallel, "2", "--shutdown-timeout", str(timeout),
                                 "--max-model-len", "4096", stdout=out, stderr=err,
                                 new_session=isinstance(sig, str))
    ready = (tmp_path / "stdout").read_text()
    assert f"serving 'tiny' at {url}/v1 (max_model_len=4096" in ready, ready
    started = threading.Event()
    result = {}

    def read():
        body = {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20) as response:
                for line in response.iter_lines():
                    if line:
                        result["before last"], result["last"] = result.get("last"), line
                    started.set()
            result["end"] = "finished" if result.get("last") == "data: [DONE]" else "closed"
        except httpx.ReadTimeout:
            result["end"] = "hung"
        except httpx.TransportError:
            result["end"] = "closed"
        result["ended"] = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    tree = {}
    try:
        assert started.wait(60), "the stream did not start"
        tree = descendants(proc.pid)
        assert len(tree) >= 3 and any(map(is_tracker, tree)), tree   # and two cores, or a core
        # and its two workers
        segments = shared_memory([proc.pid, *tree]) - before
        assert segments or parallel == "--data-parallel-size"   # the workers' message queues
        signalled = time.monotonic()
        if isinstance(sig, str):
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(sig)
        try:
            proc.wait(timeout + 2)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {timeout + 2} s of {sig!r}")
        check_all_gone(tree, segments)
        assert proc.returncode == 0
        reader.join(15)
        assert not reader.is_alive() and result.get("end") == "finished", result
        last = json.loads(result["before last"].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "abort", last
        log = (tmp_path / "stderr").read_text()
        assert "Traceback" not in log and "ERROR" not in log and "Error" not in log, log
        # It had the shutdown timeout to finish.
        assert result["ended"] - signalled > timeout - 0.5, result["ended"] - signalled
    finally:
        kill_all(proc, tree)


def test_a_signal_while_starting_stops_what_started(llama_dir):
    """SIGTERM while the engine loads: the server stops at once, status 0, and what it started
    goes too: a process that was still starting (importing torch, seconds on a busy machine)
    leaves as soon as it runs, finding its parent gone (utils.child_process)."""
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, "-m", "nanoinfer.serve", "--model", llama_dir,
                             "--port", "0", "--tensor-parallel-size", "2"])
    tree = {}
    try:
        for _ in range(600):   # until its engine core is there
            tree |= descendants(proc.pid)
            if any(b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read() for pid in tree
                   if running(pid, tree[pid])):
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        for _ in range(300):   # (15 s at most)
            if not any(running(pid, t) for pid, t in tree.items()):
                break
            time.sleep(0.05)
        check_all_gone(tree, set(os.listdir("/dev/shm")) - before)
        assert proc.returncode == 0
    finally:
        kill_all(proc, tree)


@given(cores=st.integers(1, 512), procs=st.integers(1, 64))
def test_engine_processes_share_the_cores_without_oversubscribing_them(cores, procs):
    """On the CPU, each of `procs` processes takes one thread at least, and together they take at
    most the cores there are less one (when there are enough) and leave fewer than `procs` more
    of them idle.
    On a GPU each takes one."""
    with mock.patch("os.sched_getaffinity", return_value=set(range(cores)), create=True):
        share = engine_num_threads("cpu", procs)
        assert engine_num_threads("cuda", procs) == 1
    assert share >= 1
    if procs < cores:   # (one core is left to the process that drives them)
        assert cores - 1 - procs < share * procs <= cores - 1
    else:
        assert share == 1


def environ(pid: int) -> dict[str, str]:
    return dict(entry.split("=", 1) for entry in open(f"/proc/{pid}/environ").read().split("\0") if "=" in entry)


@pytest.mark.parametrize("parallel", ["--data-parallel-size", "--tensor-parallel-size"])
def test_the_front_end_takes_one_thread_and_each_engine_process_its_share(llama_dir, monkeypatch, parallel):
    """vLLM's rule on the CPU: the server's own process runs no model and takes one intra-op thread;
    the processes that do (two cores, or a core's two workers) share the other cores equally
    (through OMP_NUM_THREADS, which torch reads as it starts)."""
    uvicorn = pytest.importorskip("uvicorn")
    from nanoinfer.serve import main
    seen = {}

    def run(server):   # instead of serving: what each process got
        server.started = True
        seen["front end"] = torch.get_num_threads()
        seen["engine"] = [environ(pid).get("OMP_NUM_THREADS") for pid in descendants(os.getpid())
                          if pid not in before and b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before, threads = descendants(os.getpid()), torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    torch.set_num_threads(2)   # (as torch starts on two cores: the tests' own setting is one)
    # Nine cores, as the server sees them: the two processes that run the model take four each.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(9)))
    try:
        main(["--model", llama_dir, "--max-model-len", "256", parallel, "2"])
    finally:
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert seen["front end"] == 1
    assert seen["engine"] == ["4"] * (2 if parallel == "--data-parallel-size" else 3)   # (and the core)


def test_a_killed_core_fails_its_requests_only(llama_dir):
    proc, url = start_server(llama_dir, "--data-parallel-size", "2", "--skip-tokenizer-init")
    try:
        for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/completions", {"prompt": "text"})):   # no tokenizer: a clear 400
            response = httpx.post(url + route, json=body)
            assert response.status_code == 400 and "tokenizer" in response.json()["error"]["message"]
        echo = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "echo": True})
        assert echo.status_code == 200   # (no text to echo without a tokenizer)
        body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}

        async def one(client, started: asyncio.Event):
            lines = []
            async with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                async for line in response.aiter_lines():
                    lines += [line] if line else []
                    started.set()
            return lines

        async def run():
            async with httpx.AsyncClient() as client:
                started = [asyncio.Event() for _ in range(4)]
                tasks = [asyncio.create_task(one(client, event)) for event in started]
                await asyncio.wait_for(asyncio.gather(*[event.wait() for event in started]), 60)
                os.kill(core_pids(proc.pid)[0], signal.SIGKILL)   # every request is streaming
                return await asyncio.wait_for(asyncio.gather(*tasks), 120)
        streams = asyncio.run(run())
        assert all(s[-1] == "data: [DONE]" for s in streams)
        failed = [s for s in streams if '"error"' in s[-2]]
        assert failed and "engine core" in failed[0][-2] and "Traceback" not in failed[0][-2]
        assert httpx.get(url + "/health").status_code == 200   # the other core serves on
        ok = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
        assert ok.status_code == 200
    finally:
        stop_server(proc)


def test_disaggregated_prefill_and_decode(llama_dir, tmp_path):
    """A prefill server leaves each prompt's blocks in a folder, a decode server loads them: through
    the proxy, the answers are the colocated engine's, and the decode computed only the last block."""
    def transfer(role: str) -> str:
        return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                           "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    prefill, prefill_url = start_server(llama_dir, "--kv-transfer-config", transfer("kv_producer"))
    decode, decode_url = start_server(llama_dir, "--kv-transfer-config", transfer("kv_consumer"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = subprocess.Popen([sys.executable, "-m", "nanoinfer.entrypoints.disagg_proxy", "--prefill", prefill_url,
                              "--decode", decode_url, "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        prompts = random_prompts([40, 57], seed=21)
        whole = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=12, temperature=0)
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompts[1], max_tokens=12, temperature=0, stream=True) if c.choices)
        want = LLM(llama_dir, max_model_len=512).generate(prompts, SamplingParams(temperature=0, max_tokens=12),
                                                          use_tqdm=False)
        assert [whole.choices[0].text, text] == [o.outputs[0].text for o in want]
        assert whole.usage.prompt_tokens_details.cached_tokens == 32   # loaded: all but the last partial block
        bad = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5] * 600})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"   # (the prefill server's)
    finally:
        proxy.send_signal(signal.SIGINT)
        proxy.wait(30)
        stop_server(prefill)
        stop_server(decode)
