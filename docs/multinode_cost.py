"""What a rank on another node costs the engine's host, on the CPU: `python docs/multinode_cost.py`.

Times `MultiprocExecutor.send` (one call to every rank: the shared-memory ring, and with another
node also the pickling and sending over its link) while a 3-layer test model generates, with
pipeline_parallel_size=2: both stages on this node (nnodes=1), then the second stage on a
headless node, a second process tree on this machine (nnodes=2). Three rounds, alternated; the
medians are printed (docs/BENCHMARKS.md, "Multi-node").
"""
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, "tests")   # (the test models: conftest.save_model)
os.environ.setdefault("NANOINFER_CLUSTER_KEY", "multinode-cost")


def start_node(path: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = subprocess.Popen([sys.executable, "-m", "nanoinfer.serve", "--model", path,
                             "--device", "cpu", "--pipeline-parallel-size", "2", "--nnodes", "2",
                             "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
                             str(port), "--headless"],
                            env=dict(os.environ, PYTHONPATH=os.getcwd()), stdout=subprocess.DEVNULL)
    return node, port


def run(path: str, nnodes: int) -> tuple[float, float, float]:
    """(median and mean µs of one send, generate's seconds)."""
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.executor.multiproc_executor import MultiprocExecutor
    node = None
    options = {}
    if nnodes == 2:
        node, port = start_node(path)
        options = {"nnodes": 2, "master_port": port}
    llm = LLM(path, pipeline_parallel_size=2, **options)
    times = []
    send = MultiprocExecutor.send

    def timed_send(self, call, check):
        start = time.perf_counter_ns()
        send(self, call, check)
        times.append((time.perf_counter_ns() - start) / 1e3)

    prompts = [[1 + (i * 7 + j) % 400 for j in range(40)] for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)   # warm-up
    MultiprocExecutor.send = timed_send
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    MultiprocExecutor.send = send
    llm.shutdown()
    if node is not None:
        node.wait(30)
    return statistics.median(times), statistics.mean(times), seconds


if __name__ == "__main__":
    from conftest import save_model
    model = save_model("qwen2", "/tmp/nanoinfer-multinode-cost", num_hidden_layers=3)
    rows = {1: [], 2: []}
    for _ in range(3):
        for nnodes in rows:
            rows[nnodes].append(run(model, nnodes))
    for nnodes, runs in rows.items():
        median, mean, seconds = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"nnodes={nnodes}: one send {median:.0f} µs median ({mean:.0f} µs mean), generate "
              f"{seconds:.2f} s (runs: {[round(r[2], 2) for r in runs]})")
