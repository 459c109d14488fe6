"""Two nodes on one machine: the head (`LLM(..., nnodes=2, node_rank=0)` or a server) and a second
node started as `python -m nanoinfer.serve ... --node-rank 1 --headless`, a process tree of its own
that knows of the head only its address, port and key, over gloo on 127.0.0.1.

Greedy tokens equal transformers' (and one process's) with one pipeline stage on each node, and
with two tensor-parallel ranks in each stage; the other node's ranks read their calls from their
own node's shared memory, not the head's; the headless node exits, leaving no process behind, when
the head shuts down and when the head goes away; a layout that would put a tensor-parallel group
across nodes is refused with a message that says why; when the other node dies, the head's
requests fail with an error instead of waiting forever, and a server's stream ends with the error
and its /health turns 503; the head refuses a wrong key, stray clients and a node that runs
another dtype or layout, naming the difference, and goes on waiting; a node started before its
head waits for it, saying for what, and gives up after the start timeout. Data-parallel cores on
another node serve behind the head's load balancer, and one lost fails its own requests only.
Where the test may make namespaces, the second node runs in a network and mount namespace of its
own, and a cut wire (a partition: nothing closes) fails the head's requests within the timeout.
"""
import concurrent.futures
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from conftest import hf_greedy, random_prompts, save_model
from nanoinfer import LLM, SamplingParams
from nanoinfer.config import Config
from nanoinfer.engine.async_llm import AsyncLLM
from nanoinfer.executor.node_link import accept, join
from nanoinfer.executor.multiproc_executor import WorkerDiedError
from nanoinfer.serve import parse_args

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def cluster_key(monkeypatch):
    """Every node's secret (the headless nodes inherit the environment), and short timeouts."""
    monkeypatch.setenv("NANOINFER_CLUSTER_KEY", "test-secret")
    monkeypatch.setenv("NANOINFER_NODE_TIMEOUT", "4")


@pytest.fixture(scope="module")
def three_layer_dir(tmp_path_factory) -> str:
    return save_model("qwen2", str(tmp_path_factory.mktemp("qwen2") / "m"), num_hidden_layers=3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(path: str, tp: int, port: int, *args: str, key: str = "test-secret",
               env: dict | None = None, **popen) -> subprocess.Popen:
    """`serve --headless` as node 1 of 2, with one pipeline stage of `tp` ranks."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), NANOINFER_CLUSTER_KEY=key, **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "nanoinfer.serve", "--model", path,
                             "--device", "cpu", "--tensor-parallel-size", str(tp),
                             "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port),
                             "--headless", *args], env=env, **popen)


def start_nodes(path: str, tp: int) -> tuple[LLM, subprocess.Popen]:
    """The headless node first (it waits for the head), then the head."""
    port = free_port()
    node = start_node(path, tp, port)
    try:
        llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=2, nnodes=2, node_rank=0,
                  master_addr="127.0.0.1", master_port=port)
    except BaseException:
        node.kill()
        raise
    return llm, node


def assert_exits_with_its_processes(node: subprocess.Popen, expected_status: int) -> None:
    tree = psutil.Process(node.pid).children(recursive=True)
    assert node.wait(timeout=30) == expected_status
    deadline = time.monotonic() + 10
    while alive := [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"left behind: {alive}"
        time.sleep(0.2)


def maps_of(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [1, 2])
def test_two_nodes_match_transformers_and_one_process(three_layer_dir, tp):
    prompts = random_prompts([5, 23, 40], seed=1)
    llm, node = start_nodes(three_layer_dir, tp)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        ring = llm.llm_engine.model_executor.queue.shm.name
        head_ranks = [w.pid for w in llm.llm_engine.model_executor.workers]
        remote_ranks = [p.pid for p in psutil.Process(node.pid).children()
                        if any("spawn_main" in part for part in p.cmdline())]
        assert len(head_ranks) == len(remote_ranks) == tp
        assert all(ring in maps_of(pid) for pid in head_ranks)
        assert not any(ring in maps_of(pid) for pid in remote_ranks)
        llm.shutdown()
        assert_exits_with_its_processes(node, 0)
    finally:
        node.kill()
    one = LLM(three_layer_dir)
    try:
        expected = one.generate(prompts, GREEDY, use_tqdm=False)
        assert got == [o.outputs[0].token_ids for o in expected]
    finally:
        one.shutdown()
    assert got == [hf_greedy(three_layer_dir, p, 12) for p in prompts]


@pytest.mark.timeout(180)
def test_headless_node_exits_when_the_head_dies(three_layer_dir):
    llm, node = start_nodes(three_layer_dir, 1)
    try:
        llm.generate(random_prompts([7]), GREEDY, use_tqdm=False)
        llm.llm_engine.model_executor.shutdown(graceful=False)   # the head's ranks killed
        assert_exits_with_its_processes(node, 1)
    finally:
        node.kill()
        llm.shutdown()


@pytest.mark.timeout(180)
def test_requests_fail_when_the_other_node_dies(three_layer_dir):
    """Never a hang: the head finds the node's link closed, stops its own ranks, and the engine's
    next wait raises. (A node cut off from the network: test_partitioned_node.)"""
    llm, node = start_nodes(three_layer_dir, 1)
    tree = [node, *psutil.Process(node.pid).children(recursive=True)]
    try:
        llm.generate(random_prompts([7]), GREEDY, use_tqdm=False)
        for proc in tree:
            proc.kill()
        with pytest.raises(WorkerDiedError, match="node 1 was lost: .*(reset|closed)"):
            llm.generate(random_prompts([7]), GREEDY, use_tqdm=False)
    finally:
        for proc in tree:
            proc.kill()
        llm.shutdown()


@pytest.mark.timeout(120)
def test_head_refuses_wrong_key_stray_clients_and_another_dtype(three_layer_dir, caplog,
                                                                monkeypatch):
    """Each is refused and logged; the head goes on waiting and admits the right node."""
    monkeypatch.setenv("NANOINFER_NODE_TIMEOUT", "2")
    port = free_port()
    nodes = {"pipeline_parallel_size": 2, "nnodes": 2, "master_port": port, "device": "cpu"}
    head = Config(three_layer_dir, **nodes)
    admitted = []
    address = ("127.0.0.1", port + 1)
    thread = threading.Thread(daemon=True, target=lambda: admitted.extend(
        accept(head, address, "node", range(1, 2))))
    with caplog.at_level(logging.WARNING, logger="nanoinfer"):
        thread.start()
        wrong = start_node(three_layer_dir, 1, port, key="another-secret",
                           stderr=subprocess.PIPE, text=True)
        assert wrong.wait(60) == 1
        assert "the head holds another NANOINFER_CLUSTER_KEY" in wrong.stderr.read()
        for garbage in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4, b""):   # (b"": silent)
            with socket.create_connection(("127.0.0.1", port + 1)) as stray:
                stray.sendall(garbage)
                assert stray.recv(1024)   # the head's challenge; then it hangs up
                stray.settimeout(10)
                with contextlib.suppress(ConnectionResetError):   # (it left data unread)
                    while stray.recv(1024):
                        pass
        node = {**nodes, "node_rank": 1}
        with pytest.raises(ValueError, match="the head refused node 1: it differs from the head "
                           "in dtype: the head's is torch.float32, this node's torch.bfloat16"):
            join(Config(three_layer_dir, dtype="bfloat16", **node), ("127.0.0.1", port + 1), 1,
                 "node")
        with pytest.raises(ValueError, match=r"in \(tensor, pipeline, nodes\): the head's is "
                           r"\(1, 2, 2\), this node's \(2, 2, 2\)"):
            join(Config(three_layer_dir, tensor_parallel_size=2, **node), ("127.0.0.1", port + 1),
                 1, "node")
        link, config = join(Config(three_layer_dir, **node), ("127.0.0.1", port + 1), 1, "node")
        thread.join(10)
    assert len(admitted) == 1 and config.node_rank == 1
    assert config.max_model_len == head.max_model_len   # (the head's configuration)
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 5 and "dtype: the head's is torch.float32" in refusals[-2], refusals
    assert all("from 127.0.0.1" in r for r in refusals)
    link.close()
    admitted[0].close()


@pytest.mark.timeout(120)
def test_a_head_that_waited_in_vain_says_whom_it_refused_and_why(three_layer_dir, monkeypatch):
    """The reason is in the final error, not only in a warning minutes before it."""
    monkeypatch.setenv("NANOINFER_NODE_START_TIMEOUT", "8")
    port = free_port()
    head = Config(three_layer_dir, pipeline_parallel_size=2, nnodes=2, master_port=port,
                  device="cpu")
    wrong = start_node(three_layer_dir, 1, port, key="another-secret", stderr=subprocess.PIPE,
                       env={"NANOINFER_NODE_START_TIMEOUT": "2"})
    try:
        with pytest.raises(RuntimeError, match=r"nodes \[1\] did not join in 8 s .*; node from "
                           r"127\.0\.0\.1:\d+ refused: the node holds another NANOINFER_CLUSTER_KEY"):
            accept(head, ("127.0.0.1", port + 1), "node", range(1, 2))
    finally:
        wrong.kill()
        wrong.wait()


def test_a_node_started_first_waits_for_its_head_then_gives_up(three_layer_dir):
    port = free_port()
    node = start_node(three_layer_dir, 1, port, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True, env={"NANOINFER_NODE_START_TIMEOUT": "3"})
    output = node.communicate(timeout=60)[0]
    assert node.returncode == 1
    assert f"waiting for the head at ('127.0.0.1', {port + 1})" in output
    assert f"no head at 127.0.0.1:{port + 1} in 3 s" in output


def test_nodes_need_the_cluster_key(three_layer_dir, monkeypatch):
    monkeypatch.delenv("NANOINFER_CLUSTER_KEY")
    with pytest.raises(ValueError, match="the same secret in NANOINFER_CLUSTER_KEY, on every node"):
        LLM(three_layer_dir, pipeline_parallel_size=2, nnodes=2, master_port=free_port())


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("nnodes", [1, 2, 4])
def test_each_tensor_parallel_group_inside_one_node(llama_dir, tp, pp, nnodes):
    """Accepted exactly when whole stages go to each node; then the nodes' ranks cover the world
    in order, each tensor-parallel group inside one node, the driver on the last."""
    nodes = {"nnodes": nnodes, "master_port": 29500 if nnodes > 1 else None, "device": "cpu"}
    if pp % nnodes:
        with pytest.raises(ValueError, match=f"nnodes={nnodes} must divide pipeline_parallel_size="
                           f"{pp}: each node holds whole pipeline stages"):
            Config(llama_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, **nodes)
        return
    configs = [Config(llama_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, node_rank=n,
                      **nodes) for n in range(nnodes)]
    ranks = [c.node_ranks for c in configs]
    assert [r for node in ranks for r in node] == list(range(tp * pp))
    for first in range(0, tp * pp, tp):
        assert any(first in node and first + tp - 1 in node for node in ranks)
    assert configs[0].driver_rank in ranks[-1]


def test_bad_node_settings(llama_dir):
    with pytest.raises(ValueError, match="the head's if nnodes > 1, else None; got None"):
        Config(llama_dir, pipeline_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="the head's if nnodes > 1, else None; got 70000"):
        Config(llama_dir, pipeline_parallel_size=2, nnodes=2, master_port=70000)
    # (one node's ranks meet at a free port: a fixed one would clash between data-parallel cores)
    with pytest.raises(ValueError, match="the head's if nnodes > 1, else None; got 29500"):
        Config(llama_dir, tensor_parallel_size=2, master_port=29500)
    for nnodes in (0, "2", None):
        with pytest.raises(ValueError, match=f"nnodes must be an integer >= 1 .* got {nnodes!r}"):
            Config(llama_dir, tensor_parallel_size=2, nnodes=nnodes)
    with pytest.raises(ValueError, match="node_rank one in \\[0, nnodes\\), got 2 and 2"):
        Config(llama_dir, pipeline_parallel_size=2, nnodes=2, node_rank=2, master_port=29500)
    with pytest.raises(ValueError, match="node_rank 1 runs no engine, only its ranks"):
        LLM(llama_dir, pipeline_parallel_size=2, nnodes=2, node_rank=1, master_port=29500)
    with pytest.raises(ValueError, match="data parallelism with nnodes=2 > 1 is not supported"):
        AsyncLLM(llama_dir, data_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
                 master_port=29500)
    for args in (["--data-parallel-size", "2", "--data-parallel-size-local", "1"],   # (no port)
                 ["--data-parallel-size", "2", "--data-parallel-start-rank", "1",
                  "--data-parallel-rpc-port", "9000"],   # (a start rank: headless only)
                 ["--data-parallel-size", "2", "--data-parallel-size-local", "3"],
                 ["--headless", "--data-parallel-size", "2", "--data-parallel-start-rank", "1"],
                 ["--headless", "--nnodes", "2", "--pipeline-parallel-size", "2"],   # (rank 0)
                 ["--node-rank", "1", "--nnodes", "2", "--pipeline-parallel-size", "2"],
                 ["--headless", "--data-parallel-size", "2", "--data-parallel-rpc-port", "9000"]):
        with pytest.raises(SystemExit):   # (argparse's usage error)
            parse_args(args)
    args = parse_args(["--headless", "--data-parallel-size", "3", "--data-parallel-start-rank",
                       "1", "--data-parallel-rpc-port", "9000"])
    assert args.data_parallel_size_local == 2   # (the rest)


def serve(path: str, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nanoinfer.serve", "--model", path,
                             "--device", "cpu", "--max-model-len", "512", *args],
                            env=dict(os.environ, PYTHONPATH=os.getcwd()), **popen)


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120).json()


@pytest.mark.timeout(300)
def test_data_parallel_cores_on_another_node(three_layer_dir):
    """Two cores on the head and one on a headless node: the load balancer spreads requests over
    all three, each answer is the one process's; the remote core lost (its node killed) fails
    its own request only, the others finish, /health stays 200 and new requests are served."""
    port = free_port()
    rpc = str(free_port())
    head = serve(three_layer_dir, "--port", str(port), "--served-model-name", "m",
                 "--data-parallel-size", "3", "--data-parallel-size-local", "2",
                 "--data-parallel-rpc-port", rpc)
    node = serve(three_layer_dir, "--headless", "--data-parallel-size", "3",
                 "--data-parallel-start-rank", "2", "--data-parallel-size-local", "1",
                 "--data-parallel-rpc-port", rpc)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, head)
        prompts = [f"{i} {w}" for i, w in enumerate(["one", "two", "three"] * 2)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda p: complete(url, p, 8), prompts))
        per_core = served_per_core(url)
        assert sorted(per_core) == ["0", "1", "2"] and all(per_core.values()), per_core
        one = LLM(three_layer_dir, max_model_len=512)
        expected = one.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True), use_tqdm=False)
        one.shutdown()
        assert [a["choices"][0]["text"] for a in answers] == [o.outputs[0].text for o in expected]
        started = threading.Barrier(4)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:   # one on each core
            running = [pool.submit(stream, url, p, started) for p in prompts[:3]]
            started.wait(60)
            for proc in [node, *psutil.Process(node.pid).children(recursive=True)]:
                proc.kill()
            results = [r.result() for r in running]
        failed = [r for r in results if '"error"' in r]
        assert len(failed) == 1 and "engine core 2 died" in failed[0], results
        assert all(r.endswith("data: [DONE]") for r in results if r not in failed), results
        assert httpx.get(url + "/health").status_code == 200
        assert "error" not in complete(url, prompts[0], 4)
    finally:
        node.kill()
        head.send_signal(signal.SIGINT)
        head.wait(30)


def stream(url: str, prompt: str, started: threading.Barrier) -> str:
    """A long streamed completion's events; `started` is waited on once the first has come."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line:
                events.append(line)
                if len(events) == 1:
                    started.wait(60)
    return "\n".join(events)


@pytest.mark.timeout(240)
def test_a_server_whose_other_node_dies_fails_its_streams_and_says_so(three_layer_dir):
    """A server's head with the second pipeline stage on a headless node: the node killed while a
    request streams, the stream ends with an error (not a hang) and /health turns 503."""
    port = free_port()
    master = str(free_port())
    nodes = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--master-port", master]
    head = serve(three_layer_dir, "--port", str(port), "--served-model-name", "m", *nodes)
    node = serve(three_layer_dir, "--headless", "--node-rank", "1", *nodes)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, head)
        started = threading.Barrier(2)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(stream, url, "Once upon a time", started)
            started.wait(60)
            for proc in [node, *psutil.Process(node.pid).children(recursive=True)]:
                proc.kill()
            events = running.result(timeout=60)
        assert '"error"' in events and "node 1 was lost" in events, events[-500:]
        assert httpx.get(url + "/health").status_code == 503
    finally:
        node.kill()
        head.send_signal(signal.SIGINT)
        head.wait(30)


def wait_for_health(url: str, proc: subprocess.Popen) -> None:
    for _ in range(1200):
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health").status_code == 200:
                return
        assert proc.poll() is None, "the server exited"
        time.sleep(0.1)
    raise TimeoutError("the server did not start")


def served_per_core(url: str) -> dict[str, float]:
    """{core rank: requests it finished}, from vLLM's metric of the name."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            core = line.split('engine="')[1].split('"')[0]
            out[core] = out.get(core, 0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture
def namespace():
    """A network namespace joined to this one by a veth pair (10.213.0.1 here, 10.213.0.2 there),
    where this test may make one (root, iproute2), else a skip that says why."""
    name = f"nanoinfer{os.getpid()}"
    here = f"ni{os.getpid() % 100000}h"
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("network namespaces need root, iproute2 and unshare")
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode:
        pytest.skip("this machine does not let the test make a network namespace")
    try:
        for command in (f"ip link add {here} type veth peer name {here[:-1]}n netns {name}",
                        f"ip addr add 10.213.0.1/24 dev {here}", f"ip link set {here} up",
                        f"ip -n {name} addr add 10.213.0.2/24 dev {here[:-1]}n",
                        f"ip -n {name} link set {here[:-1]}n up", f"ip -n {name} link set lo up"):
            subprocess.run(command.split(), check=True)
        yield name, here
    finally:
        subprocess.run(["ip", "netns", "del", name])


@pytest.mark.timeout(240)
def test_partitioned_node_in_a_namespace_of_its_own(three_layer_dir, namespace, monkeypatch):
    """The second node shares neither a loopback nor /dev/shm with the head (a network and a mount
    namespace of its own): greedy tokens are transformers'. Then the wire is cut (the veth pair
    down, as a partition does: nothing closes): the head's requests fail within about the node
    timeout, and the node exits by itself."""
    name, here = namespace
    port = free_port()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", here)   # (the head's ranks: the veth end here)
    node_command = " ".join([sys.executable, "-m", "nanoinfer.serve", "--model", three_layer_dir,
                             "--device", "cpu", "--pipeline-parallel-size", "2", "--nnodes", "2",
                             "--node-rank", "1", "--master-addr", "10.213.0.1", "--master-port",
                             str(port), "--headless"])
    node = subprocess.Popen(["ip", "netns", "exec", name, "unshare", "--mount", "sh", "-c",
                             f"mount -t tmpfs tmpfs /dev/shm && exec {node_command}"],
                            env=dict(os.environ, PYTHONPATH=os.getcwd(),
                                     GLOO_SOCKET_IFNAME=f"{here[:-1]}n"))
    try:
        llm = LLM(three_layer_dir, pipeline_parallel_size=2, nnodes=2, node_rank=0,
                  master_addr="10.213.0.1", master_port=port)
        prompts = random_prompts([5, 23], seed=2)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == [hf_greedy(three_layer_dir, p, 12) for p in prompts]
        subprocess.run(["ip", "link", "set", here, "down"], check=True)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="node 1 was lost: .*timed out"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 4 + 30   # (bounded: the timeout, and a loaded machine)
        assert_exits_with_its_processes(node, 1)
        llm.shutdown()
    finally:
        node.kill()
