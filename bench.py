"""Throughput benchmark: nano-vllm's workload, against the hardware's limit.

Workload (nano-vllm's bench.py): random.seed(0); 256 prompts of random token ids in [0, 10000] with
lengths U[100, 1024]; each with max_tokens U[100, 1024], temperature 0.6, ignore_eos.
Output tok/s = sum(max_tokens) / wall time (133,966 output tokens). The default model has
Qwen3-0.6B's shape with random weights (throughput does not depend on their values);
`--model-shape qwen3-8b` takes Qwen3-8B's, `--model` runs a real checkpoint, and `--tp N` splits
the model over N GPUs (the roofline then counts N GPUs' bandwidth and FLOPs).

Next to the result it prints the roofline for the same workload: the bytes that must move
(every weight once per decode step, every cached K/V entry once per token that attends to it)
over the measured HBM bandwidth, and the FLOPs over the measured matmul peak.

The workload runs three times on a GPU (a cold prefix cache each time; `--runs N`) and the median
counts; the first run is printed beside it, since a user runs a workload once. It also
breaks a step down: the host's phases (scheduling, building inputs, waiting for the sampled
tokens, bookkeeping) and the GPU's busy time (CUDA events), averaged over all steps.

Other modes: `--mode latency` (batch 1 and 8, fixed lengths: time to first token, time per
output token, end-to-end; medians of several runs) and `--mode kernels` (the attention kernels
alone: decode bandwidth, prefill TFLOP/s, next to torch's scaled_dot_product_attention; then
decode's small matmuls, the gemv kernel next to cuBLAS), and `--mode profile` (where the GPU's
time goes: torch.profiler's kernel times by kind over one run of the workload, against each
part's bound, then over batch-1 and batch-8 decode steps, against the step's wall time and its
CUDA graph replayed alone; `--model-shape` picks the shape).

Speculative decoding: `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`
(vLLM's keys), and `--workload copy` for prompts that ask a real model (`--model`) to rewrite a
passage, where n-gram drafts have something to find (greedy, ending at EOS as a rewrite does;
throughput then counts the tokens made). It then prints the drafts proposed and
accepted, and the n-gram lookup's host time per step. `--force-repeat` makes a random-weight
shape repeat itself (every layer's output projections zeroed: a token's successor then depends
on that token alone, and with tied embeddings is the token itself), so that drafts are accepted
while every kernel costs what it did: the speed of verification at near-full acceptance.

Serving: `--mode serve [--url URL] [--request-rate R[,R...]] [--max-concurrency C]` sends the
same workload through the OpenAI-compatible server (one started with the same model and engine
options, or the one at URL) as streamed /v1/completions requests with Poisson arrivals, and
reports request and output throughput, time to first token, time per output token, inter-token
latency and end-to-end latency (median and p99), and goodput under an SLO (`--slo-ttft-ms`,
`--slo-tpot-ms`), and from the server's /metrics its engine steps and mean queue time in the
run. Each rate's run starts its prompts with a token of its own, so that no run
finds another's blocks in the prefix cache. The client is the standard library's asyncio.

`--workload fixed --input-len 4096 --output-len 256` gives every request those lengths;
`--dp 2` starts a server with two engine cores, `--disagg` a prefill server on GPU 0 and a decode
server on GPU 1 with a SharedStorageConnector between them (a temporary folder) and the proxy in
front (kv_transfer/).

Structured output: `--guided-json [FILE]` makes every request follow a JSON schema (bench.py's
typical one without FILE); `--tokenizer DIR` gives a random-weight shape a real tokenizer.

On a machine without CUDA it scales itself down (a few short prompts, one run), and says so: about
35 s of CPU time, so about a minute on two free cores and more on busy ones (3 minutes were seen);
the roofline is only printed on a GPU.
"""
import argparse
import asyncio
import collections
import dataclasses
import itertools
import json
import multiprocessing
import os
import pickle
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor

import torch

from nanoinfer import LLM, GuidedDecodingParams, SamplingParams
from nanoinfer.worker.async_output import AsyncModelRunnerOutput
from nanoinfer.worker.model_runner import ModelRunner
from nanoinfer.executor.multiproc_executor import FutureOutput
from nanoinfer.sampling_params import RequestOutputKind

QWEN3_0_6B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                  intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu", torch_dtype="bfloat16",
                  bos_token_id=151643, eos_token_id=151645)
QWEN3_8B = dict(QWEN3_0_6B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                tie_word_embeddings=False)
MODEL_SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B}
CPU_LAYERS = 2   # of a shape run on the CPU (a smoke run)
TYPICAL_SCHEMA = {"type": "object", "properties": {   # for --guided-json: mixed types, nesting, an array
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 40}, "email": {"type": "string"},
    "active": {"type": "boolean"}, "score": {"type": "number"}, "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                "required": ["city"]}}, "required": ["id", "name", "email", "active"]}


def workload(num_seqs: int, max_input_len: int, max_output_len: int):
    random.seed(0)
    min_in, min_out = min(100, max_input_len), min(100, max_output_len)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_in, max_input_len))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(min_out, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


PASSAGE = [
    "A paged KV cache stores the keys and values of every sequence in fixed-size blocks.",
    "The scheduler admits new requests while the token budget and the free blocks last.",
    "When memory runs out, the newest running sequence is preempted and recomputed later.",
    "Prefix caching lets requests that share a system prompt reuse the same blocks.",
    "CUDA graphs remove the launch overhead of the many small kernels in a decode step.",
    "Speculative decoding proposes several tokens and verifies them in a single forward pass.",
    "Tensor parallelism splits every layer across GPUs and joins the halves with an all-reduce.",
    "A rejection sampler keeps the output distribution exactly that of the target model.",
]


def copy_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Requests to rewrite a passage (its sentences shuffled per request) word for word."""
    rng, prompts = random.Random(seed), []
    for _ in range(n):
        text = " ".join(rng.sample(PASSAGE, len(PASSAGE)))
        messages = [{"role": "user", "content": f"Rewrite this text exactly, word for word:\n\n{text}"}]
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts


def print_spec_stats(engine) -> None:
    stats = engine.scheduler.spec_stats
    if engine.config.speculative is not None:
        print(f"speculative ({engine.config.speculative.method}, k={engine.config.speculative.num_speculative_tokens}): "
              f"{stats.num_draft_tokens:,} drafts in {stats.num_steps:,} verifications, {stats.num_accepted_tokens:,} "
              f"accepted: acceptance rate {stats.acceptance_rate:.1%}, {stats.mean_acceptance_length:.2f} tokens "
              "per verification step")


def model_sizes(cfg) -> tuple[int, int, int, int]:
    """(matmul parameters, of them per layer, K/V values per token, head_dim)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    matmul_params = cfg.num_hidden_layers * per_layer + cfg.vocab_size * cfg.hidden_size   # + LM head
    return matmul_params, per_layer, 2 * cfg.num_hidden_layers * kv, head_dim


def roofline_parts(cfg, prompt_lens: list[int], output_lens: list[int], dtype_bytes: int) -> dict[str, float]:
    """What the workload must move and run, all sequences decoding together: the weights' bytes
    (read once per decode step), the K/V bytes (output token j of a sequence attends to prompt + j
    keys), the matmuls' FLOPs (LM head once per sampled token) and attention's FLOPs."""
    matmul_params, per_layer, kv_per_token, head_dim = model_sizes(cfg)
    kv_reads = sum(p * o + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens))
    prefill_keys = sum(p * (p + 1) // 2 for p in prompt_lens)
    return {"weight bytes": max(output_lens) * matmul_params * dtype_bytes,
            "kv bytes": kv_reads * kv_per_token * dtype_bytes,
            "matmul flops": (2 * cfg.num_hidden_layers * per_layer * (sum(prompt_lens) + sum(output_lens))
                             + 2 * cfg.vocab_size * cfg.hidden_size * sum(output_lens)),
            "attention flops": 4 * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers
                               * (prefill_keys + kv_reads)}


def roofline(cfg, prompt_lens: list[int], output_lens: list[int], dtype_bytes: int) -> tuple[float, float]:
    """(bytes that must move, FLOPs that must run) for the workload."""
    parts = roofline_parts(cfg, prompt_lens, output_lens, dtype_bytes)
    return parts["weight bytes"] + parts["kv bytes"], parts["matmul flops"] + parts["attention flops"]


def measure_gpu_limits() -> tuple[float, float, str]:
    """(copy bandwidth in bytes/s, counting read + write; bf16 matmul FLOP/s), median of runs, and
    the GPU's name."""
    import triton.testing
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    bandwidth = 2 * src.numel() / (ms * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    return bandwidth, 2 * 8192**3 / (ms * 1e-3), torch.cuda.get_device_name()


class StepTimer:
    """Wraps the engine's phases to time them: host phases with a clock, each step's GPU work
    with CUDA events around its launches (async scheduling launches step N+1 before waiting
    for step N, so the GPU idles only where the host falls behind)."""

    def __init__(self, engine, on_gpu: bool):
        self.host, self.calls, self.events = defaultdict(float), defaultdict(int), []
        self.message = (0, 0)   # (sequences, pickled bytes) of the largest pure-decode step message
        executor = engine.model_executor
        self.wrap(engine.scheduler, "schedule", "schedule")
        if isinstance(executor, ModelRunner):   # (under tensor parallelism the ranks' workers do this)
            self.wrap(executor.input_batch, "update", "apply step message")
            self.wrap(executor.input_batch, "prepare_inputs", "prepare inputs")
            self.wrap(executor.input_batch, "sampling_metadata", "prepare sampling")
        self.wrap(AsyncModelRunnerOutput, "get_output", "wait for tokens")
        self.wrap(FutureOutput, "get_output", "wait for tokens")
        self.wrap(engine.scheduler, "update_from_output", "update")
        self.wrap(engine.output_processor, "process_outputs", "outputs")
        if engine.scheduler.ngram is not None:
            self.wrap(engine.scheduler.ngram, "propose", "n-gram lookup")
        execute_model, sample_tokens = executor.execute_model, executor.sample_tokens

        def execute(sched):   # the GPU's share of a step: from its first launch to its last
            if on_gpu:
                self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                self.events[-1][0].record()
            num_seqs = len(sched.num_scheduled_tokens)
            if num_seqs > self.message[0] and sched.total_num_scheduled_tokens == num_seqs:
                self.message = (num_seqs, len(pickle.dumps(sched)))
            return execute_model(sched)

        def sample(executed, grammar=None):
            out = sample_tokens(executed, grammar)
            if on_gpu:
                self.events[-1][1].record()
            return out
        executor.execute_model, executor.sample_tokens = execute, sample
        self.wrap(engine, "step", "step (wall)")

    def wrap(self, obj, name, label):
        fn = getattr(obj, name)

        def timed(*args):
            start = time.perf_counter()
            out = fn(*args)
            self.host[label] += time.perf_counter() - start
            self.calls[label] += 1
            return out
        setattr(obj, name, timed)

    def report(self) -> str:
        steps = self.calls["step (wall)"]
        lines = [f"step breakdown over {steps} steps (ms per step):"]
        for label, total in self.host.items():
            lines.append(f"  {label:<22} {1e3 * total / steps:7.3f}")
        if self.events:
            torch.cuda.synchronize()
            gpu = sum(a.elapsed_time(b) for a, b in self.events) / steps
            lines.append(f"  {'GPU busy':<22} {gpu:7.3f}")
            lines.append(f"  {'GPU idle (wall - busy)':<22} {1e3 * self.host['step (wall)'] / steps - gpu:7.3f}")
        lines.append(f"step message of a {self.message[0]}-sequence decode step: {self.message[1]:,} bytes pickled")
        return "\n".join(lines)


def triton_variants() -> collections.Counter | None:
    """How many variants of each of the engine's Triton kernels this process has compiled (None
    where Triton keeps its caches elsewhere). Triton compiles a variant for each new
    specialization of a kernel's arguments; one compiled during a timed run stalls it."""
    count, found = collections.Counter(), False
    for name, module in list(sys.modules.items()):
        if not name.startswith("nanoinfer.kernels."):
            continue
        for fn in vars(module).values():
            caches = getattr(fn, "device_caches", None)
            if isinstance(caches, dict):
                found = True
                count[fn.__name__] += sum(len(cache[0]) for cache in caches.values())
    return count if found else None


def latency(llm: LLM, input_len: int, output_len: int, bandwidth: float | None, runs: int = 5,
            copy: bool = False) -> None:
    """Streamed (DELTA) outputs, per request: TTFT is when its first token reaches the caller, TPOT
    the time per token after it (medians over the batch and the runs). Copy prompts stop at EOS,
    as a rewrite does (at most `output_len` tokens); the others run to `output_len`. The TPOT
    bound: every weight and the batch's K/V read once per token."""
    engine = llm.llm_engine
    matmul_params, _, kv_per_token, _ = model_sizes(engine.config.hf_config)
    dtype_bytes = engine.config.torch_dtype.itemsize
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=not copy,
                            output_kind=RequestOutputKind.DELTA)
    for batch in (1, 8):
        ttft, tpot, e2e, lengths, first_step = [], [], [], [], []
        for run in range(runs + 1):
            rng = random.Random(run)   # new prompts each run: no prefix-cache hits
            prompts = copy_prompts(engine.tokenizer, batch, run) if copy else [
                [rng.randint(0, 10000) for _ in range(input_len)] for _ in range(batch)]
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{batch}-{run}-{i}", prompt, params)
            start, first, num_tokens = time.perf_counter(), {}, {}
            while engine.has_unfinished_requests():
                outs = engine.step()
                # (with async scheduling the host's time to launch the prefill, if one step
                # holds it; without, the prefill's whole time)
                if run and len(first_step) < run:
                    first_step.append(time.perf_counter() - start)
                for out in outs:
                    now, rid = time.perf_counter(), out.request_id
                    first.setdefault(rid, now)
                    num_tokens[rid] = num_tokens.get(rid, 0) + len(out.outputs[0].token_ids)
                    if out.finished and run:   # the first run is a warm-up
                        ttft.append(first[rid] - start)
                        tpot.append((now - first[rid]) / max(num_tokens[rid] - 1, 1))
                        lengths.append(num_tokens[rid])
            if run:
                e2e.append(time.perf_counter() - start)
        bound = ""
        if bandwidth:
            step_bytes = (matmul_params + batch * (input_len + output_len // 2) * kv_per_token) * dtype_bytes
            bound = f" (bound {1e3 * step_bytes / bandwidth:.2f} ms at {bandwidth / 1e12:.2f} TB/s)"
        out_len = f"{statistics.median(lengths):.0f} (median)" if copy else output_len
        print(f"batch {batch}, {'copy prompts' if copy else input_len} in / {out_len} out, median of {runs}: "
              f"TTFT {1e3 * statistics.median(ttft):.1f} ms, TPOT {1e3 * statistics.median(tpot):.2f} ms{bound}, "
              f"end-to-end {statistics.median(e2e):.3f} s; the first step() call "
              f"{1e3 * statistics.median(first_step):.1f} ms")
    graphs = getattr(getattr(engine.model_executor, "graph_runner", None), "graphs", {})
    if 8 in graphs:   # a decode step's forward on the GPU, without the host
        import triton.testing
        for batch in (1, 8):
            us = 1e3 * triton.testing.do_bench(graphs[batch].replay, return_mode="median")
            print(f"batch {batch}: a decode step's CUDA graph alone (the forward; no LM head, no sampling) "
                  f"{us:.0f} µs")
    print_spec_stats(engine)


async def stream_completion(host: str, port: int, body: dict) -> dict:
    """One streamed /v1/completions request over a raw HTTP/1.1 connection: when it was sent,
    when each of its chunks came, its usage, and the error, if it got one (a stream that ends
    without `data: [DONE]` is one)."""
    result = {"sent": time.perf_counter(), "chunks": [], "usage": None, "error": None}
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        data = json.dumps(body).encode()
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        status, chunked, buffer, done = (await reader.readline()).split(b" ")[1], False, b"", False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            chunked |= line.lower() == b"transfer-encoding: chunked\r\n"
        while True:   # server-sent events, each "data: {json}\n\n", in chunked transfer encoding
            part = (await reader.readexactly(int(await reader.readline(), 16) + 2))[:-2] if chunked \
                else await reader.read(1 << 16)
            if not part:
                break
            buffer += part
            *events, buffer = buffer.split(b"\n\n")
            now = time.perf_counter()
            for event in events if status == b"200" else ():
                done |= event == b"data: [DONE]"
                message = {} if done else json.loads(event.removeprefix(b"data: "))
                if "error" in message:
                    result["error"] = message["error"]["message"]
                elif message.get("choices"):
                    result["chunks"].append(now)
                elif message.get("usage"):
                    result["usage"] = message["usage"]
        if status != b"200":
            result["error"] = f"HTTP {status.decode()}: {buffer.decode()}"
        elif not done and result["error"] is None:
            result["error"] = "the stream ended without [DONE]"
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, engine_kwargs: dict, data_parallel_size: int, gpus: str | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """`python -m nanoinfer.serve` with these engine options (on these GPUs), once it answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanoinfer.serve", "--model", model, "--port", str(port),
           "--data-parallel-size", str(data_parallel_size)]
    for name, value in engine_kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return start(cmd, f"http://127.0.0.1:{port}", gpus)


def start(cmd: list[str], url: str, gpus: str | None = None) -> tuple[subprocess.Popen, str]:
    env = os.environ if gpus is None else os.environ | {"CUDA_VISIBLE_DEVICES": gpus}
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url + "/health", timeout=10).status == 200:
                return proc, url
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"{cmd[2]} exited with code {proc.returncode}")
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{cmd[2]} did not answer /health in 10 minutes")


def start_disaggregated(model: str, engine_kwargs: dict) -> tuple[list[subprocess.Popen], str]:
    """A prefill server on GPU 0 and a decode server on GPU 1 (a SharedStorageConnector between
    them, over a temporary folder), and the proxy in front of them."""
    from concurrent.futures import ThreadPoolExecutor
    import atexit
    import shutil
    import tempfile
    folder = tempfile.mkdtemp(prefix="nanoinfer-bench-kv-")
    atexit.register(shutil.rmtree, folder, True)   # (the blocks, once both servers have stopped)
    with ThreadPoolExecutor(2) as pool:   # (both start at once)
        servers = [pool.submit(start_server, model, engine_kwargs | {"kv_transfer_config": {
            "kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": folder}}}, 1, gpu)
            for role, gpu in (("kv_producer", "0"), ("kv_consumer", "1"))]
        (prefill, prefill_url), (decode, decode_url) = [s.result() for s in servers]
    proxy_port = free_port()
    proxy, url = start([sys.executable, "-m", "nanoinfer.entrypoints.disagg_proxy", "--prefill", prefill_url,
                        "--decode", decode_url, "--port", str(proxy_port)], f"http://127.0.0.1:{proxy_port}")
    return [prefill, decode, proxy], url


def server_counts(url: str) -> dict[str, float]:
    """The server's engine steps (summed over its engine cores, counted too) and its requests'
    summed queue time, from its /metrics (none where it has none)."""
    counts = {"engine cores": 0}
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    except OSError:
        return counts
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        name = key.split("{")[0].removeprefix("vllm:")
        if name in ("iteration_tokens_total_count", "request_queue_time_seconds_sum"):
            counts[name] = counts.get(name, 0) + float(value)
            counts["engine cores"] += name == "iteration_tokens_total_count"
    return counts


def serve(url: str, prompts: list[list[int]], params: list[SamplingParams], rates: list[float],
          max_concurrency: int | None, slo_ttft: float, slo_tpot: float, server_steps: bool = True) -> None:
    """Each rate in turn: the workload's requests arrive as a Poisson process (all at once for
    inf), at most `max_concurrency` of them in flight; the tokens come back streamed. With
    `server_steps`, also the server's engine steps and queue time (not through the disaggregated
    proxy, which forwards /metrics to the decode server alone)."""
    address = urllib.parse.urlsplit(url)
    host, port = address.hostname, address.port or 80

    async def run(rate: float, tag: int) -> tuple[list[dict], float]:
        rng = random.Random(tag)
        arrivals = itertools.accumulate((rng.expovariate(rate) if rate != float("inf") else 0.0
                                         for _ in prompts), initial=0.0)
        slots = asyncio.Semaphore(max_concurrency or len(prompts))

        async def one(prompt: list[int], p: SamplingParams, arrival: float) -> dict:
            await asyncio.sleep(arrival)
            async with slots:
                return await stream_completion(host, port, {
                    "prompt": [tag] + prompt[1:], "max_tokens": p.max_tokens, "temperature": p.temperature,
                    "ignore_eos": p.ignore_eos, "stream": True, "stream_options": {"include_usage": True}})
        start = time.perf_counter()
        results = await asyncio.gather(*[one(*x) for x in zip(prompts, params, arrivals)])
        return results, time.perf_counter() - start

    for i, rate in enumerate([float("inf")] + rates):   # first a warm-up (kernels compile at first use)
        before = server_counts(url)
        results, elapsed = asyncio.run(run(rate, 10_000 + i))   # its own first token: no prefix-cache hits
        counts = {k: v - before.get(k, 0) for k, v in server_counts(url).items()}
        failed = [r for r in results if r["error"] or not r["chunks"] or not r["usage"]]
        if failed:
            raise SystemExit(f"{len(failed)} requests failed, the first with: {failed[0]['error']}")
        if i == 0:
            continue
        ttft = [r["chunks"][0] - r["sent"] for r in results]
        e2e = [r["chunks"][-1] - r["sent"] for r in results]
        tokens = [r["usage"]["completion_tokens"] for r in results]
        tpot = [(e - t) / (n - 1) for e, t, n in zip(e2e, ttft, tokens) if n > 1]
        itl = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
        good = sum(t <= slo_ttft and (n == 1 or (e - t) / (n - 1) <= slo_tpot) for t, e, n in zip(ttft, e2e, tokens))

        def ms(xs: list[float]) -> str:
            xs = sorted(xs) or [float("nan")]
            return f"{1e3 * statistics.median(xs):,.1f} / {1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]:,.1f} ms"
        print(f"rate {rate:g} req/s: {len(results)} requests in {elapsed:.2f} s: {len(results) / elapsed:.2f} req/s, "
              f"{sum(tokens) / elapsed:,.0f} output tok/s; median / p99: TTFT {ms(ttft)}, TPOT {ms(tpot)}, "
              f"ITL {ms(itl)}, E2E {ms(e2e)}; goodput (TTFT <= {1e3 * slo_ttft:g} ms, TPOT <= "
              f"{1e3 * slo_tpot:g} ms) {good / elapsed:.2f} req/s ({good / len(results):.0%} of requests)", flush=True)
        if server_steps and counts.get("iteration_tokens_total_count"):
            cores = max(1, before["engine cores"])
            steps = counts["iteration_tokens_total_count"] / cores
            queue = counts.get("request_queue_time_seconds_sum", 0) / len(results)
            print(f"  the server: {steps:,.0f} engine steps per engine core ({1e3 * elapsed / steps:.2f} ms "
                  f"of wall each), mean queue time {1e3 * queue:,.0f} ms; the last first token "
                  f"{1e3 * max(ttft):,.0f} ms after its request", flush=True)


def kernels() -> None:
    """Decode and prefill attention, Qwen3-0.6B heads (16 q / 8 kv, head_dim 128), bf16."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from nanoinfer.kernels.decode_attention import decode_attention
    from nanoinfer.kernels.prefill_attention import prefill_attention
    heads, kv_heads, dim, page, dev = 16, 8, 128, 16, "cuda"
    bench_ms = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")  # noqa: E731
    bandwidth, *_ = measure_gpu_limits()
    print(f"device copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)")

    def torch_sdpa(q, k, v, causal):
        results = []
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    results.append((name, bench_ms(lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=True))))
            except RuntimeError:
                results.append((name, None))
        return results

    for num_seqs, ctx in ((256, 1024), (8, 8192), (1, 4096)):
        blocks = num_seqs * ctx // page
        k_cache = torch.randn(blocks, page, kv_heads, dim, dtype=torch.bfloat16, device=dev)
        v_cache = torch.randn_like(k_cache)
        block_tables = torch.randperm(blocks, device=dev).view(num_seqs, -1).to(torch.int32)
        context_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(num_seqs, heads, dim, dtype=torch.bfloat16, device=dev)
        kv_bytes = 2 * num_seqs * ctx * kv_heads * dim * 2
        ms = bench_ms(lambda: decode_attention(q, k_cache, v_cache, block_tables, context_lens, dim ** -0.5))
        line = f"decode {num_seqs} x {ctx}: nanoinfer {kv_bytes / ms / 1e6:,.0f} GB/s ({kv_bytes / ms / 1e-3 / bandwidth:.0%} of copy)"
        # As the engine runs it: in a CUDA graph (no launch from Python), each call reading another
        # copy of the cache (300 MB of copies at least, so that it is not in L2)
        copies = [(k_cache, v_cache)] + [(torch.randn_like(k_cache), torch.randn_like(v_cache))
                                         for _ in range(-(-300_000_000 // kv_bytes) - 1)]
        us = graph_us_per_call([lambda kc=kc, vc=vc: decode_attention(q, kc, vc, block_tables, context_lens, dim ** -0.5)
                                for kc, vc in copies])
        line += f" (in a CUDA graph, not in L2: {kv_bytes / us / 1e3:,.0f} GB/s)"
        del copies
        k = torch.randn(num_seqs, kv_heads, ctx, dim, dtype=torch.bfloat16, device=dev)
        v = torch.randn_like(k)
        for name, t in torch_sdpa(q.unsqueeze(2), k, v, False):
            line += f"; torch {name} " + (f"{kv_bytes / t / 1e6:,.0f} GB/s" if t else "n/a")
        print(line)
        del k_cache, v_cache, k, v

    num_seqs, length = 8, 2048
    tokens = num_seqs * length
    k_cache = torch.randn(tokens // page, page, kv_heads, dim, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.arange(tokens // page, device=dev, dtype=torch.int32).view(num_seqs, -1)
    lens = torch.full((num_seqs,), length, dtype=torch.int32, device=dev)
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32, device=dev)
    q = torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device=dev)
    flops = 4 * num_seqs * heads * dim * length * length / 2
    ms = bench_ms(lambda: prefill_attention(q, k_cache, v_cache, cu, lens, block_tables, length, dim ** -0.5))
    line = f"prefill {num_seqs} x {length} causal: nanoinfer {flops / ms / 1e9:,.0f} TFLOP/s"
    qt = q.view(num_seqs, length, heads, dim).transpose(1, 2)
    k = torch.randn(num_seqs, kv_heads, length, dim, dtype=torch.bfloat16, device=dev)
    for name, t in torch_sdpa(qt, k, torch.randn_like(k), True):
        line += f"; torch {name} " + (f"{flops / t / 1e9:,.0f} TFLOP/s" if t else "n/a")
    print(line)
    decode_slices(page, dim)
    small_matmuls()


def graph_us_per_call(calls) -> float:
    """µs per call of these calls captured in one CUDA graph (no launch cost between them), each
    run once before, to compile; the median of `triton.testing.do_bench` over its replays."""
    import triton.testing
    for call in calls:
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / len(calls)


def decode_slices(page: int, dim: int) -> None:
    """Small-batch decode: time per call (100 calls in one CUDA graph, so no launch cost) against
    the shortest slice of the split-KV decode (`min_split_pages`)."""
    import triton.testing

    from nanoinfer.kernels.decode_attention import decode_attention, default_split
    for num_seqs, kv_heads, group, ctx in ((1, 4, 4, 768), (1, 8, 4, 768), (1, 8, 2, 4096), (8, 8, 2, 768),
                                           (16, 8, 2, 1500), (64, 8, 2, 1000)):
        blocks = num_seqs * triton.cdiv(ctx, page)
        k_cache = torch.randn(blocks, page, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        block_tables = torch.randperm(blocks, device="cuda").view(num_seqs, -1).to(torch.int32)
        context_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(num_seqs, kv_heads * group, dim, dtype=torch.bfloat16, device="cuda")
        num_splits, chosen = default_split(num_seqs, kv_heads, q.device)
        times = []
        for min_pages in (1, 4, 8, 32):
            call = lambda: decode_attention(q, k_cache, v_cache, block_tables, context_lens, dim ** -0.5,  # noqa: E731
                                            num_splits, min_pages)
            times.append(f"{min_pages}: {graph_us_per_call([call] * 100):.1f}")
        print(f"decode {num_seqs} seqs x {kv_heads} kv heads x {group}, context {ctx}: µs per call by "
              f"slice pages {', '.join(times)} (chosen: {chosen})")


def small_matmuls() -> None:
    """The linear layers of a decode step (1, 8 and 16 rows, bf16) at Qwen3-0.6B's and -8B's
    shapes (the 8B's also at tensor parallelism 2): cuBLAS against the gemv kernel. Time per
    call in a CUDA graph, each call reading another copy of the weight (at least 300 MB of
    copies: a layer's weight is not in L2 when the next layer runs)."""
    import math

    from nanoinfer.kernels.gemv import gemv
    shapes = {"0.6b qkv": (1024, 4096), "0.6b o": (2048, 1024), "0.6b gate_up": (1024, 6144),
              "0.6b down": (3072, 1024), "8b qkv": (4096, 6144), "8b o": (4096, 4096),
              "8b gate_up": (4096, 24576), "8b down": (12288, 4096), "8b tp2 qkv": (4096, 3072),
              "8b tp2 o": (2048, 4096), "8b tp2 gate_up": (4096, 12288), "8b tp2 down": (6144, 4096)}
    total = {"cuBLAS": 0.0, "gemv": 0.0}
    for name, (k, n) in shapes.items():
        copies = max(4, math.ceil(300e6 / (2 * k * n)))
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        for rows in (1, 8, 16):
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            ours = graph_us_per_call([lambda w=w: gemv(x, w) for w in weights])
            theirs = graph_us_per_call([lambda w=w: torch.nn.functional.linear(x, w) for w in weights])
            total["cuBLAS"], total["gemv"] = total["cuBLAS"] + theirs, total["gemv"] + ours
            print(f"linear {name} ({k} -> {n}), {rows} rows: cuBLAS {theirs:.2f} µs, gemv {ours:.2f} µs "
                  f"({2 * k * n / ours / 1e6:.2f} TB/s)")
    print(f"linear, all of the above: cuBLAS {total['cuBLAS']:.0f} µs, gemv {total['gemv']:.0f} µs")


KERNEL_KINDS = [   # (kind, a pattern of kernel names), the first that matches counts
    ("gemv (ours)", r"gemv"), ("attention, decode", r"decode_(attention|reduce)"),
    ("attention, prefill", r"prefill_attention"), ("rms_norm", r"rms_norm"), ("rotary + q/k-norm", r"rotary"),
    ("store_kv", r"store_kv"), ("silu_and_mul", r"silu_and_mul"),
    ("matmul (cuBLAS)", r"gemm|nvjet|cutlass|xmma|splitK|Kernel2|sm90|cublas"),
    ("sampling", r"gumbel|softmax|argmax|topk|sort|exponential|multinomial|reduce_kernel|max_kernel"),
    ("memcpy / memset", r"[Mm]emcpy|[Mm]emset"), ("other", r"")]


def kernel_times(prof) -> dict[str, tuple[int, float]]:
    """{kernel name: (calls, µs in all)} of the GPU kernels a torch.profiler run saw."""
    return {e.key: (e.count, e.device_time_total) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total}


def print_kernels(times: dict[str, tuple[int, float]], per: int, label: str, seconds: bool = False
                  ) -> float:
    """Kernel time by kind (KERNEL_KINDS) and the longest kernels, each per one of `per` (runs or
    steps), in µs (in s with `seconds`); returns the total, in the same unit."""
    by_kind, calls = defaultdict(float), defaultdict(int)
    for name, (n, us) in times.items():
        kind = next(k for k, pattern in KERNEL_KINDS if re.search(pattern, name))
        by_kind[kind], calls[kind] = by_kind[kind] + us, calls[kind] + n
    scale, unit = (1e-6 / per, ".3f") if seconds else (1 / per, ",.1f")
    total = sum(by_kind.values())
    print(f"{label}: GPU kernel time by kind, {'s' if seconds else 'µs'} per "
          f"{'run' if per == 1 else 'step'} (total {total * scale:{unit}})")
    for kind, us in sorted(by_kind.items(), key=lambda x: -x[1]):
        print(f"  {kind:<20} {us * scale:10{unit}} {us / total:6.1%}  ({calls[kind] / per:,.0f} kernels)")
    print("  the longest kernels:")
    for name, (n, us) in sorted(times.items(), key=lambda x: -x[1][1])[:8]:
        print(f"    {us * scale:10{unit}} ({n / per:,.0f} calls) {name[:80]}")
    return total * scale


def profile(llm: LLM, prompts, params, bandwidth: float, peak: float) -> None:
    """Where the GPU's time goes (torch.profiler, kernels grouped by kind): over the workload's
    run, against each part's bound; then over batch-1 and batch-8 decode steps, against the
    step's wall time and its CUDA graph replayed alone."""
    import triton.testing
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    engine, walls = llm.llm_engine, []
    graphs = getattr(getattr(engine.model_executor, "graph_runner", None), "graphs", {})
    if not {1, 8} <= set(graphs):
        raise SystemExit("--mode profile needs the decode CUDA graphs of batch 1 and 8: one GPU (--tp 1), "
                         "no --enforce-eager, --max-num-seqs >= 8")
    for _ in range(2):   # the first warms up; the second is timed without the profiler
        llm.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    llm.reset_prefix_cache()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    total = print_kernels(kernel_times(prof), 1, "the workload", seconds=True)
    parts = roofline_parts(engine.config.hf_config, [len(p) for p in prompts], [p.max_tokens for p in params],
                           engine.config.torch_dtype.itemsize)
    print(f"kernels {total:.3f} s of an unprofiled run's {walls[-1]:.3f} s; bounds: the matmuls' "
          f"FLOPs {parts['matmul flops'] / peak:.3f} s, the weights once per decode step "
          f"{parts['weight bytes'] / bandwidth:.3f} s, the K/V reads {parts['kv bytes'] / bandwidth:.3f} s")
    for batch in (1, 8):
        decode_steps = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        for i in range(batch):
            prompt = [(7 * t + i) % 5000 + 10 for t in range(512)]
            engine.add_request(f"profile-{batch}-{i}", prompt, decode_steps)
        for _ in range(60):   # the prefill and some decode steps
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e4   # µs per step
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(100):
                engine.step()
            torch.cuda.synchronize()
        while engine.has_unfinished_requests():
            engine.step()
        kernels_us = print_kernels(kernel_times(prof), 100, f"batch {batch}, decode steps")
        graph_us = 1e3 * triton.testing.do_bench(graphs[batch].replay, return_mode="median")
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                graphs[batch].replay()
            torch.cuda.synchronize()
        in_graph = sum(us for _, us in kernel_times(prof).values()) / 20
        print(f"batch {batch}: a step's wall {wall:.0f} µs (unprofiled), its kernels {kernels_us:.0f} µs "
              f"(no kernel running: {wall - kernels_us:.0f} µs); its forward's CUDA graph alone "
              f"{graph_us:.0f} µs, of which kernels {in_graph:.0f} and gaps between them "
              f"{graph_us - in_graph:.0f}; kernels outside the graph (LM head, sampling, copies) "
              f"{kernels_us - in_graph:.0f} µs")


def main():
    parser = argparse.ArgumentParser(description="nanoinfer throughput benchmark")
    parser.add_argument("--model", default=None, help="HF model folder (default: --model-shape, random weights)")
    parser.add_argument("--model-shape", choices=list(MODEL_SHAPES), default="qwen3-0.6b",
                        help="the shape of the random-weight model used without --model")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--event-log", default=None, metavar="PATH",
                        help="record the engine core's event log there (its cost: against a run without)")
    parser.add_argument("--no-async-scheduling", action="store_true", help="wait for each step's tokens")
    parser.add_argument("--runs", type=int, default=None, help="timed runs of the workload (default: 3 on a GPU)")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--mode", default="throughput",
                        choices=["throughput", "latency", "kernels", "serve", "profile"])
    parser.add_argument("--input-len", type=int, default=512, help="latency mode: prompt length")
    parser.add_argument("--output-len", type=int, default=256, help="latency mode: output length")
    parser.add_argument("--speculative-config", type=json.loads, default=None, help="as LLM's, in JSON")
    parser.add_argument("--force-repeat", action="store_true", help="a random-weight shape that repeats itself")
    parser.add_argument("--workload", choices=["random", "copy", "fixed"], default="random",
                        help="copy: prompts asking a real model (--model) to rewrite a passage; "
                             "fixed (serve mode): --input-len and --output-len tokens each")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder for a random-weight shape")
    parser.add_argument("--guided-json", nargs="?", const="", default=None,
                        help="every request follows a JSON schema: this file's, or (no value) a typical one")
    parser.add_argument("--url", default=None, help="serve mode: a running server (default: start one)")
    parser.add_argument("--request-rate", default="inf", help="serve mode: requests per second, or a list: 4,8,inf")
    parser.add_argument("--max-concurrency", type=int, default=None, help="serve mode: requests in flight at most")
    parser.add_argument("--slo-ttft-ms", type=float, default=500, help="serve mode: goodput's time to first token")
    parser.add_argument("--slo-tpot-ms", type=float, default=50, help="serve mode: goodput's time per output token")
    parser.add_argument("--dp", type=int, default=1, help="serve mode: data_parallel_size of the server started")
    parser.add_argument("--disagg", action="store_true",
                        help="serve mode: a prefill server (GPU 0) and a decode server (GPU 1) behind the proxy")
    args = parser.parse_args()
    if args.runs is None:
        args.runs = 3 if torch.cuda.is_available() else 1

    on_gpu = torch.cuda.is_available()
    if args.mode in ("kernels", "profile") and not on_gpu:
        raise SystemExit(f"--mode {args.mode} needs a CUDA GPU")
    if args.mode == "kernels":
        return kernels()
    if not on_gpu and args.mode == "latency":
        print("No CUDA device: latency scaled down to 64 prompt and 8 output tokens.")
        args.input_len, args.output_len = 64, 8
    elif not on_gpu:
        print("No CUDA device: scaled down to 8 prompts of <= 256 tokens and <= 32 output tokens on "
              f"{CPU_LAYERS} of the model's layers, one run (about 35 s of CPU time). CPU numbers say "
              "nothing about GPU throughput.")
        args.num_seqs, args.max_input_len, args.max_output_len = 8, 256, 32
    kwargs = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  enforce_eager=args.enforce_eager, async_scheduling=not args.no_async_scheduling,
                  tensor_parallel_size=args.tp, speculative_config=args.speculative_config,
                  max_model_len=args.max_input_len + args.max_output_len, event_log=args.event_log)
    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix="nanoinfer-bench-")
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(MODEL_SHAPES[args.model_shape] | ({} if on_gpu else {"num_hidden_layers": CPU_LAYERS}), f)
        kwargs.update(load_format="dummy", skip_tokenizer_init=args.tokenizer is None)
        for name in os.listdir(args.tokenizer) if args.tokenizer else ():
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy(os.path.join(args.tokenizer, name), model)
    if args.mode == "latency":   # (copy prompts are about 180 tokens)
        kwargs["max_model_len"] = max(args.input_len, 512 if args.workload == "copy" else 0) + args.output_len
    if args.mode == "serve":
        prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len)
        if args.workload == "fixed":   # every prompt --input-len tokens, every output --output-len
            rng = random.Random(0)
            prompts = [[rng.randint(0, 10000) for _ in range(args.input_len)] for _ in prompts]
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.output_len) for _ in prompts]
            kwargs["max_model_len"] = args.input_len + args.output_len + 1
        procs, url = [], args.url
        if url is None and args.disagg:
            procs, url = start_disaggregated(model, kwargs)
        elif url is None:
            proc, url = start_server(model, kwargs, args.dp)
            procs = [proc]
        try:
            return serve(url, prompts, params, [float(r) for r in args.request_rate.split(",")],
                         args.max_concurrency, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3,
                         server_steps=not args.disagg)
        finally:
            for proc in reversed(procs):
                proc.send_signal(signal.SIGINT)
                proc.wait()
    bandwidth = peak = gpu_name = None
    if on_gpu:   # in a process of its own: this one then holds no GPU memory beside the engine's
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            bandwidth, peak, gpu_name = pool.submit(measure_gpu_limits).result()
        bandwidth, peak = args.tp * bandwidth, args.tp * peak   # each GPU moves and computes its shard
    start = time.perf_counter()
    llm = LLM(model, **kwargs)
    print(f"engine start-up (weights, KV cache{', CUDA graphs' * on_gpu}): {time.perf_counter() - start:.1f} s")
    if args.force_repeat:
        if args.model is not None or args.tp != 1:
            raise SystemExit("--force-repeat is for the random-weight shapes at --tp 1")
        for name, param in llm.llm_engine.model_executor.model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.data.zero_()   # in place: the CUDA graphs read the same memory
    if args.mode == "latency":
        return latency(llm, args.input_len, args.output_len, bandwidth, copy=args.workload == "copy")

    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    if args.workload == "copy":   # greedy, as rewriting usually is
        prompts = copy_prompts(llm.get_tokenizer(), args.num_seqs, 0)
        params = [SamplingParams(temperature=0, max_tokens=p.max_tokens) for p in params]   # ends at EOS
    if args.guided_json is not None:   # (with ignore_eos a finished grammar allows EOS alone: same lengths)
        schema = TYPICAL_SCHEMA
        if args.guided_json:
            with open(args.guided_json) as f:
                schema = json.load(f)
        guided = GuidedDecodingParams(json=schema)
        params = [dataclasses.replace(p, guided_decoding=guided) for p in params]
    if args.mode == "profile":
        return profile(llm, prompts, params, bandwidth, peak)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    output_lens = [p.max_tokens for p in params]
    if args.workload == "copy":   # the tokens a run makes (greedy: the same in every run)
        output_lens = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    output_tokens = sum(output_lens)
    input_tokens = sum(len(p) for p in prompts)
    here = on_gpu and args.tp == 1   # the GPU work is in this process (else in the ranks' workers)
    timer, times = StepTimer(llm.llm_engine, here), []
    for run in range(args.runs):
        llm.reset_prefix_cache()   # every run starts cold, as the first did
        if here:
            torch.cuda.synchronize()
        compiled = triton_variants()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if here:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        stalls = triton_variants() - compiled if here and compiled is not None else {}
        print(f"run {run + 1}: {rate(output_tokens / times[-1])} output tok/s" + bool(stalls) * (
            " (Triton compiled during it: " + ", ".join(f"{n} x {k}" for k, n in stalls.items()) + ")"))
    elapsed = statistics.median(times)
    runs = f"median of {args.runs} runs" if args.runs > 1 else "1 run"
    print(f"{args.num_seqs} seqs, {input_tokens} input + {output_tokens} output tokens in {elapsed:.2f} s "
          f"({runs}): {rate(output_tokens / elapsed)} output tok/s, "
          f"{rate((input_tokens + output_tokens) / elapsed)} total tok/s")
    if args.runs > 1:   # what a user who runs the workload once gets
        print(f"first run: {rate(output_tokens / times[0])} output tok/s, "
              f"{times[0] / elapsed - 1:+.1%} time against the median")
    if on_gpu:
        cfg = llm.llm_engine.config.hf_config
        dtype_bytes = llm.llm_engine.config.torch_dtype.itemsize
        bytes_moved, flops = roofline(cfg, [len(p) for p in prompts], output_lens, dtype_bytes)
        bound = max(bytes_moved / bandwidth, flops / peak)
        print(f"roofline on {args.tp} x {gpu_name}: {bytes_moved / 1e12:.2f} TB at "
              f"{bandwidth / 1e12:.2f} TB/s = {bytes_moved / bandwidth:.2f} s; {flops / 1e12:.0f} TFLOP at "
              f"{peak / 1e12:.0f} TFLOP/s = {flops / peak:.2f} s; bound {output_tokens / bound:,.0f} output tok/s; "
              f"achieved {bound / elapsed:.1%} of it")
    print(timer.report())
    print_spec_stats(llm.llm_engine)


def rate(x: float) -> str:
    """A throughput: whole numbers, unless it is small (a CPU run's)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


if __name__ == "__main__":
    main()
