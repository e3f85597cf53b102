"""The ``vllm:*`` Prometheus exposition, as vLLM 0.11 writes it.

Names, HELP strings, types, buckets and label names are copied from vLLM 0.11.0's
``vllm/v1/metrics/loggers.py`` (PrometheusStatLogger) and ``vllm/config/cache.py``
(CacheConfig.metrics_info). Rules that matter to scrapers:

- Every per-engine series has labels ``model_name`` and ``engine`` (the DP rank as a
  string); prometheus_client writes labels sorted, so lines read ``{engine="0",model_name=...}``.
  vLLM creates the labelled children up front, so every series exists (at 0) before the
  first request, including ``vllm:request_success_total`` for each finished_reason
  (stop, length, abort).
- Counters get ``_total`` and ``_created`` series (vLLM's single-API-server mode uses the
  default registry, not multiprocess mode).
- ``vllm:kv_cache_usage_perc`` is a fraction 0..1. The deprecated ``vllm:gpu_cache_usage_perc``
  and ``vllm:gpu_prefix_cache_*`` are hidden in 0.11 (shown only with
  --show-hidden-metrics-for-version=0.10), so they are absent here too.
- ``vllm:cache_config_info`` is a gauge set to 1 whose labels are every CacheConfig field
  as a string plus ``engine``; it has no ``model_name``.
- Gauges are published once per engine step (after the step's outputs are processed), as
  vLLM's scheduler stats are, not read live at scrape time.
- Counters follow vLLM's IterationStats: prompt tokens are counted once per request, at its
  first token; generation tokens as they are sampled. One deliberate difference: vLLM
  counts a preemption only when the preempted request next emits a token (the event rides
  on its next output); the simulator counts it in the step that preempted.

Metrics live on an injected ``CollectorRegistry``; there are no module-level metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from .scheduler import ScheduledStep, SchedulerConfig, SchedulerStats, StepOutput

__all__ = [
    "EngineMetrics",
    "GAUGE_FAMILIES",
    "build_1_2_5_buckets",
    "cache_config_labels",
]

LABELNAMES = ["model_name", "engine"]
FINISH_REASONS = ("stop", "length", "abort")  # str(FinishReason) in vLLM 0.11
GAUGE_FAMILIES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's build_1_2_5_buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def cache_config_labels(config: SchedulerConfig) -> dict[str, str]:
    """vLLM 0.11 CacheConfig.metrics_info(): every field, stringified, in field order.

    Values are those of a default ``vllm serve`` except the geometry, and
    ``enable_prefix_caching`` which is False because the simulator has no prefix cache.
    """
    return {
        "block_size": str(config.block_size),
        "gpu_memory_utilization": "0.9",
        "swap_space": "4.0",
        "cache_dtype": "auto",
        "is_attention_free": "False",
        "num_gpu_blocks_override": "None",
        "sliding_window": "None",
        "enable_prefix_caching": "False",
        "prefix_caching_hash_algo": "sha256",
        "cpu_offload_gb": "0.0",
        "calculate_kv_scales": "False",
        "cpu_kvcache_space_bytes": "None",
        "mamba_page_size_padded": "None",
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "num_gpu_blocks": str(config.num_gpu_blocks),
        "num_cpu_blocks": "None",
        "kv_sharing_fast_prefill": "False",
        "kv_cache_memory_bytes": "None",
        "swap_space_bytes": "4294967296.0",
    }


class _Without:
    """A collector view of a registry that drops some metric families."""

    def __init__(self, registry: CollectorRegistry, excluded: Iterable[str]) -> None:
        self._registry = registry
        self._excluded = frozenset(excluded)

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            if metric.name not in self._excluded:
                yield metric


class EngineMetrics:
    """vLLM's PrometheusStatLogger over N engine ranks, on a private registry."""

    def __init__(self, model_name: str, config: SchedulerConfig, engine_indexes: Sequence[int],
                 registry: CollectorRegistry | None = None,
                 process_collectors: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.engine_indexes = list(engine_indexes)
        if process_collectors:
            # vLLM serves the default registry, which carries these collectors first.
            GCCollector(registry=reg)
            PlatformCollector(registry=reg)
            ProcessCollector(registry=reg)
        max_model_len = config.max_model_len

        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(model_name, str(idx)) for idx in self.engine_indexes}

        def gauge(name: str, doc: str) -> dict[int, Any]:
            return per_engine(Gauge(name, doc, LABELNAMES, registry=reg))

        def counter(name: str, doc: str) -> dict[int, Any]:
            return per_engine(Counter(name, doc, LABELNAMES, registry=reg))

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> dict[int, Any]:
            return per_engine(Histogram(name, doc, LABELNAMES, registry=reg, buckets=buckets))

        self.running = gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting",
                             "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          LABELNAMES + ["finished_reason"], registry=reg)
        self.request_success = {
            reason: {idx: success.labels(model_name, str(idx), reason)
                     for idx in self.engine_indexes}
            for reason in FINISH_REASONS
        }
        len_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", len_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            len_buckets)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS)
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", len_buckets)
        self.params_n = histogram("vllm:request_params_n",
                                  "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            len_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds."
            "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", TPOT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.", TPOT_BUCKETS)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)

        info_labels = cache_config_labels(config)
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     list(info_labels) + ["engine"], registry=reg)
        for idx in self.engine_indexes:
            info.labels(**info_labels, engine=str(idx)).set(1)

        self.published: dict[int, SchedulerStats] = {
            idx: SchedulerStats(0, 0, 0.0, 0) for idx in self.engine_indexes}
        self.pins: dict[str, float | None] = {"running": None, "waiting": None, "kv_usage": None}
        self._apply_gauges()

    # -- recording ------------------------------------------------------------------------

    def publish(self, engine_idx: int, stats: SchedulerStats) -> None:
        """Set the scheduler gauges of one rank (vLLM does this after every step)."""
        self.published[engine_idx] = stats
        self._apply_gauges()

    def set_pins(self, running: float | None, waiting: float | None,
                 kv_usage: float | None) -> None:
        """Report these gauge values instead of the model's (None unpins)."""
        self.pins = {"running": running, "waiting": waiting, "kv_usage": kv_usage}
        self._apply_gauges()

    def _apply_gauges(self) -> None:
        pins = self.pins
        for idx, stats in self.published.items():
            running = pins["running"]
            waiting = pins["waiting"]
            kv_usage = pins["kv_usage"]
            self.running[idx].set(stats.num_running_reqs if running is None else running)
            self.waiting[idx].set(stats.num_waiting_reqs if waiting is None else waiting)
            self.kv_usage[idx].set(stats.kv_cache_usage if kv_usage is None else kv_usage)

    def record_step(self, engine_idx: int, step: ScheduledStep, output: StepOutput) -> None:
        """Fold one step's iteration stats into the counters and histograms."""
        idx = engine_idx
        self.preemptions[idx].inc(output.num_preemptions)
        self.prompt_tokens[idx].inc(output.num_prompt_tokens)
        self.generation_tokens[idx].inc(output.num_generation_tokens)
        self.iteration_tokens[idx].observe(output.num_prompt_tokens + output.num_generation_tokens)
        for ttft in output.time_to_first_tokens:
            self.ttft[idx].observe(ttft)
        for itl in output.inter_token_latencies:
            self.inter_token_latency[idx].observe(itl)
            self.time_per_output_token[idx].observe(itl)
        for done in output.finished:
            self.max_num_generation_tokens[idx].observe(done.num_generation_tokens)
            self.params_n[idx].observe(1)
            self.request_success[done.finish_reason][idx].inc()
            self.e2e[idx].observe(done.e2e_latency)
            self.queue_time[idx].observe(done.queued_time)
            self.prefill_time[idx].observe(done.prefill_time)
            self.inference_time[idx].observe(done.inference_time)
            self.decode_time[idx].observe(done.decode_time)
            self.request_prompt_tokens[idx].observe(done.num_prompt_tokens)
            self.request_generation_tokens[idx].observe(done.num_generation_tokens)
            self.request_time_per_output_token[idx].observe(done.mean_time_per_output_token)
            if done.max_tokens_param:
                self.params_max_tokens[idx].observe(done.max_tokens_param)

    # -- exposition -----------------------------------------------------------------------

    def exposition(self, *, without_gauges: bool = False) -> bytes:
        """Prometheus text format 0.0.4; optionally without the three scheduler gauges."""
        if without_gauges:
            return generate_latest(_Without(self.registry, GAUGE_FAMILIES))  # type: ignore[arg-type]
        return generate_latest(self.registry)
