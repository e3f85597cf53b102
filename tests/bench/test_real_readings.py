"""bench.admission's reading of a real vLLM's /metrics: the counters a run differences."""

from __future__ import annotations

from bench.admission import counter_delta, vllm_readings

EXPOSITION = """\
# TYPE vllm:admission_rejections counter
vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_reqs"} 3.0
vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_tokens"} 1.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 7.0
"""


def test_the_engines_own_queue_refusals_are_read_and_differenced_over_a_run() -> None:
    before = vllm_readings("")
    after = vllm_readings(EXPOSITION)
    assert after["admission_rejections"] == 4.0  # both of its limits
    delta = counter_delta(after, before)
    assert delta["admission_rejections"] == 4 and delta["finished"] == {"length": 7}
