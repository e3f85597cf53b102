"""When the engine's metrics or the service itself fail, requests still get a defined answer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import Stack
from .http import chat_body, post

URL = "/v1/chat/completions"


@pytest.mark.parametrize("mode", ["fail", "garbage", "hang", "missing"])
def test_broken_engine_metrics_go_stale_and_fail_open(stack: Stack, mode: str) -> None:
    stack.pin(running=4, waiting=1)
    stack.wait_gate(False)
    with ThreadPoolExecutor(2) as pool:
        parked = pool.submit(post, stack.url + URL, chat_body(), {"x-request-id": "held"})
        stack.wait_state(lambda s: s["queue_depth"] == 1, "the request to park")
        stack.sim("/control/metrics_mode", {"mode": mode})
        stack.wait_state(lambda s: s["state"] == "stale", "the engine state to go stale", timeout=40)
        assert parked.result(timeout=30).status == 200  # released fail-open
    reply = post(stack.url + URL, chat_body(), {"x-request-id": "new"})
    assert reply.status == 200
    assert stack.arrivals() == ["held", "new"]
    assert stack.metric("engine_state_stale_total") == 1
    assert stack.metric("engine_state_is_stale") == 1
    assert stack.metric("admission_admitted_total", via="admitted_fail_open") == 2
    assert stack.metric("observer_degraded") == (1 if mode in ("garbage", "missing") else 0)
    # Recovery: gating resumes and the stale counter does not move again.
    stack.sim("/control/metrics_mode", {"mode": "ok"})
    stack.wait_state(lambda s: s["state"] == "fresh", "the engine state to be fresh again")
    stack.wait_gate(False)
    assert stack.metric("observer_degraded") == 0
    assert stack.metric("engine_state_stale_total") == 1


def test_degraded_startup_logs_error_and_sets_the_gauge(make_stack) -> None:  # noqa: ANN001
    from devstack import LocalStack

    stack = make_stack(with_extproc=False)
    local: LocalStack = stack.local
    stack.sim("/control/metrics_mode", {"mode": "missing"})
    local.with_extproc = True
    local.start_extproc()
    assert stack.metric("observer_degraded") == 1
    log = stack.service_log()
    assert '"level": "ERROR"' in log and "first poll" in log
    stack.sim("/control/metrics_mode", {"mode": "ok"})
    stack.wait_state(lambda s: s["state"] == "fresh", "a good poll")
    assert stack.metric("observer_degraded") == 0


def test_service_down_fails_open_by_default(stack: Stack) -> None:
    assert stack.local.extproc is not None
    stack.local.extproc.stop()
    reply = post(stack.url + URL, chat_body(), {"x-request-id": "ungated"})
    assert reply.status == 200
    assert stack.arrivals() == ["ungated"]


def test_service_down_with_failure_mode_closed_answers_503(make_stack) -> None:  # noqa: ANN001
    stack = make_stack(envoy_args={"failure_mode": "closed"})
    assert stack.local.extproc is not None
    stack.local.extproc.stop()
    reply = post(stack.url + URL, chat_body(), {"x-request-id": "refused"})
    assert reply.status == 503
    assert stack.arrivals() == []
