"""The server's Prometheus metrics, under vLLM's names and types, so that dashboards and
autoscalers built for vLLM read them as they are. Every metric has the labels `model_name` (the
served name) and `engine` (the core's data-parallel rank), except the info gauge.

    gauges      vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc;
                vllm:cache_config_info (1, labelled with vLLM's names of the cache settings:
                block_size, enable_prefix_caching, gpu_memory_utilization, num_gpu_blocks,
                num_gpu_blocks_override; and engine)
    counters    vllm:prompt_tokens, vllm:generation_tokens, vllm:request_success (finished_reason:
                stop, length, abort), vllm:num_preemptions, vllm:prefix_cache_queries,
                vllm:prefix_cache_hits, nanoinfer:aborted_seqs (sequences ended early: aborted,
                or by a stop string)
    gauges      nanoinfer:kv_connector_* (with a KV connector: blocks loaded, saved, bad, failed
                to save)
    histograms  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds (a request's
                mean, once it finishes), vllm:e2e_request_latency_seconds,
                vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds,
                vllm:request_decode_time_seconds, vllm:request_inference_time_seconds;
                vllm:request_prompt_tokens, vllm:request_generation_tokens (all its samples'),
                vllm:request_params_n, vllm:request_params_max_tokens (the max_tokens it ran
                with), each once per finished request, in buckets 1, 2, 5, 10, 20, 50, ...;
                vllm:iteration_tokens_total (tokens per engine step)

Tokens are counted as vLLM counts them, from the outputs of each step (IterationStats): a
sequence's prompt when its first token comes, then each token generated. So a step's
`iteration_tokens_total` is the prompts it completed plus the tokens it generated: a request of
P prompt tokens and T output tokens adds P + T over T steps.

The gauges and the cores' own counters are read from each core's last SchedulerStats when
Prometheus scrapes; the rest are recorded by AsyncLLM's `stat_logger` as outputs arrive.
"""
import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoinfer.engine.output_processor import IterationStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = tuple(2**i for i in range(16))
LABELS = ["model_name", "engine"]
GAUGE = GaugeMetricFamily
COUNTER = CounterMetricFamily
CORE_METRICS = [   # (family, name, help, the field of SchedulerStats)
    (GAUGE, "vllm:num_requests_running", "Requests running", "num_running"),
    (GAUGE, "vllm:num_requests_waiting", "Requests waiting", "num_waiting"),
    (GAUGE, "vllm:kv_cache_usage_perc", "KV-cache blocks in use (0-1)", "kv_cache_usage"),
    (COUNTER, "vllm:prefix_cache_queries", "Prompt tokens looked up", "prefix_cache_queries"),
    (COUNTER, "vllm:prefix_cache_hits", "Prompt tokens found cached", "prefix_cache_hits"),
    (COUNTER, "vllm:num_preemptions", "Preemptions", "num_preemptions"),
    (COUNTER, "nanoinfer:aborted_seqs", "Sequences ended early", "num_aborted_seqs")]
REQUEST_COUNTS = ["prompt_tokens", "generation_tokens", "params_n", "params_max_tokens"]
N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_TIMES = [   # (name, the interval of RequestMetrics it measures)
    ("time_to_first_token_seconds", "arrival_time", "first_token_time"),
    ("e2e_request_latency_seconds", "arrival_time", "finished_time"),
    ("request_queue_time_seconds", "arrival_time", "first_scheduled_time"),
    ("request_prefill_time_seconds", "first_scheduled_time", "first_token_time"),
    ("request_decode_time_seconds", "first_token_time", "last_token_time"),
    ("request_inference_time_seconds", "first_scheduled_time", "last_token_time")]


def buckets_1_2_5(largest: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `largest` (vLLM's buckets of token counts)."""
    return [m * 10**e for e in range(len(str(largest))) for m in (1, 2, 5) if m * 10**e <= largest]


class EngineCollector:
    """Each core's load, prefix cache and preemptions, read at scrape time."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        families = [(kind(name, doc, labels=LABELS), field)
                    for kind, name, doc, field in CORE_METRICS]
        connector = {}   # a KV connector's counts (gauges, as they may restart with a core)
        for rank, stats in enumerate(self.engine.client.stats):   # (each core's last)
            for family, field in families:
                family.add_metric([self.model_name, str(rank)], getattr(stats, field))
            for name, value in stats.kv_connector.items():
                connector.setdefault(name, GAUGE(f"nanoinfer:kv_connector_{name}",
                                                 name.replace("_", " "), labels=LABELS))
                connector[name].add_metric([self.model_name, str(rank)], value)
        yield from (family for family, _ in families)
        yield from connector.values()
        yield self.cache_config_info()

    def cache_config_info(self) -> GaugeMetricFamily:
        """vLLM's info gauge: 1, with each core's cache settings as labels (vLLM's names)."""
        c = self.engine.config
        cache = {"block_size": c.block_size, "enable_prefix_caching": c.enable_prefix_caching,
                 "gpu_memory_utilization": c.gpu_memory_utilization,
                 "num_gpu_blocks_override": c.num_kvcache_blocks}
        info = GAUGE("vllm:cache_config_info", "Information of the engine's cache config",
                     labels=[*cache, "num_gpu_blocks", "engine"])
        for rank, num_blocks in enumerate(self.engine.client.num_gpu_blocks):
            info.add_metric([*map(str, cache.values()), str(num_blocks), str(rank)], 1)
        return info


class ServerMetrics:

    def __init__(self, engine, model_name: str):
        self.registry = prom.CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineCollector(engine, model_name))
        def metric(kind, name: str, doc: str, labels=LABELS, **kwargs):
            return kind(name, doc, labels, registry=self.registry, **kwargs)
        self.prompt_tokens = metric(prom.Counter, "vllm:prompt_tokens", "Prompt tokens")
        self.generation_tokens = metric(prom.Counter, "vllm:generation_tokens", "Generated tokens")
        self.success = metric(prom.Counter, "vllm:request_success", "Finished requests",
                              LABELS + ["finished_reason"])
        self.times = {name: metric(prom.Histogram, f"vllm:{name}", name.replace("_", " "),
                                   buckets=LATENCY_BUCKETS) for name, _, _ in REQUEST_TIMES}
        self.itl = metric(prom.Histogram, "vllm:inter_token_latency_seconds", "Time between tokens",
                          buckets=LATENCY_BUCKETS)
        self.step_tokens = metric(prom.Histogram, "vllm:iteration_tokens_total",
                                  "Tokens per engine step", buckets=TOKEN_BUCKETS)
        sizes = buckets_1_2_5(engine.config.max_model_len)
        self.counts = {name: metric(prom.Histogram, f"vllm:request_{name}", name.replace("_", " "),
                                    buckets=N_BUCKETS if name == "params_n" else sizes)
                       for name in REQUEST_COUNTS}

    def record(self, rank: int, stats: IterationStats) -> None:
        """AsyncLLM's stat_logger: a step's outputs, or an aborted request finished alone."""
        labels = {"model_name": self.model_name, "engine": str(rank)}
        self.prompt_tokens.labels(**labels).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(**labels).inc(stats.num_generation_tokens)
        if num_step_tokens := stats.num_prompt_tokens + stats.num_generation_tokens:
            self.step_tokens.labels(**labels).observe(num_step_tokens)
        for state in stats.finished:
            reasons = [c.finish_reason for c in state.completions]
            reason = "abort" if None in reasons else reasons[0]
            self.success.labels(**labels, finished_reason=reason).inc()
            counts = {"prompt_tokens": len(state.prompt_token_ids), "params_n": len(reasons),
                      "generation_tokens": sum(len(c.token_ids) for c in state.completions),
                      "params_max_tokens": state.max_tokens}
            for name, count in counts.items():
                self.counts[name].labels(**labels).observe(count)
            m = state.metrics
            for name, start, end in REQUEST_TIMES:
                began, ended = getattr(m, start), getattr(m, end)
                if began is not None and ended is not None:
                    self.times[name].labels(**labels).observe(max(ended - began, 0))
            if m.num_generation_tokens > 1:
                self.itl.labels(**labels).observe((m.last_token_time - m.first_token_time) /
                                                  (m.num_generation_tokens - 1))

    def exposition(self) -> bytes:
        return prom.generate_latest(self.registry)
