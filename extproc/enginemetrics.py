"""Turn an engine's Prometheus text exposition into the few numbers admission needs.

vLLM exposes hundreds to thousands of lines (mostly histogram buckets); prometheus_client's text
parser costs ~15 us a line, so the document is first cut down, with one C-speed regex pass, to
the lines of the families we read, and only those are parsed. Facts relied on (DESIGN.md):
- `vllm:num_requests_running` / `vllm:num_requests_waiting` are gauges with one series per data
  parallel rank (label `engine`): summed.
- `vllm:kv_cache_usage_perc` is a FRACTION 0..1 despite its name (before vLLM 0.11:
  `vllm:gpu_cache_usage_perc`): the max over ranks is what decides admission.
- `vllm:cache_config_info` has value 1 and carries `num_gpu_blocks` and `block_size` as labels;
  capacity in tokens is their product. With data parallelism the API server SUMS the ranks'
  blocks into its one CacheConfig and writes that total on every rank's line (0.11
  v1/engine/utils.py, 0.33 v1/engine/core_client.py `_apply_ready_response`; loggers.py
  `log_metrics_info`), so it is read from one line, never summed again (that counted an N-rank
  engine N times). Other labels vary by version.

A document is trusted only if it parses COMPLETELY (anything less raises MetricsFormatError, which
the observer counts as a failed poll, reason `unparsable`, and the last good state is kept):
- it ends at a line boundary (the text format requires the last line to end with `\n`): a body
  cut inside `0.97` would otherwise read as `0.` = 0.0 and open the gate;
- running, waiting and KV usage are all present, for the same set of `engine` ranks (a body cut
  between two ranks' lines loses one of them), and so is `cache_config_info` (per rank, when it
  carries the `engine` label) whenever the caller says the engine has shown it before: vLLM
  writes it near the END of the document, so a body cut in half loses it, and that must not
  silently switch the KV budget off (`expect_capacity`);
- values are in range: KV usage in [0, 1], running and waiting finite, non-negative integers.
A capacity that CHANGES (the engine restarted with another cache size) is taken as it is.

Optional counters, summed over ranks, for what the engine has done rather than what it holds:
`vllm:prompt_tokens_total`, `vllm:generation_tokens_total` (throughput, and the estimate's
calibration) and the `vllm:request_generation_tokens` histogram's `_sum` and `_count` (how long
finished requests actually generated). None when the engine does not expose them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
GENERATED_SUM = "vllm:request_generation_tokens_sum"
GENERATED_COUNT = "vllm:request_generation_tokens_count"
_COUNTERS = (PROMPT_TOKENS, GENERATION_TOKENS, GENERATED_SUM, GENERATED_COUNT)

REQUIRED = (RUNNING, WAITING, KV_USAGE)

_WANTED = re.compile(
    r"^(?:# (?:HELP|TYPE) )?vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc"
    r"|gpu_cache_usage_perc|cache_config_info|prompt_tokens_total|generation_tokens_total"
    r"|request_generation_tokens_(?:sum|count))[{ ].*$",
    re.MULTILINE,
)


class MetricsFormatError(ValueError):
    """The document does not carry the gauges admission needs, complete and in range."""


@dataclass(frozen=True)
class EngineGauges:
    running: int
    waiting: int
    kv_usage: float
    capacity_tokens: int | None
    block_size: int | None
    ranks: int
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    generated_sum: float | None = None  # vllm:request_generation_tokens_sum: tokens of finished requests
    generated_count: float | None = None  # ...and how many finished


def parse_engine_metrics(text: str, *, expect_capacity: bool = False) -> EngineGauges:
    """Parse the gauges out of an exposition; raise MetricsFormatError naming what is wrong.

    `expect_capacity`: the engine has exposed `vllm:cache_config_info` before, so a document
    without it is incomplete (a truncated body), not an engine that stopped saying.
    """
    if text and not text.endswith("\n"):
        raise MetricsFormatError("truncated exposition: the document does not end with a newline")
    kept = "\n".join(_WANTED.findall(text))
    values: dict[str, list[float]] = {RUNNING: [], WAITING: [], KV_USAGE: [], KV_USAGE_LEGACY: []}
    ranks: dict[str, list[str | None]] = {RUNNING: [], WAITING: [], KV_USAGE: [], KV_USAGE_LEGACY: []}
    capacity = 0
    capacity_known = False
    capacity_ranks: list[str] = []
    block_size: int | None = None
    counters: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(kept + "\n" if kept else ""):
            for sample in family.samples:
                if sample.name in values:
                    values[sample.name].append(sample.value)
                    ranks[sample.name].append(sample.labels.get("engine"))
                elif sample.name in _COUNTERS:
                    if math.isfinite(sample.value) and sample.value >= 0:
                        counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
                elif sample.name == CACHE_CONFIG:
                    blocks, size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
                    if blocks and size and blocks.isdigit() and size.isdigit():
                        capacity = max(capacity, int(blocks) * int(size))  # the same total on every rank
                        capacity_known = True
                        block_size = int(size)
                        if "engine" in sample.labels:
                            capacity_ranks.append(sample.labels["engine"])
    except ValueError as exc:
        raise MetricsFormatError(f"unparsable exposition: {exc}") from None
    if not values[KV_USAGE]:
        values[KV_USAGE], ranks[KV_USAGE] = values[KV_USAGE_LEGACY], ranks[KV_USAGE_LEGACY]
    missing = [name for name in REQUIRED if not values[name]]
    if missing:
        raise MetricsFormatError(f"missing series: {', '.join(missing)}")
    for name in REQUIRED:
        if not all(math.isfinite(v) and v >= 0 for v in values[name]):
            raise MetricsFormatError(f"{name} has a negative or non-finite value")
    for name in (RUNNING, WAITING):
        if not all(v == int(v) for v in values[name]):
            raise MetricsFormatError(f"{name} has a non-integral value")
    if not all(v <= 1.0 for v in values[KV_USAGE]):
        raise MetricsFormatError(f"KV usage out of range [0, 1]: {max(values[KV_USAGE])}")
    rank_set = sorted(ranks[RUNNING], key=str)
    for name in (WAITING, KV_USAGE):
        if sorted(ranks[name], key=str) != rank_set:
            raise MetricsFormatError(f"incomplete exposition: {name} ranks {sorted(ranks[name], key=str)} "
                                     f"differ from {RUNNING} ranks {rank_set}")
    if capacity_ranks and sorted(capacity_ranks) != rank_set:
        raise MetricsFormatError(f"incomplete exposition: {CACHE_CONFIG} ranks {sorted(capacity_ranks)} "
                                 f"differ from the gauges' ranks {rank_set}")
    if expect_capacity and not capacity_known:
        raise MetricsFormatError(f"incomplete exposition: {CACHE_CONFIG} is missing, though the engine has shown it")
    return EngineGauges(
        running=round(sum(values[RUNNING])),
        waiting=round(sum(values[WAITING])),
        kv_usage=max(values[KV_USAGE]),
        capacity_tokens=capacity if capacity_known else None,
        block_size=block_size,
        ranks=len(values[RUNNING]),
        prompt_tokens_total=counters.get(PROMPT_TOKENS),
        generation_tokens_total=counters.get(GENERATION_TOKENS),
        generated_sum=counters.get(GENERATED_SUM),
        generated_count=counters.get(GENERATED_COUNT),
    )
