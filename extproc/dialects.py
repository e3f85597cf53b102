"""Engine metrics dialects: each engine's Prometheus names for what admission reads, as data.

A dialect is a table (`Dialect`, frozen): the families for running requests, waiting requests and
KV-cache usage, where the KV capacity and block size come from, the optional counters, and the
label conventions (the label that names a data-parallel rank). `enginemetrics.parse_engine_metrics`
reads any exposition through one of these tables and nothing else names an engine's families, so
a new engine is a new `Dialect` here (plus its row in `DIALECTS`), not new parsing code.

Aggregation is the same for every dialect: running and waiting are SUMMED over the series (one per
rank), KV usage is the MAX over them (the fullest rank decides). KV usage is always a FRACTION
0..1 in all three engines, whatever the name says (`vllm:kv_cache_usage_perc` included).

Capacity (KV tokens for the budget) comes in three shapes, `capacity`:
- `info`: an info gauge whose labels carry blocks and block size (vLLM `vllm:cache_config_info`
  `num_gpu_blocks` x `block_size`). vLLM writes the SAME all-ranks total on every rank's line, so
  it is read from one line, never summed.
- `tokens`: a gauge in tokens, one per rank, SUMMED (SGLang `sglang:max_total_num_tokens`: each
  data-parallel rank has its own pool); the block size is `fixed_block_size` (SGLang's default
  page size, 1).
- `blocks`: a gauge of blocks times a gauge of tokens per block (trtllm-serve
  `trtllm_kv_cache_max_blocks` x `trtllm_kv_cache_tokens_per_block`).
An engine that shows none of its capacity families has no capacity: the KV budget falls back to
the configured `kv_capacity_tokens`, else is inactive, exactly as for a vLLM without
`cache_config_info`. A counter a dialect lacks is None: its reading is None, as for a vLLM that
does not expose it.

Names, verified (2026-11) against the engines' sources and docs:
- vLLM: v1/metrics/loggers.py (PrometheusStatLogger) and config/cache.py (metrics_info); the
  rank label is `engine`; see DESIGN.md "Facts about the engine gauges".
- SGLang: python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector:
  `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`,
  `sglang:max_total_num_tokens` "Maximum total number of tokens in the KV cache pool"; token
  counters `sglang:prompt_tokens_total`, `sglang:generation_tokens_total`) and
  docs/references/production_metrics.md (docs.sglang.io). Labels `model_name`, `engine_type`,
  `tp_rank`, `pp_rank`, plus `dp_rank` with DP attention; scheduler gauges are written by each
  DP group's attention-TP rank 0 only, so one series per DP rank. No per-request generation
  histogram that admission reads: None.
- trtllm-serve: tensorrt_llm/metrics/collector.py (MetricsCollector, prefix `trtllm_`):
  `trtllm_num_requests_running` (numActiveRequests), `trtllm_num_requests_waiting`
  (numQueuedRequests), `trtllm_kv_cache_utilization` (usedNumBlocks / maxNumBlocks, a
  fraction), `trtllm_kv_cache_max_blocks`, `trtllm_kv_cache_tokens_per_block`,
  `trtllm_prompt_tokens_total`, `trtllm_generation_tokens_total` (recent releases; 1.1.0rc5
  had neither). Labels `model_name`, `engine_type`; no rank label (with attention DP the
  exporter reports rank 0 only). No per-request generation histogram: None. The same
  names are llm-d's built-in `trtllm-serve` engine config (pkg/epp/.../metrics, defaultEngineConfigs).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

#: What an engine's `dialect` may be set to; `auto` detects it from the first exposition.
AUTO = "auto"


@dataclass(frozen=True)
class Dialect:
    """One engine's names for the families admission reads."""

    name: str
    running: str  # gauge: requests running, one series per rank
    waiting: str  # gauge: requests waiting inside the engine
    kv_usage: str  # gauge: KV-cache usage as a FRACTION 0..1
    kv_usage_fallback: str | None = None  # an older name, read only when `kv_usage` is absent
    rank_label: str | None = None  # the label naming a data-parallel rank (None: one series)
    model_label: str = "model_name"
    capacity: str | None = None  # info | tokens | blocks | None (see the module docstring)
    capacity_info: str | None = None  # capacity == info: the info gauge ...
    capacity_blocks_label: str | None = None  # ... its label with the number of blocks
    block_size_label: str | None = None  # ... and its label with the tokens per block
    capacity_tokens: str | None = None  # capacity == tokens: the gauge in tokens (summed over ranks)
    fixed_block_size: int | None = None  # capacity == tokens: the engine's block (page) size
    capacity_blocks: str | None = None  # capacity == blocks: the gauge of blocks ...
    block_size_gauge: str | None = None  # ... and the gauge of tokens per block
    prompt_tokens: str | None = None  # counter sample: prompt tokens processed
    generation_tokens: str | None = None  # counter sample: tokens generated
    generated_sum: str | None = None  # histogram _sum: tokens generated by finished requests
    generated_count: str | None = None  # histogram _count: finished requests
    generated_buckets: str | None = None  # histogram _bucket: finished requests by generation length (`le`)
    prefix_hits: str | None = None  # counter sample: prompt tokens found in the prefix cache
    prefix_queries: str | None = None  # counter sample: prompt tokens looked up in it
    preemptions: str | None = None  # counter sample: requests preempted
    # Histogram _sum samples over finished requests, observed together at each finish: their prompt
    # tokens, and the seconds they spent prefilling and decoding (the gate's direct rates).
    prompt_sum: str | None = None
    prefill_time_sum: str | None = None
    decode_time_sum: str | None = None
    recent_families: tuple[str, ...] = ()  # families only recent releases write (`extproc check`)
    # Derived once, for the parser that runs every poll.
    wanted: re.Pattern[str] = field(init=False, repr=False, compare=False)
    counters: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.capacity not in (None, "info", "tokens", "blocks"):
            raise ValueError(f"dialect {self.name}: capacity must be info, tokens, blocks or None")
        counters = {sample: role for role, sample in (
            ("prompt_tokens_total", self.prompt_tokens), ("generation_tokens_total", self.generation_tokens),
            ("generated_sum", self.generated_sum), ("generated_count", self.generated_count),
            ("prefix_hits", self.prefix_hits), ("prefix_queries", self.prefix_queries),
            ("preemptions", self.preemptions), ("prompt_sum", self.prompt_sum),
            ("prefill_time_sum", self.prefill_time_sum), ("decode_time_sum", self.decode_time_sum)) if sample}
        object.__setattr__(self, "counters", counters)
        object.__setattr__(self, "wanted", _lines_of(self.samples))

    @property
    def samples(self) -> tuple[str, ...]:
        """Every sample name the parser reads, required first."""
        names = (self.running, self.waiting, self.kv_usage, self.kv_usage_fallback, self.capacity_info,
                 self.capacity_tokens, self.capacity_blocks, self.block_size_gauge, self.generated_buckets,
                 *self.counters)
        return tuple(n for n in names if n)

    @property
    def required(self) -> tuple[str, str, str]:
        return (self.running, self.waiting, self.kv_usage)

    @property
    def capacity_families(self) -> tuple[str, ...]:
        """The families the capacity is read from (empty: the engine never says)."""
        return tuple(n for n in (self.capacity_info, self.capacity_tokens, self.capacity_blocks,
                                 self.block_size_gauge) if n)

    def capacity_source(self) -> str:
        """How the capacity is computed, for logs and `extproc check`."""
        if self.capacity == "info":
            return f"{self.capacity_info} ({self.capacity_blocks_label} x {self.block_size_label})"
        if self.capacity == "tokens":
            return f"{self.capacity_tokens} (tokens, summed over ranks)"
        if self.capacity == "blocks":
            return f"{self.capacity_blocks} x {self.block_size_gauge}"
        return "none (this engine exposes no KV capacity)"


def _lines_of(samples: tuple[str, ...]) -> re.Pattern[str]:
    """One regex for the lines of these samples (and their HELP/TYPE), common prefix factored out."""
    prefix = os.path.commonprefix(list(samples))
    rest = "|".join(re.escape(s[len(prefix):]) for s in sorted(samples, key=len, reverse=True))
    return re.compile(rf"^(?:# (?:HELP|TYPE) )?{re.escape(prefix)}(?:{rest})[{{ ].*$", re.MULTILINE)


VLLM = Dialect(
    name="vllm",
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage="vllm:kv_cache_usage_perc",
    kv_usage_fallback="vllm:gpu_cache_usage_perc",  # before vLLM 0.11
    rank_label="engine",
    capacity="info",
    capacity_info="vllm:cache_config_info",
    capacity_blocks_label="num_gpu_blocks",
    block_size_label="block_size",
    prompt_tokens="vllm:prompt_tokens_total",
    generation_tokens="vllm:generation_tokens_total",
    generated_sum="vllm:request_generation_tokens_sum",
    generated_count="vllm:request_generation_tokens_count",
    generated_buckets="vllm:request_generation_tokens_bucket",
    # Counters since vLLM 0.10 (V1); absent from 0.11's exposition of the simulator's legacy profile.
    prefix_hits="vllm:prefix_cache_hits_total",
    prefix_queries="vllm:prefix_cache_queries_total",
    preemptions="vllm:num_preemptions_total",
    prompt_sum="vllm:request_prompt_tokens_sum",
    prefill_time_sum="vllm:request_prefill_time_seconds_sum",
    decode_time_sum="vllm:request_decode_time_seconds_sum",
    recent_families=("vllm:num_requests_waiting_by_reason", "vllm:engine_sleep_state"),
)

SGLANG = Dialect(
    name="sglang",
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage="sglang:token_usage",
    rank_label="dp_rank",
    capacity="tokens",
    capacity_tokens="sglang:max_total_num_tokens",
    fixed_block_size=1,
    prompt_tokens="sglang:prompt_tokens_total",
    generation_tokens="sglang:generation_tokens_total",
)

TRTLLM = Dialect(
    name="trtllm",
    running="trtllm_num_requests_running",
    waiting="trtllm_num_requests_waiting",
    kv_usage="trtllm_kv_cache_utilization",
    capacity="blocks",
    capacity_blocks="trtllm_kv_cache_max_blocks",
    block_size_gauge="trtllm_kv_cache_tokens_per_block",
    prompt_tokens="trtllm_prompt_tokens_total",
    generation_tokens="trtllm_generation_tokens_total",
)

#: Every dialect by name, in auto-detection order.
DIALECTS: dict[str, Dialect] = {d.name: d for d in (VLLM, SGLANG, TRTLLM)}

#: The values an engine's `dialect` setting accepts.
CHOICES: tuple[str, ...] = (*DIALECTS, AUTO)


_RUNNING_SAMPLE = {d.name: re.compile(rf"^{re.escape(d.running)}[{{ ]", re.MULTILINE) for d in DIALECTS.values()}
_RUNNING_DECLARED = {d.name: re.compile(rf"^# TYPE {re.escape(d.running)} ", re.MULTILINE) for d in DIALECTS.values()}


def detect(text: str) -> Dialect | None:
    """The dialect whose running-requests samples the exposition carries, or None; failing that, the
    one that declares them without a sample yet (vLLM with data parallelism before any rank has served)."""
    for patterns in (_RUNNING_SAMPLE, _RUNNING_DECLARED):
        for dialect in DIALECTS.values():
            if patterns[dialect.name].search(text):
                return dialect
    return None
