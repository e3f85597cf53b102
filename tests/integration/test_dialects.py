"""Each engine metrics dialect on the real stack: Envoy, the service and the simulator speaking
vLLM's, SGLang's or trtllm-serve's names; the service detects the dialect (or is told it) and its
gate decides on that dialect's gauges and KV capacity."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import Stack
from .http import chat_body, post

URL = "/v1/chat/completions"
CAPACITY = 512 * 16  # the small simulator preset, whatever names it is published under


def _gate_follows_the_dialects_kv_gauge(stack: Stack, request_id: str) -> None:
    """A KV gauge above the threshold parks a request; the gauge falling releases it."""
    stack.pin(kv_usage=0.95)  # only the dialect's KV-usage family carries this
    stack.wait_state(lambda s: s["snapshot"]["kv_usage"] == 0.95 and not s["gate_open"], "the gate to close on KV")
    with ThreadPoolExecutor(1) as pool:
        parked = pool.submit(post, stack.url + URL, chat_body(max_tokens=8), {"x-request-id": request_id})
        stack.wait_state(lambda s: s["queue_depth"] == 1, "the request to park")
        assert stack.arrivals() == []
        stack.pin(kv_usage=None)
        assert parked.result(timeout=30).status == 200
    assert stack.arrivals() == [request_id]


def _gate_follows_the_dialects_running_gauge(stack: Stack, request_id: str) -> None:
    """max in-flight 1 (+1 engine queue slot with the budget) and the engine's running and waiting
    gauges at 1 each: a request parks until they drop."""
    stack.pin(running=1, waiting=1)
    stack.wait_state(lambda s: s["snapshot"]["waiting"] == 1 and not s["gate_open"], "the gate to close on slots")
    with ThreadPoolExecutor(1) as pool:
        parked = pool.submit(post, stack.url + URL, chat_body(max_tokens=8), {"x-request-id": request_id})
        stack.wait_state(lambda s: s["queue_depth"] == 1, "the request to park")
        stack.pin(running=None, waiting=None)
        assert parked.result(timeout=30).status == 200


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "trtllm"])
def test_an_auto_engine_detects_the_dialect_and_gates_on_its_gauges(make_stack, dialect: str) -> None:  # noqa: ANN001
    stack = make_stack(env={"ADMISSION_MAX_INFLIGHT": "1"}, sim_args=("--dialect", dialect))
    state = stack.wait_state(lambda s: s["dialect"] is not None and s["snapshot"] is not None, "the first poll")
    assert state["dialect"] == dialect
    assert state["snapshot"]["capacity_tokens"] == CAPACITY
    assert stack.metric("admission_engine_dialect", engine="default", dialect=dialect) == 1
    assert stack.metric("vllm_kv_capacity_tokens") == CAPACITY
    assert stack.metric("observer_degraded") == 0
    assert '"how": "detected"' in stack.service_log()
    _gate_follows_the_dialects_kv_gauge(stack, f"{dialect}-kv")
    _gate_follows_the_dialects_running_gauge(stack, f"{dialect}-slots")


def test_a_configured_dialect_is_used_from_the_start(make_stack) -> None:  # noqa: ANN001
    stack = make_stack(env={"ADMISSION_MAX_INFLIGHT": "1", "ADMISSION_ENGINE_DIALECT": "sglang"},
                       sim_args=("--dialect", "sglang"))
    state = stack.wait_state(lambda s: s["snapshot"] is not None, "the first poll")
    assert state["dialect"] == "sglang" and state["snapshot"]["capacity_tokens"] == CAPACITY
    assert '"how": "configured"' in stack.service_log()
    _gate_follows_the_dialects_kv_gauge(stack, "configured-kv")


def test_a_configured_dialect_the_engine_does_not_speak_fails_open_as_unparsable(make_stack) -> None:  # noqa: ANN001
    stack = make_stack(env={"ADMISSION_ENGINE_DIALECT": "trtllm"}, sim_args=("--dialect", "sglang"))
    assert stack.metric("observer_degraded") == 1
    assert stack.metric("engine_poll_failures_total", reason="unparsable") >= 1
    assert post(stack.url + URL, chat_body(max_tokens=8), {"x-request-id": "open"}).status == 200
    assert stack.engine_state()["dialect"] == "trtllm"
