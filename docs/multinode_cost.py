"""`python docs/multinode_cost.py`: host time of MultiprocExecutor.send per call, ranks all local (nnodes=1) against a remote node
(nnodes=2, the second node a headless process on this machine), pipeline_parallel_size=2."""
import os, socket, statistics, subprocess, sys, time
sys.path.insert(0, "tests")   # (the test models: conftest.save_model)
os.environ["NANOINFER_CLUSTER_KEY"] = "k"

def run(path, nnodes):
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.executor.multiproc_executor import MultiprocExecutor
    node = None
    kw = {}
    if nnodes == 2:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        node = subprocess.Popen([sys.executable, "-m", "nanoinfer.serve", "--model", path, "--device", "cpu",
            "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--headless"], env=dict(os.environ, PYTHONPATH=os.getcwd()),
            stdout=subprocess.DEVNULL)
        kw = dict(nnodes=2, master_port=port)
    llm = LLM(path, pipeline_parallel_size=2, **kw)
    ex = llm.llm_engine.model_executor
    times = []
    orig = MultiprocExecutor.send
    def timed(self, call, check):
        t = time.perf_counter_ns(); orig(self, call, check); times.append(time.perf_counter_ns() - t)
    MultiprocExecutor.send = timed
    prompts = [[1 + (i * 7 + j) % 400 for j in range(40)] for i in range(64)]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate(prompts[:4], sp, use_tqdm=False)   # warm-up
    times.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    MultiprocExecutor.send = orig
    llm.shutdown()
    if node: node.wait(30)
    return statistics.median(times) / 1e3, statistics.mean(times) / 1e3, len(times), wall

if __name__ == "__main__":
    from conftest import save_model
    path = save_model("qwen2", "/tmp/costm", num_hidden_layers=3)
    rows = {1: [], 2: []}
    for _ in range(3):
        for n in (1, 2):
            rows[n].append(run(path, n))
    for n, rs in rows.items():
        print(f"nnodes={n}: send median {statistics.median(r[0] for r in rs):.1f} us, mean "
              f"{statistics.median(r[1] for r in rs):.1f} us over {rs[0][2]} calls; generate "
              f"{statistics.median(r[3] for r in rs):.2f} s (runs: {[round(r[3], 2) for r in rs]})")
