"""EngineMetrics fed by a scripted scheduler run: values a scraper would read."""

from __future__ import annotations

import pytest

from enginesim.metrics import (
    EngineMetrics,
    build_1_2_5_buckets,
    cache_config_labels,
    cache_config_labels_033,
)
from enginesim.scheduler import CostModel, Scheduler, SchedulerConfig, SchedulerStats

CONFIG = SchedulerConfig(num_gpu_blocks=5, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=16, max_model_len=16,
                         cost=CostModel(1.0, 0.1, 0.5))
LABELS = {"model_name": "m", "engine": "0"}


def scripted_run(profile: str | None = None) -> tuple[EngineMetrics, list[float]]:
    """Two 6-token prompts x 10 tokens in a 16-token cache: one preemption."""
    metrics = EngineMetrics("m", CONFIG, [0], process_collectors=False, profile=profile)
    sched = Scheduler(CONFIG)
    sched.add_request("a", 6, 10, 0.0)
    sched.add_request("b", 6, 10, 0.0)
    usage = []
    now = 0.0
    while sched.has_unfinished:
        step, out = sched.step(now)
        now = step.end_time
        metrics.record_step(0, step, out)
        metrics.publish(0, sched.stats())
        usage.append(metrics.registry.get_sample_value("vllm:kv_cache_usage_perc", LABELS))
    return metrics, usage


def value(metrics: EngineMetrics, name: str, **extra: str) -> float | None:
    return metrics.registry.get_sample_value(name, LABELS | extra)


def test_counters_after_a_run_with_one_preemption():
    metrics, _ = scripted_run()
    assert value(metrics, "vllm:num_preemptions_total") == 1
    assert value(metrics, "vllm:prompt_tokens_total") == 12  # counted once per request
    assert value(metrics, "vllm:generation_tokens_total") == 20
    assert value(metrics, "vllm:request_success_total", finished_reason="length") == 2
    assert value(metrics, "vllm:request_success_total", finished_reason="stop") == 0


def test_histograms_count_one_observation_per_finished_request():
    metrics, _ = scripted_run()
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens"):
        assert value(metrics, f"{name}_count") == 2, name
    assert value(metrics, "vllm:request_prompt_tokens_sum") == 12
    assert value(metrics, "vllm:inter_token_latency_seconds_count") == 18
    # both prefills ran in the first step: 1 s + 12 tokens x 0.1 s
    assert value(metrics, "vllm:time_to_first_token_seconds_sum") == pytest.approx(2 * 2.2)


def test_gauges_follow_the_kv_cache_and_end_at_zero():
    metrics, usage = scripted_run()
    assert usage[0] == 1.0  # 4 of 4 usable blocks after the first step
    assert max(usage) == 1.0 and usage[-1] == 0.0
    assert value(metrics, "vllm:num_requests_running") == 0
    assert value(metrics, "vllm:num_requests_waiting") == 0


def test_pins_override_published_gauges():
    metrics = EngineMetrics("m", CONFIG, [0, 1], process_collectors=False)
    metrics.set_pins(running=2, waiting=None, kv_usage=0.5)
    for engine in ("0", "1"):
        labels = {"model_name": "m", "engine": engine}
        assert metrics.registry.get_sample_value("vllm:num_requests_running", labels) == 2
        assert metrics.registry.get_sample_value("vllm:kv_cache_usage_perc", labels) == 0.5
        assert metrics.registry.get_sample_value("vllm:num_requests_waiting", labels) == 0


def test_exposition_without_gauges_keeps_everything_else():
    metrics = EngineMetrics("m", CONFIG, [0], process_collectors=False)
    full = metrics.exposition().decode()
    partial = metrics.exposition(without_gauges=True).decode()
    assert "vllm:num_requests_running{" in full and "vllm:num_requests_running" not in partial
    assert "vllm:kv_cache_usage_perc" not in partial
    assert "vllm:cache_config_info{" in partial


def test_length_buckets_match_vllm():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096)[-1] == 2000


def test_cache_config_labels_are_vllm_0_11_cacheconfig_fields():
    labels = cache_config_labels(CONFIG)
    assert list(labels)[:3] == ["block_size", "gpu_memory_utilization", "swap_space"]
    assert labels["num_gpu_blocks"] == "5" and labels["block_size"] == "4"
    assert len(labels) == 20 and "engine" not in labels


# The vllm-0.11 exposition, family by family (TYPE lines), as it was before profiles existed.
FAMILIES_0_11 = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries_created",
    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits_created",
    "vllm:num_preemptions_total", "vllm:num_preemptions_created",
    "vllm:prompt_tokens_total", "vllm:prompt_tokens_created",
    "vllm:generation_tokens_total", "vllm:generation_tokens_created",
    "vllm:request_success_total", "vllm:request_success_created",
    "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_created",
    "vllm:request_generation_tokens", "vllm:request_generation_tokens_created",
    "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_created",
    "vllm:request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens_created",
    "vllm:request_params_n", "vllm:request_params_n_created",
    "vllm:request_params_max_tokens", "vllm:request_params_max_tokens_created",
    "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_created",
    "vllm:time_per_output_token_seconds", "vllm:time_per_output_token_seconds_created",
    "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_created",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds_created",
    "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_created",
    "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_created",
    "vllm:request_inference_time_seconds", "vllm:request_inference_time_seconds_created",
    "vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds_created",
    "vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_created",
    "vllm:cache_config_info",
]


def type_lines(metrics: EngineMetrics) -> list[str]:
    return [line.split(" ")[2] for line in metrics.exposition().decode().splitlines()
            if line.startswith("# TYPE")]


def test_the_0_11_profile_keeps_its_families_in_their_order():
    metrics, _ = scripted_run("vllm-0.11")
    assert type_lines(metrics) == FAMILIES_0_11
    (success,) = [f for f in metrics.registry.collect() if f.name == "vllm:request_success"]
    assert {s.labels["finished_reason"] for s in success.samples} == {"stop", "length", "abort"}


def test_the_0_33_profile_follows_vllm_0_33_loggers_order():
    metrics, _ = scripted_run("vllm-0.33")
    names = [n for n in type_lines(metrics) if not n.endswith("_created")]
    assert names[:7] == [
        "vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
        "vllm:estimated_write_bytes_per_gpu_total", "vllm:num_requests_running",
        "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason",
        "vllm:engine_sleep_state"]
    assert names[-3:] == ["vllm:request_num_preemptions",
                          "vllm:request_prefill_kv_computed_tokens", "vllm:cache_config_info"]
    assert names.index("vllm:admission_rejections_total") == names.index(
        "vllm:request_success_total") + 1
    assert "vllm:time_per_output_token_seconds" not in names


def test_0_33_preemptions_total_and_per_request_histogram():
    metrics, _ = scripted_run("vllm-0.33")
    assert value(metrics, "vllm:num_preemptions_total") == 1
    assert value(metrics, "vllm:request_num_preemptions_count") == 2
    assert value(metrics, "vllm:request_num_preemptions_sum") == 1
    assert value(metrics, "vllm:request_num_preemptions_bucket", le="1.0") == 2
    assert value(metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 12
    assert value(metrics, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 0


def test_0_33_sleep_freezes_the_gauges_until_wake_up():
    metrics = EngineMetrics("m", CONFIG, [0], process_collectors=False, profile="vllm-0.33")

    metrics.publish(0, SchedulerStats(1, 2, 0.5, 2))
    metrics.record_sleep_state(True, 2)
    metrics.publish(0, SchedulerStats(0, 5, 0.0, 0))
    assert value(metrics, "vllm:num_requests_waiting") == 2
    assert value(metrics, "vllm:engine_sleep_state", sleep_state="discard_all") == 1
    metrics.record_sleep_state(False)
    metrics.publish(0, SchedulerStats(0, 5, 0.0, 0))
    assert value(metrics, "vllm:num_requests_waiting") == 5
    assert value(metrics, "vllm:num_requests_waiting_by_reason", reason="capacity") == 5
    assert value(metrics, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert value(metrics, "vllm:engine_sleep_state", sleep_state="awake") == 1


def test_admission_rejections_have_no_engine_label():
    metrics = EngineMetrics("m", CONFIG, [0, 1], process_collectors=False, profile="vllm-0.33")
    metrics.record_admission_rejection("max_num_queued_tokens")
    get = metrics.registry.get_sample_value
    assert get("vllm:admission_rejections_total",
               {"model_name": "m", "reason": "max_num_queued_tokens"}) == 1
    assert get("vllm:admission_rejections_total",
               {"model_name": "m", "reason": "max_num_queued_reqs"}) == 0


def test_cache_config_labels_are_vllm_0_33_cacheconfig_fields():
    labels = cache_config_labels_033(CONFIG, num_engines=2)
    assert list(labels)[:5] == ["block_size", "user_specified_block_size", "kv_cache_layout",
                                "prefix_match_unit", "gpu_memory_utilization"]
    assert list(labels)[-1] == "_block_size_resolved"
    assert len(labels) == 37 and "engine" not in labels
    assert labels["enable_prefix_caching"] == "True"
    assert labels["num_gpu_blocks"] == "10"  # the frontend sums the DP engines' blocks
