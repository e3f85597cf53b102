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
  on its next output); the simulator's 0.11 profile counts it in the step that preempted.

Profile ``vllm-0.33`` (the default; ``vllm-0.11`` keeps the exposition above exactly) follows
vLLM 0.33.0's ``vllm/v1/metrics/loggers.py`` instead, family for family and in its order:

- ``vllm:estimated_{flops,read_bytes,write_bytes}_per_gpu`` counters come first (PerfMetricsProm
  creates them unconditionally; they stay 0 without ``--enable-mfu-metrics``).
- ``vllm:num_requests_waiting`` = capacity + deferred, and
  ``vllm:num_requests_waiting_by_reason{reason}``: ``capacity`` is SchedulerStats.num_waiting_reqs
  (waiting for a slot or KV), ``deferred`` is num_skipped_waiting_reqs (held back by LoRA budget,
  KV transfer or a blocked status). The simulator has none of those constraints, so ``deferred``
  is always 0 and ``capacity`` equals the waiting gauge.
- ``vllm:engine_sleep_state{sleep_state=awake|weights_offloaded|discard_all}``: 1/0/0 awake;
  asleep at level 1 is 0/1/0, level 2 0/0/1, level 0 (scheduling paused) 0/0/0. While asleep no
  step runs and no scheduler stats are recorded, so the scheduler gauges keep their last values.
- ``vllm:admission_rejections{model_name,reason}`` (no ``engine`` label: the API server counts
  them), reasons ``max_num_queued_reqs`` and ``max_num_queued_tokens``, both created at 0.
- ``vllm:num_preemptions`` sums ``StepOutput.num_preemptions``, whose timing the scheduler
  owns: in 0.33 the PREEMPTED event rides on the victim's next output, so a preemption counts
  in the step in which the victim next emits a token (never, if it is aborted first).
  ``vllm:request_num_preemptions`` observes each finished request's count.
- New zero-valued families the simulator has nothing to count for (external/mm caches, prompt
  tokens by source, cached prompt tokens) exist with their label sets, as in vLLM.
- ``vllm:time_per_output_token_seconds`` (deprecated in 0.11) is gone.
- ``vllm:cache_config_info`` carries 0.33's CacheConfig fields (``metrics_info`` dumps the
  instance ``__dict__``: every field in declaration order, then ``_block_size_resolved``), as
  the API server's copy holds them after start-up: ``enable_prefix_caching`` True,
  ``gpu_memory_utilization`` 0.92, the layout/hash fields the frontend never learns None.

Dialect (``--dialect``, default ``vllm``: the exposition above, byte for byte). ``sglang`` and
``trtllm`` serve the same engine state under those engines' names and label conventions instead
(``DIALECT_FAMILIES``; names as in extproc/dialects.py, which cites their sources):

- ``sglang``: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``
  (fraction), ``sglang:num_used_tokens``, ``sglang:max_total_num_tokens`` (the rank's KV pool in
  tokens: num_gpu_blocks x block_size, so the ranks add up to vLLM's total), counters
  ``sglang:prompt_tokens_total`` / ``sglang:generation_tokens_total``. Labels ``model_name``,
  ``engine_type`` (unified), ``tp_rank``, ``pp_rank``, and ``dp_rank`` with more than one rank.
- ``trtllm``: ``trtllm_num_requests_running``, ``trtllm_num_requests_waiting``,
  ``trtllm_kv_cache_utilization`` (fraction), ``trtllm_kv_cache_{max,used,free}_blocks``,
  ``trtllm_kv_cache_tokens_per_block``, ``trtllm_max_num_active_requests``, counters
  ``trtllm_prompt_tokens_total`` / ``trtllm_generation_tokens_total``. Labels ``model_name``,
  ``engine_type`` (trtllm); no rank label, so one rank only.
No process collectors, histograms or ``_created`` series there: the families a gate reads, and
the engine's own capacity and token counters. The vLLM registry still records everything
(``registry``); ``served`` is what ``/metrics`` renders.

Metrics live on an injected ``CollectorRegistry``; there are no module-level metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from .scheduler import ScheduledStep, SchedulerConfig, SchedulerStats, StepOutput

__all__ = [
    "ADMISSION_REASONS",
    "DEFAULT_PROFILE",
    "DIALECTS",
    "EngineMetrics",
    "PROFILES",
    "GAUGE_FAMILIES",
    "build_1_2_5_buckets",
    "cache_config_labels",
]

LABELNAMES = ["model_name", "engine"]
FINISH_REASONS = ("stop", "length", "abort")  # str(FinishReason) in vLLM 0.11
FINISH_REASONS_033 = ("stop", "length", "abort", "error", "repetition")  # FINISH_REASON_STRINGS
PROFILES = ("vllm-0.33", "vllm-0.11")
DEFAULT_PROFILE = "vllm-0.33"
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")  # loggers.py, 0.33
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
REQUEST_NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
GAUGE_FAMILIES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc")
DIALECTS = ("vllm", "sglang", "trtllm")
#: Each other dialect's (running, waiting, KV usage) families, what ``without_gauges`` drops.
DIALECT_FAMILIES = {
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
    "trtllm": ("trtllm_num_requests_running", "trtllm_num_requests_waiting", "trtllm_kv_cache_utilization"),
}

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


def cache_config_labels(config: SchedulerConfig, num_engines: int = 1) -> dict[str, str]:
    """vLLM 0.11 CacheConfig.metrics_info(): every field, stringified, in field order.

    Values are those of a default ``vllm serve`` except the geometry, and
    ``enable_prefix_caching`` which is False because the simulator has no prefix cache.
    ``num_gpu_blocks`` is the API server's CacheConfig after the engines' ready messages: their
    SUM over DP ranks (0.11 v1/engine/utils.py), written on every rank's line as in 0.33.
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
        "num_gpu_blocks": str(config.num_gpu_blocks * num_engines),
        "num_cpu_blocks": "None",
        "kv_sharing_fast_prefill": "False",
        "kv_cache_memory_bytes": "None",
        "swap_space_bytes": "4294967296.0",
    }


def cache_config_labels_033(config: SchedulerConfig, num_engines: int = 1) -> dict[str, str]:
    """vLLM 0.33 CacheConfig.metrics_info() as the API server exports it.

    ``{k: str(v) for k, v in self.__dict__.items()}`` over the pydantic dataclass: every field
    in declaration order (vllm/config/cache.py), then ``_block_size_resolved`` which its
    model validator sets. ``num_gpu_blocks`` is what the frontend holds after the engines'
    ready responses: their sum over DP ranks (core_client._apply_ready_response). The worker-
    side fields (kv_cache_layout, hash_block_size, ...) never reach the frontend: None.
    ``effective_attention_block_size`` is the block size of the (single, full-attention) KV
    group. The prefix-caching flag is 0.33's default, True.
    """
    return {
        "block_size": str(config.block_size),
        "user_specified_block_size": "False",
        "kv_cache_layout": "None",
        "prefix_match_unit": "None",
        "gpu_memory_utilization": "0.92",
        "cache_dtype": "auto",
        "is_attention_free": "False",
        "num_gpu_blocks_override": "None",
        "sliding_window": "None",
        "enable_prefix_caching": "True",
        "prefix_caching_hash_algo": "sha256",
        "prefix_cache_retention_interval": "0",
        "kv_cache_dtype_skip_layers": "[]",
        "mamba_page_size_padded": "None",
        "skip_page_size_padded": "None",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False",
        "replayssm_buffer_len": "16",
        "use_replayssm": "False",
        "use_kda_recoverssm": "False",
        "num_gpu_blocks": str(config.num_gpu_blocks * num_engines),
        "num_cpu_blocks": "None",
        "simple_cpu_offload_num_blocks": "None",
        "effective_attention_block_size": str(config.block_size),
        "kv_cache_size_tokens": "None",
        "kv_cache_max_concurrency": "None",
        "hash_block_size": "None",
        "cache_hit_alignment_tokens": "None",
        "kv_sharing_fast_prefill": "False",
        "swa_bounded_replay": "True",
        "kv_cache_memory_bytes": "None",
        "kv_offloading_size": "None",
        "kv_offloading_backend": "native",
        "_block_size_resolved": "True",
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
                 process_collectors: bool = True, profile: str | None = None,
                 dialect: str | None = None) -> None:
        if dialect is None:
            dialect = getattr(config, "dialect", None) or "vllm"
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
        if dialect == "trtllm" and len(list(engine_indexes)) != 1:
            raise ValueError("dialect trtllm has no rank label: one engine rank only")
        self.dialect = dialect
        self._config = config
        if profile is None:
            profile = getattr(config, "profile", None) or DEFAULT_PROFILE
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        self.profile = profile
        v033 = profile == "vllm-0.33"
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.engine_indexes = list(engine_indexes)
        self.model_name = model_name
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

        def per_engine_by(metric: Any, values: Sequence[str]) -> dict[str, dict[int, Any]]:
            return {value: {idx: metric.labels(model_name, str(idx), value)
                            for idx in self.engine_indexes} for value in values}

        if v033:
            # PerfMetricsProm (vllm/v1/metrics/perf.py) registers these before anything else.
            counter("vllm:estimated_flops_per_gpu_total",
                    "Estimated number of floating point operations per GPU "
                    "(for Model Flops Utilization calculations).")
            counter("vllm:estimated_read_bytes_per_gpu_total",
                    "Estimated number of bytes read from memory per GPU "
                    "(for Model Flops Utilization calculations).")
            counter("vllm:estimated_write_bytes_per_gpu_total",
                    "Estimated number of bytes written to memory per GPU "
                    "(for Model Flops Utilization calculations).")
        self.running = gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting",
                             "Number of requests waiting to be processed.")
        self.waiting_by_reason: dict[str, dict[int, Any]] = {}
        self.sleep_state: dict[str, dict[int, Any]] = {}
        if v033:
            self.waiting_by_reason = per_engine_by(Gauge(
                "vllm:num_requests_waiting_by_reason",
                "Number of waiting requests by reason. "
                "Reason labels: 'capacity' = waiting for scheduling capacity; "
                "'deferred' = deferred by transient constraints "
                "(LoRA budget, KV transfer, blocked status). "
                "Sum of all reasons equals vllm:num_requests_waiting.",
                LABELNAMES + ["reason"], registry=reg), WAITING_REASONS)
            self.sleep_state = per_engine_by(Gauge(
                "vllm:engine_sleep_state",
                "Engine sleep state; awake = 0 means engine is sleeping; "
                "awake = 1 means engine is awake; "
                "weights_offloaded = 1 means sleep level 1; "
                "discard_all = 1 means sleep level 2.",
                LABELNAMES + ["sleep_state"], registry=reg), SLEEP_STATES)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        if v033:
            counter("vllm:external_prefix_cache_queries",
                    "External prefix cache queries from KV connector "
                    "cross-instance cache sharing, in terms of number of queried tokens.")
            counter("vllm:external_prefix_cache_hits",
                    "External prefix cache hits from KV connector "
                    "cross-instance cache sharing, in terms of number of cached tokens.")
            counter("vllm:mm_cache_queries",
                    "Multi-modal cache queries, in terms of number of queried items.")
            counter("vllm:mm_cache_hits",
                    "Multi-modal cache hits, in terms of number of cached items.")
        self.preemptions = counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_by_source: dict[str, dict[int, Any]] = {}
        if v033:
            self.prompt_tokens_by_source = per_engine_by(Counter(
                "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                LABELNAMES + ["source"], registry=reg), PROMPT_TOKEN_SOURCES)
            counter("vllm:prompt_tokens_cached",
                    "Number of cached prompt tokens (local + external).")
            per_engine_by(Counter(
                "vllm:prompt_tokens_cached_by_source",
                "Prefix-cache hit tokens by the cache tier that supplied them: "
                "device (local HBM), host (offloaded to DRAM), disk, p2p "
                "(transferred from another vLLM instance) or "
                "external_unspecified. Counted at admission; sums to "
                "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
                LABELNAMES + ["source"], registry=reg), CACHE_HIT_SOURCES)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          LABELNAMES + ["finished_reason"], registry=reg)
        self.request_success = per_engine_by(
            success, FINISH_REASONS_033 if v033 else FINISH_REASONS)
        self.admission_rejections: dict[str, Any] = {}
        if v033:
            rejections = Counter(
                "vllm:admission_rejections",
                "Number of admission attempts rejected by a queue limit, by reason.",
                ["model_name", "reason"], registry=reg)
            self.admission_rejections = {
                reason: rejections.labels(model_name=model_name, reason=reason)
                for reason in ADMISSION_REASONS}
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
        self.time_per_output_token: dict[int, Any] = {}
        if not v033:
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

        self.request_num_preemptions: dict[int, Any] = {}
        self.prefill_kv_computed: dict[int, Any] = {}
        if v033:
            self.request_num_preemptions = histogram(
                "vllm:request_num_preemptions",
                "Histogram of the number of times a request was preempted.",
                REQUEST_NUM_PREEMPTIONS_BUCKETS)
            self.prefill_kv_computed = histogram(
                "vllm:request_prefill_kv_computed_tokens",
                "Histogram of new KV tokens computed during prefill "
                "(excluding cached tokens).", len_buckets)

        info_labels = (cache_config_labels_033(config, len(self.engine_indexes)) if v033
                       else cache_config_labels(config, len(self.engine_indexes)))
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     list(info_labels) + ["engine"], registry=reg)
        for idx in self.engine_indexes:
            info.labels(**info_labels, engine=str(idx)).set(1)

        # Token totals per rank, for the other dialects' counters.
        self.token_totals: dict[int, list[float]] = {idx: [0.0, 0.0] for idx in self.engine_indexes}
        self.served = reg
        if dialect != "vllm":
            self.served = CollectorRegistry()
            self.served.register(_DialectCollector(self))
        self.published: dict[int, SchedulerStats] = {
            idx: SchedulerStats(0, 0, 0.0, 0) for idx in self.engine_indexes}
        self.pins: dict[str, float | None] = {"running": None, "waiting": None, "kv_usage": None}
        # Each live request's preemption count, keyed (engine, request id), for
        # vllm:request_num_preemptions (0.33) when FinishedRequestStats does not carry it.
        self._request_preemptions: dict[tuple[int, str], int] = {}
        self.sleeping = False
        self.sleep_level = 0
        if v033:
            self.record_sleep_state(False, 0)
        self._apply_gauges()

    # -- recording ------------------------------------------------------------------------

    def publish(self, engine_idx: int, stats: SchedulerStats) -> None:
        """Set the scheduler gauges of one rank (vLLM does this after every step).

        While the engine sleeps (0.33) nothing is recorded: a sleeping vLLM engine runs no
        step and sends no SchedulerStats, so its gauges keep the values of its last step.
        """
        if self.sleeping:
            return
        self.published[engine_idx] = stats
        self._apply_gauges()

    def record_sleep_state(self, sleep: bool, level: int = 0) -> None:
        """vLLM 0.33 PrometheusStatLogger.record_sleep_state, on every rank."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
        self.sleeping = sleep
        self.sleep_level = level if sleep else 0
        if not self.sleep_state:
            return
        values = {"awake": 0 if sleep else 1,
                  "weights_offloaded": 1 if sleep and level == 1 else 0,
                  "discard_all": 1 if sleep and level == 2 else 0}
        for state, value in values.items():
            for idx in self.engine_indexes:
                self.sleep_state[state][idx].set(value)

    def record_admission_rejection(self, reason: str) -> None:
        """One request refused by the API server's queue limits (0.33)."""
        self.admission_rejections[reason].inc()

    def set_pins(self, running: float | None, waiting: float | None,
                 kv_usage: float | None) -> None:
        """Report these gauge values instead of the model's (None unpins)."""
        self.pins = {"running": running, "waiting": waiting, "kv_usage": kv_usage}
        self._apply_gauges()

    def gauge_values(self, idx: int) -> tuple[float, float, float]:
        """Running, waiting and KV usage of one rank as published (or pinned)."""
        stats, pins = self.published[idx], self.pins
        return (stats.num_running_reqs if pins["running"] is None else pins["running"],
                stats.num_waiting_reqs if pins["waiting"] is None else pins["waiting"],
                stats.kv_cache_usage if pins["kv_usage"] is None else pins["kv_usage"])

    def _apply_gauges(self) -> None:
        pins = self.pins
        for idx, stats in self.published.items():
            running = pins["running"]
            waiting = pins["waiting"]
            kv_usage = pins["kv_usage"]
            self.running[idx].set(stats.num_running_reqs if running is None else running)
            self.waiting[idx].set(stats.num_waiting_reqs if waiting is None else waiting)
            if self.waiting_by_reason:
                # Every waiting request waits for capacity: the simulator has no LoRA budget,
                # KV transfer or blocked status that would defer one.
                self.waiting_by_reason["capacity"][idx].set(
                    stats.num_waiting_reqs if waiting is None else waiting)
                self.waiting_by_reason["deferred"][idx].set(0)
            self.kv_usage[idx].set(stats.kv_cache_usage if kv_usage is None else kv_usage)

    def record_step(self, engine_idx: int, step: ScheduledStep, output: StepOutput) -> None:
        """Fold one step's iteration stats into the counters and histograms."""
        idx = engine_idx
        # The scheduler decides when a preemption is counted (enginesim.scheduler: in 0.33 the
        # step whose output carries the victim's next token); this only sums its figure.
        self.preemptions[idx].inc(output.num_preemptions)
        if self.request_num_preemptions:
            for request_id in step.preempted:
                key = (idx, request_id)
                self._request_preemptions[key] = self._request_preemptions.get(key, 0) + 1
        self.prompt_tokens[idx].inc(output.num_prompt_tokens)
        self.generation_tokens[idx].inc(output.num_generation_tokens)
        # vLLM counts a request's prefix-cache lookup when it is first scheduled (a resumed one goes to
        # the preempted-request stats, which it does not export); the legacy profile caches nothing.
        self.prefix_cache_queries[idx].inc(step.prefix_cache_queries)
        self.prefix_cache_hits[idx].inc(step.prefix_cache_hits)
        self.token_totals[idx][0] += output.num_prompt_tokens
        self.token_totals[idx][1] += output.num_generation_tokens
        self.iteration_tokens[idx].observe(output.num_prompt_tokens + output.num_generation_tokens)
        for ttft in output.time_to_first_tokens:
            self.ttft[idx].observe(ttft)
        for itl in output.inter_token_latencies:
            self.inter_token_latency[idx].observe(itl)
            if self.time_per_output_token:
                self.time_per_output_token[idx].observe(itl)
        if self.prompt_tokens_by_source:
            # No prefix cache or KV transfer is modelled: every prompt token is computed locally.
            self.prompt_tokens_by_source["local_compute"][idx].inc(output.num_prompt_tokens)
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
            if self.request_num_preemptions:
                own = self._request_preemptions.pop((idx, done.request_id), 0)
                self.request_num_preemptions[idx].observe(getattr(done, "num_preemptions", own))
                self.prefill_kv_computed[idx].observe(done.num_prompt_tokens)

    def forget(self, engine_idx: int, request_id: str) -> None:
        """Drop the bookkeeping of a request that ended without finishing (aborted)."""
        self._request_preemptions.pop((engine_idx, request_id), None)

    # -- exposition -----------------------------------------------------------------------

    def exposition(self, *, without_gauges: bool = False) -> bytes:
        """Prometheus text format 0.0.4; optionally without the three scheduler gauges."""
        if without_gauges:
            dropped = DIALECT_FAMILIES.get(self.dialect, GAUGE_FAMILIES)
            return generate_latest(_Without(self.served, dropped))
        return generate_latest(self.served)


class _DialectCollector:
    """The engine state under SGLang's or trtllm-serve's names, built at each scrape."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        config = m._config
        rank_tokens = config.num_gpu_blocks * config.block_size
        if m.dialect == "sglang":
            names = ["model_name", "engine_type", "tp_rank", "pp_rank"]
            many = len(m.engine_indexes) > 1
            if many:
                names.append("dp_rank")

            def labels(idx: int) -> list[str]:
                return [m.model_name, "unified", "0", "0"] + ([str(idx)] if many else [])

            families: list[tuple[Any, tuple[str, str], Any]] = [
                (GaugeMetricFamily, ("sglang:num_running_reqs", "The number of running requests."),
                 lambda idx: m.gauge_values(idx)[0]),
                (GaugeMetricFamily, ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
                 lambda idx: m.gauge_values(idx)[1]),
                (GaugeMetricFamily, ("sglang:token_usage", "The token usage."), lambda idx: m.gauge_values(idx)[2]),
                (GaugeMetricFamily, ("sglang:num_used_tokens", "The number of used tokens."),
                 lambda idx: round(m.gauge_values(idx)[2] * rank_tokens)),
                (GaugeMetricFamily, ("sglang:max_total_num_tokens",
                                     "Maximum total number of tokens in the KV cache pool."), lambda idx: rank_tokens),
                (CounterMetricFamily, ("sglang:prompt_tokens", "Number of prefill tokens processed."),
                 lambda idx: m.token_totals[idx][0]),
                (CounterMetricFamily, ("sglang:generation_tokens", "Number of generation tokens processed."),
                 lambda idx: m.token_totals[idx][1]),
            ]
        else:
            names = ["model_name", "engine_type"]

            def labels(idx: int) -> list[str]:
                return [m.model_name, "trtllm"]

            def used_blocks(idx: int) -> int:
                return round(m.gauge_values(idx)[2] * config.num_gpu_blocks)

            families = [
                (GaugeMetricFamily, ("trtllm_num_requests_running", "Number of active requests"),
                 lambda idx: m.gauge_values(idx)[0]),
                (GaugeMetricFamily, ("trtllm_num_requests_waiting", "Number of queued requests"),
                 lambda idx: m.gauge_values(idx)[1]),
                (GaugeMetricFamily, ("trtllm_kv_cache_utilization", "KV cache utilization"),
                 lambda idx: m.gauge_values(idx)[2]),
                (GaugeMetricFamily, ("trtllm_kv_cache_max_blocks", "Maximum number of KV cache blocks"),
                 lambda idx: config.num_gpu_blocks),
                (GaugeMetricFamily, ("trtllm_kv_cache_used_blocks", "Number of used KV cache blocks"), used_blocks),
                (GaugeMetricFamily, ("trtllm_kv_cache_free_blocks", "Number of free KV cache blocks"),
                 lambda idx: config.num_gpu_blocks - used_blocks(idx)),
                (GaugeMetricFamily, ("trtllm_kv_cache_tokens_per_block", "Number of tokens per KV cache block"),
                 lambda idx: config.block_size),
                (GaugeMetricFamily, ("trtllm_max_num_active_requests", "Maximum number of active requests"),
                 lambda idx: config.max_num_seqs),
                (CounterMetricFamily, ("trtllm_prompt_tokens", "Cumulative number of prompt (input) tokens processed."),
                 lambda idx: m.token_totals[idx][0]),
                (CounterMetricFamily, ("trtllm_generation_tokens",
                                       "Cumulative number of generation (output) tokens produced."),
                 lambda idx: m.token_totals[idx][1]),
            ]
        for kind, (name, doc), value in families:
            family = kind(name, doc, labels=names)
            for idx in m.engine_indexes:
                family.add_metric(labels(idx), float(value(idx)))
            yield family
