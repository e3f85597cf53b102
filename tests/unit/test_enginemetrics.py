"""Parsing vLLM's exposition: the three gauges, DP-rank aggregation, capacity, and failures."""

from __future__ import annotations

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


def test_capacity_is_blocks_times_block_size_summed_over_ranks() -> None:
    assert parse_engine_metrics(EXPOSITION).capacity_tokens == 2 * 9527 * 16


def test_capacity_is_unknown_without_cache_config_info() -> None:
    text = "\n".join(line for line in EXPOSITION.splitlines() if "cache_config" not in line)
    assert parse_engine_metrics(text).capacity_tokens is None


def test_falls_back_to_the_pre_0_11_kv_gauge_name() -> None:
    text = EXPOSITION.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_engine_metrics(text).kv_usage == 0.75


@pytest.mark.parametrize(
    "text,needle",
    [
        ("<html>oops</html>\x00\x01", "missing series"),
        ("", "missing series"),
        (EXPOSITION.replace("vllm:kv_cache_usage_perc", "vllm:other"), "vllm:kv_cache_usage_perc"),
        ('vllm:num_requests_running{engine="0"} abc\n', "unparsable"),
        (EXPOSITION.replace('engine="1"} 0.0', 'engine="1"} -1.0'), "negative"),
    ],
)
def test_documents_without_the_three_gauges_are_errors(text: str, needle: str) -> None:
    with pytest.raises(MetricsFormatError, match=needle):
        parse_engine_metrics(text)
