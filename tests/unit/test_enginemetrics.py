"""Parsing vLLM's exposition: the three gauges, DP-rank aggregation, capacity, and failures."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.enginemetrics import MetricsFormatError, parse_engine_metrics

EXPOSITION = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="1"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m",engine="0"} 2.0
vllm:num_requests_waiting{model_name="m",engine="1"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25
vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.75
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="9527"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="9527"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m",engine="0"} 0.0
"""


def test_sums_counts_and_takes_max_kv_over_data_parallel_ranks() -> None:
    gauges = parse_engine_metrics(EXPOSITION)
    assert (gauges.running, gauges.waiting, gauges.kv_usage, gauges.ranks) == (4, 2, 0.75, 2)


def test_capacity_is_the_total_every_rank_reports_not_a_sum_over_ranks() -> None:
    # vLLM's API server sums the ranks' blocks and writes that total on each rank's line.
    assert parse_engine_metrics(EXPOSITION).capacity_tokens == 9527 * 16


def test_capacity_is_unknown_without_cache_config_info() -> None:
    text = "".join(line for line in EXPOSITION.splitlines(keepends=True) if "cache_config" not in line)
    assert parse_engine_metrics(text).capacity_tokens is None


def test_falls_back_to_the_pre_0_11_kv_gauge_name() -> None:
    text = EXPOSITION.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_engine_metrics(text).kv_usage == 0.75


@pytest.mark.parametrize(
    "text,needle",
    [
        ("<html>oops</html>\x00\x01\n", "missing series"),
        ("", "missing series"),
        (EXPOSITION.replace("vllm:kv_cache_usage_perc", "vllm:other"), "vllm:kv_cache_usage_perc"),
        ('vllm:num_requests_running{engine="0"} abc\n', "unparsable"),
        (EXPOSITION.replace('engine="1"} 0.0', 'engine="1"} -1.0'), "negative"),
    ],
)
def test_documents_without_the_three_gauges_are_errors(text: str, needle: str) -> None:
    with pytest.raises(MetricsFormatError, match=needle):
        parse_engine_metrics(text)


# --- defect 8: a document is trusted only if it parsed completely --------------------------


def test_a_body_cut_inside_a_number_is_rejected_not_read_as_a_shorter_number() -> None:
    # `0.97` cut after `0.` parses as 0.0 and would open the gate.
    text = EXPOSITION.replace("} 0.75\n", "} 0.97\n")
    cut = text[: text.index("} 0.97") + len("} 0.")]
    with pytest.raises(MetricsFormatError, match="truncated"):
        parse_engine_metrics(cut)


@pytest.mark.parametrize("cut", range(1, len(EXPOSITION)))
def test_every_truncation_of_the_document_is_rejected_or_reads_the_full_values(cut: int) -> None:
    """However the body is cut, the poll either fails or yields exactly the full document's figures."""
    full = parse_engine_metrics(EXPOSITION, expect_capacity=True)
    try:
        gauges = parse_engine_metrics(EXPOSITION[:cut], expect_capacity=True)
    except MetricsFormatError:
        return
    assert gauges == full


def test_a_body_cut_in_half_after_capacity_was_seen_is_a_failed_poll() -> None:
    half = EXPOSITION[: EXPOSITION.index("# HELP vllm:cache_config_info")]
    assert parse_engine_metrics(half).capacity_tokens is None  # an engine that never said
    with pytest.raises(MetricsFormatError, match="cache_config_info is missing"):
        parse_engine_metrics(half, expect_capacity=True)


def test_a_cut_between_two_ranks_of_cache_config_info_is_rejected() -> None:
    lines = EXPOSITION.splitlines(keepends=True)
    info = 'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1"'
    text = "".join(line for line in lines if not line.startswith(info))
    with pytest.raises(MetricsFormatError, match="ranks"):
        parse_engine_metrics(text)


def test_a_gauge_missing_for_one_rank_is_rejected() -> None:
    text = EXPOSITION.replace('vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.75\n', "")
    with pytest.raises(MetricsFormatError, match="ranks"):
        parse_engine_metrics(text)


def test_a_capacity_change_is_taken() -> None:
    text = EXPOSITION.replace('num_gpu_blocks="9527"', 'num_gpu_blocks="4000"')
    assert parse_engine_metrics(text, expect_capacity=True).capacity_tokens == 4000 * 16


@pytest.mark.parametrize(
    "old,new,needle",
    [
        ('engine="1"} 0.75', 'engine="1"} 1.5', "out of range"),
        ('engine="1"} 0.75', 'engine="1"} NaN', "non-finite"),
        ('engine="1"} 0.75', 'engine="1"} +Inf', "non-finite"),
        ('engine="0"} 3.0', 'engine="0"} NaN', "non-finite"),
        ('engine="0"} 3.0', 'engine="0"} 2.5', "non-integral"),
        ('engine="0"} 2.0', 'engine="0"} 1e300000', "non-finite"),
    ],
)
def test_values_out_of_range_are_rejected(old: str, new: str, needle: str) -> None:
    assert old in EXPOSITION
    with pytest.raises(MetricsFormatError, match=needle):
        parse_engine_metrics(EXPOSITION.replace(old, new, 1))


def test_kv_usage_of_exactly_one_is_in_range() -> None:
    assert parse_engine_metrics(EXPOSITION.replace('engine="1"} 0.75', 'engine="1"} 1.0')).kv_usage == 1.0


def test_a_vllm_0_33_exposition_from_the_simulator_parses() -> None:
    """0.33 adds vllm:num_requests_waiting_by_reason{reason} (capacity + deferred = waiting),
    engine_sleep_state, admission_rejections and a 38-label cache_config_info; the prefilter
    must keep only the gauges it reads (the by-reason family would double the waiting count)."""
    from enginesim.metrics import EngineMetrics
    from enginesim.scheduler import SchedulerConfig

    metrics = EngineMetrics("m", SchedulerConfig(num_gpu_blocks=512, block_size=16), [0],
                            process_collectors=False, profile="vllm-0.33")
    metrics.set_pins(running=3, waiting=2, kv_usage=0.5)
    text = metrics.exposition().decode()
    assert 'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0' in text
    assert "vllm:engine_sleep_state" in text and "vllm:admission_rejections_total" in text
    gauges = parse_engine_metrics(text, expect_capacity=True)
    assert (gauges.running, gauges.waiting, gauges.kv_usage, gauges.ranks) == (3, 2, 0.5, 1)
    assert (gauges.capacity_tokens, gauges.block_size) == (512 * 16, 16)


def test_the_engines_token_counters_are_summed_over_ranks_and_optional() -> None:
    from extproc.enginemetrics import parse_engine_metrics

    base = (
        'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n'
        'vllm:num_requests_waiting{engine="0"} 0\nvllm:num_requests_waiting{engine="1"} 0\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.1\nvllm:kv_cache_usage_perc{engine="1"} 0.2\n'
    )
    counters = (
        '# TYPE vllm:prompt_tokens_total counter\n'
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 100\n'
        'vllm:prompt_tokens_total{engine="1",model_name="m"} 50\n'
        '# TYPE vllm:generation_tokens_total counter\n'
        'vllm:generation_tokens_total{engine="0",model_name="m"} 7\n'
        '# TYPE vllm:request_generation_tokens histogram\n'
        'vllm:request_generation_tokens_bucket{engine="0",le="+Inf",model_name="m"} 3\n'
        'vllm:request_generation_tokens_sum{engine="0",model_name="m"} 30\n'
        'vllm:request_generation_tokens_count{engine="0",model_name="m"} 3\n'
        'vllm:request_generation_tokens_sum{engine="1",model_name="m"} 12\n'
        'vllm:request_generation_tokens_count{engine="1",model_name="m"} 1\n'
    )
    got = parse_engine_metrics(base + counters)
    assert (got.prompt_tokens_total, got.generation_tokens_total) == (150, 7)
    assert (got.generated_sum, got.generated_count) == (42, 4)
    bare = parse_engine_metrics(base)
    assert (bare.prompt_tokens_total, bare.generation_tokens_total, bare.generated_sum, bare.generated_count) == (
        None, None, None, None)


# --- vLLM with --data-parallel-size 2: gauges appear rank by rank, as each rank first serves --------

_INFO = ('vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="1280"} 1.0\n'
         'vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="1280"} 1.0\n')
_DECLARED_ONLY = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n" + _INFO
)


def test_a_data_parallel_engine_that_has_not_served_reads_idle_not_missing() -> None:
    from extproc.dialects import detect

    assert detect(_DECLARED_ONLY) is not None and detect(_DECLARED_ONLY).name == "vllm"
    gauges = parse_engine_metrics(_DECLARED_ONLY)
    assert (gauges.running, gauges.waiting, gauges.kv_usage, gauges.ranks) == (0, 0, 0.0, 2)
    assert gauges.capacity_tokens == 1280 * 32


def test_declared_gauges_without_samples_or_capacity_are_still_missing() -> None:
    text = "".join(line for line in _DECLARED_ONLY.splitlines(keepends=True) if "cache_config" not in line)
    with pytest.raises(MetricsFormatError, match="missing series"):
        parse_engine_metrics(text)


def test_a_rank_that_has_not_served_yet_counts_as_idle() -> None:
    # Only rank 0 has served: its gauges exist, rank 1's do not, cache_config_info has both.
    text = _DECLARED_ONLY.replace(
        "# TYPE vllm:num_requests_running gauge\n",
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m",engine="0"} 2.0\n').replace(
        "# TYPE vllm:num_requests_waiting gauge\n",
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m",engine="0"} 1.0\n').replace(
        "# TYPE vllm:kv_cache_usage_perc gauge\n",
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.5\n')
    gauges = parse_engine_metrics(text, expect_capacity=True)
    assert (gauges.running, gauges.waiting, gauges.kv_usage, gauges.ranks) == (2, 1, 0.5, 2)


def test_a_rank_with_gauges_but_no_capacity_line_is_still_incomplete() -> None:
    text = EXPOSITION.replace('vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",'
                              'num_gpu_blocks="9527"} 1.0\n', "")
    with pytest.raises(MetricsFormatError, match="ranks"):
        parse_engine_metrics(text)


def _simulated_exposition(profile: str) -> str:
    """A simulator exposition after real scheduler steps: three finished requests (3, 30, 300 tokens)."""
    from enginesim.metrics import EngineMetrics
    from enginesim.scheduler import Scheduler, SchedulerConfig

    config = SchedulerConfig(num_gpu_blocks=512, block_size=16)
    sched = Scheduler(config, profile)
    metrics = EngineMetrics("m", config, [0], process_collectors=False, profile=profile)
    for i, length in enumerate((3, 30, 300)):
        sched.add_request(f"r{i}", prompt_tokens=64, max_tokens=length, arrival_time=0.0, prefix=("sys", 48))
    _run(sched, metrics, 0.0)
    metrics.publish(0, sched.stats())
    return metrics.exposition().decode()


def _run(sched: Any, metrics: Any, now: float) -> float:
    """Step the scheduler until it has nothing left, recording each step; the engine time after."""
    for _ in range(1000):
        if not sched.has_unfinished:
            break
        step, out = sched.step(now)
        metrics.record_step(0, step, out)
        now = step.end_time
    return now


def test_the_generation_histogram_buckets_and_prefix_cache_counters_are_read() -> None:
    got = parse_engine_metrics(_simulated_exposition("vllm-0.33"), expect_capacity=True)
    assert got.generated_buckets is not None
    bounds = dict(got.generated_buckets)
    assert (bounds[2.0], bounds[5.0], bounds[50.0], bounds[500.0], bounds[float("inf")]) == (0, 1, 2, 3, 3)
    # Each 64-token prompt looked up once; all three were scheduled in the same step, before any
    # block of the shared 48-token prefix was cached, so none hit (as in vLLM).
    assert (got.prefix_hits, got.prefix_queries, got.preemptions) == (0, 3 * 64, 0)
    # The per-request sums behind the gate's direct prefill and decode rates.
    assert got.prompt_sum == 3 * 64 and got.prefill_time_sum and got.decode_time_sum


def test_the_simulator_counts_prefix_cache_hits_of_a_prompt_scheduled_after_its_prefix_was_cached() -> None:
    from enginesim.metrics import EngineMetrics
    from enginesim.scheduler import Scheduler, SchedulerConfig

    config = SchedulerConfig(num_gpu_blocks=512, block_size=16)
    sched = Scheduler(config, "vllm-0.33")
    metrics = EngineMetrics("m", config, [0], process_collectors=False, profile="vllm-0.33")
    now = 0.0
    for i in range(2):  # the second arrives after the first has finished: its 48-token prefix is cached
        sched.add_request(f"r{i}", prompt_tokens=64, max_tokens=2, arrival_time=now, prefix=("sys", 48))
        now = _run(sched, metrics, now)
    metrics.publish(0, sched.stats())
    got = parse_engine_metrics(metrics.exposition().decode(), expect_capacity=True)
    assert (got.prefix_queries, got.prefix_hits) == (2 * 64, 48)  # three full 16-token blocks of the prefix


def test_prefix_cache_counters_are_optional() -> None:
    base = ('vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_waiting{engine="0"} 0\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.1\n')
    got = parse_engine_metrics(base)
    assert (got.prefix_hits, got.prefix_queries, got.preemptions, got.generated_buckets) == (None, None, None, None)
