"""EngineMetrics fed by a scripted scheduler run: values a scraper would read."""

from __future__ import annotations

import pytest

from enginesim.metrics import EngineMetrics, build_1_2_5_buckets, cache_config_labels
from enginesim.scheduler import CostModel, Scheduler, SchedulerConfig

CONFIG = SchedulerConfig(num_gpu_blocks=5, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=16, max_model_len=16,
                         cost=CostModel(1.0, 0.1, 0.5))
LABELS = {"model_name": "m", "engine": "0"}


def scripted_run() -> tuple[EngineMetrics, list[float]]:
    """Two 6-token prompts x 10 tokens in a 16-token cache: one preemption."""
    metrics = EngineMetrics("m", CONFIG, [0], process_collectors=False)
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
