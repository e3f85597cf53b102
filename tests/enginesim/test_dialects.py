"""The simulator's --dialect: the same engine state under SGLang's and trtllm-serve's names."""

from __future__ import annotations

import pytest

from enginesim.cli import build_parser, config_from_args
from enginesim.metrics import EngineMetrics
from enginesim.scheduler import SchedulerConfig
from extproc.dialects import SGLANG, TRTLLM
from extproc.enginemetrics import parse_engine_metrics

CONFIG = SchedulerConfig(num_gpu_blocks=512, block_size=16)


def _samples(text: str) -> dict[str, str]:
    return {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in text.splitlines() if not line.startswith("#")}


def test_sglang_rendering_has_sglangs_names_and_one_series_per_dp_rank() -> None:
    metrics = EngineMetrics("m", CONFIG, [0, 1], process_collectors=False, dialect="sglang")
    metrics.set_pins(running=3, waiting=2, kv_usage=0.5)
    text = metrics.exposition().decode()
    samples = _samples(text)
    labels = '{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"}'
    assert samples[f"sglang:num_running_reqs{labels}"] == "3.0"
    assert samples[f"sglang:num_queue_reqs{labels}"] == "2.0"
    assert samples[f"sglang:token_usage{labels}"] == "0.5"
    assert samples[f"sglang:max_total_num_tokens{labels}"] == str(float(512 * 16))
    assert f"sglang:prompt_tokens_total{labels}" in samples and f"sglang:generation_tokens_total{labels}" in samples
    assert "vllm:" not in text
    gauges = parse_engine_metrics(text, dialect=SGLANG)
    assert (gauges.running, gauges.waiting, gauges.kv_usage, gauges.ranks) == (6, 4, 0.5, 2)
    assert (gauges.capacity_tokens, gauges.block_size) == (2 * 512 * 16, 1)  # each rank's pool, summed


def test_sglang_with_one_rank_has_no_dp_rank_label() -> None:
    text = EngineMetrics("m", CONFIG, [0], process_collectors=False, dialect="sglang").exposition().decode()
    assert 'sglang:num_running_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.0' in text


def test_trtllm_rendering_has_trtllm_serves_names_and_block_geometry() -> None:
    metrics = EngineMetrics("m", CONFIG, [0], process_collectors=False, dialect="trtllm")
    metrics.set_pins(running=1, waiting=0, kv_usage=0.25)
    text = metrics.exposition().decode()
    samples = _samples(text)
    labels = '{engine_type="trtllm",model_name="m"}'
    assert samples[f"trtllm_num_requests_running{labels}"] == "1.0"
    assert samples[f"trtllm_num_requests_waiting{labels}"] == "0.0"
    assert samples[f"trtllm_kv_cache_utilization{labels}"] == "0.25"
    assert samples[f"trtllm_kv_cache_max_blocks{labels}"] == "512.0"
    assert samples[f"trtllm_kv_cache_used_blocks{labels}"] == "128.0"
    assert samples[f"trtllm_kv_cache_tokens_per_block{labels}"] == "16.0"
    assert "vllm:" not in text
    gauges = parse_engine_metrics(text, dialect=TRTLLM)
    assert (gauges.running, gauges.waiting, gauges.kv_usage, gauges.capacity_tokens, gauges.block_size) == (
        1, 0, 0.25, 512 * 16, 16)


@pytest.mark.parametrize("dialect,gone", [("sglang", "sglang:num_running_reqs"),
                                          ("trtllm", "trtllm_num_requests_running")])
def test_without_gauges_drops_the_dialects_three_gauges(dialect: str, gone: str) -> None:
    text = EngineMetrics("m", CONFIG, [0], process_collectors=False, dialect=dialect).exposition(
        without_gauges=True).decode()
    assert gone not in text and "_tokens_total" in text


def test_token_counters_follow_the_engine() -> None:
    from enginesim.scheduler import ScheduledStep, StepOutput
    metrics = EngineMetrics("m", CONFIG, [0], process_collectors=False, dialect="trtllm")
    step = ScheduledStep(start_time=0.0, duration=0.01, num_scheduled_tokens={"r": 100}, prefill_tokens=100,
                         decode_seqs=0, preempted=[], admitted=["r"])
    output = StepOutput(end_time=0.01, num_prompt_tokens=100, num_generation_tokens=7)
    metrics.record_step(0, step, output)
    gauges = parse_engine_metrics(metrics.exposition().decode(), dialect=TRTLLM)
    assert (gauges.prompt_tokens_total, gauges.generation_tokens_total) == (100, 7)
    assert gauges.generated_sum is None and gauges.generated_count is None  # trtllm has no such family


def test_the_cli_flag_defaults_to_vllm_and_trtllm_refuses_data_parallelism() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args([])).dialect == "vllm"
    assert config_from_args(parser.parse_args(["--dialect", "sglang"])).dialect == "sglang"
    with pytest.raises(ValueError, match="trtllm"):
        config_from_args(parser.parse_args(["--dialect", "trtllm", "--data-parallel-size", "2"]))
