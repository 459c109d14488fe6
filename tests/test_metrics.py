"""The server's /metrics counted as vLLM counts them, checked the way vLLM's own server test does
(tests/entrypoints/openai/test_metrics.py): send N requests of a known prompt length and
max_tokens, scrape before and after, and compare each family's change with what vLLM expects."""
import httpx
import pytest

pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_server import start_server, stop_server  # noqa: E402

PROMPT = list(range(5, 14))   # 9 tokens, as vLLM's test prompt
BLOCK_SIZE, NUM_BLOCKS = 8, 200


@pytest.fixture(scope="module")
def server(llama_dir):
    """A fresh server: the module's first test sees its first requests."""
    proc, url = start_server(llama_dir, "--block-size", str(BLOCK_SIZE),
                             "--num-kvcache-blocks", str(NUM_BLOCKS))
    yield url
    stop_server(proc)


def scrape(url: str) -> dict[str, float]:
    """{sample name: its value summed over the samples of model "tiny"}"""
    totals = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.labels.get("model_name") == "tiny":
                totals[s.name] = totals.get(s.name, 0) + s.value
    return totals


def expected(num_requests: int, num_prompt_tokens: int, max_tokens: int) -> dict[str, float]:
    """vLLM's test's expectations (_get_expected_values), as changes of each sample."""
    n, p, t = num_requests, num_prompt_tokens, max_tokens
    return {"vllm:prompt_tokens_total": n * p, "vllm:generation_tokens_total": n * t,
            "vllm:request_success_total": n,
            # one step per token; the prompt counts in the first
            "vllm:iteration_tokens_total_sum": n * (p + t),
            "vllm:iteration_tokens_total_count": n * t,
            "vllm:request_prompt_tokens_sum": n * p, "vllm:request_prompt_tokens_count": n,
            "vllm:request_generation_tokens_sum": n * t,
            "vllm:request_generation_tokens_count": n,
            "vllm:request_params_n_sum": n, "vllm:request_params_n_count": n,
            "vllm:request_params_max_tokens_sum": n * t,
            "vllm:request_params_max_tokens_count": n,
            **{f"vllm:{name}_count": n for name in (
                "time_to_first_token_seconds", "e2e_request_latency_seconds",
                "request_queue_time_seconds", "request_inference_time_seconds",
                "request_prefill_time_seconds", "request_decode_time_seconds")}}


def test_counts_match_vllms_from_a_fresh_server_on(server):
    """Requests one after another, as vLLM's test sends them: the first round on a fresh server
    (its first steps must count too), the second on a warm one whose prefix cache holds the
    prompt's first block (a cached prompt still counts whole, as in vLLM)."""
    num_requests, max_tokens = 6, 5
    for _ in range(2):
        before = scrape(server)
        for _ in range(num_requests):
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens,
                    "ignore_eos": True}
            usage = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["usage"]
            assert usage["completion_tokens"] == max_tokens
        after = scrape(server)
        for name, value in expected(num_requests, len(PROMPT), max_tokens).items():
            assert after.get(name, 0) - before.get(name, 0) == value, name


def test_n_and_max_tokens_are_observed_per_request(server):
    before = scrape(server)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "n": 2, "ignore_eos": True}
    assert httpx.post(server + "/v1/completions", json=body, timeout=60).status_code == 200
    after = scrape(server)
    grew = {name: after[name] - before.get(name, 0) for name in after}
    assert grew["vllm:request_params_n_sum"] == 2 and grew["vllm:request_params_n_count"] == 1
    assert grew["vllm:request_params_max_tokens_sum"] == 3
    # each sample is a sequence: its prompt and its tokens count (vLLM: a child request each)
    assert grew["vllm:generation_tokens_total"] == 6 and grew["vllm:prompt_tokens_total"] == 18
    assert grew["vllm:iteration_tokens_total_sum"] == 18 + 6
    assert grew["vllm:request_generation_tokens_sum"] == 6
    # vLLM's buckets: 1, 2, 5, 10, ... up to max_model_len (512); n: 1, 2, 5, 10, 20
    buckets = {s.labels["le"] for f in text_string_to_metric_families(
        httpx.get(server + "/metrics").text) for s in f.samples
        if s.name == "vllm:request_params_max_tokens_bucket"}
    assert buckets == {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0",
                       "+Inf"}


def test_cache_config_info_has_vllms_labels(server):
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(server + "/metrics").text)}
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge" and len(info.samples) == 1
    assert info.samples[0].value == 1
    assert info.samples[0].labels == {
        "block_size": str(BLOCK_SIZE), "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9", "num_gpu_blocks": str(NUM_BLOCKS),
        "num_gpu_blocks_override": str(NUM_BLOCKS), "engine": "0"}
