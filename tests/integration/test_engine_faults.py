"""The engine-metrics part of the fault matrix: real Envoy, the service and the simulator.

Each fault has one defined outcome:

- a poll that fails (HTTP 500, no answer within the poll timeout, garbage, a truncated or
  incomplete document, NaN or out-of-range values) is counted in
  `engine_poll_failures_total{reason}` and the gate keeps the LAST GOOD state: a parked request
  stays parked, nothing is decided on the broken document;
- `ENGINE_STALE_AFTER_POLLS` failures in a row make the state stale: `engine_state_stale_total`
  counts the transition once and admission fails open (the parked request is released);
- a good document brings the state back to fresh and gating resumes;
- an engine restarted with another KV cache size is a capacity CHANGE, taken as it is.

Synchronisation is by polling the service's /debug/engines and /metrics with deadlines.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from devstack import wait_until

from .conftest import Stack
from .http import chat_body, post

URL = "/v1/chat/completions"
STALE_AFTER = 15  # x 0.2 s polls: 3 s of failed polls before failing open, time to see the kept state

# metrics mode of the simulator -> the poll failure reason the service counts
FAULTS = {
    "fail": "http_status",
    "hang": "timeout",
    "garbage": "unparsable",
    "truncated": "unparsable",  # a 200 body cut inside `0.97`, reading `0.` (defect 8)
    "half": "unparsable",  # a 200 body cut in half at a line boundary: cache_config_info lost (defect 8)
    "nan": "unparsable",
    "out_of_range": "unparsable",  # kv_cache_usage_perc 1.5 (defect 8)
}


def failures(stack: Stack, reason: str) -> float:
    return stack.metric("engine_poll_failures_total", engine="default", reason=reason)


@pytest.mark.parametrize("mode", list(FAULTS))
def test_a_failed_poll_keeps_the_last_good_state_then_fails_open_and_recovers(
        make_stack: Callable[..., Stack], mode: str) -> None:
    # A hung /metrics fails each poll at the poll timeout: 0.5 s here, so that STALE_AFTER of them
    # take seconds, not the half minute the suite's generous 2 s would.
    stack = make_stack({"ENGINE_STALE_AFTER_POLLS": str(STALE_AFTER), "ENGINE_POLL_TIMEOUT_SECONDS": "0.5"})
    reason = FAULTS[mode]
    # The gate is closed by KV usage alone: 0.97 >= 0.9, and the truncated document reads `0.`.
    stack.pin(kv_usage=0.97)
    good = stack.wait_state(lambda s: s["snapshot"] and s["snapshot"]["kv_usage"] == 0.97 and not s["gate_open"],
                            "the gate to close on KV usage 0.97")
    capacity = good["snapshot"]["capacity_tokens"]
    assert capacity  # the simulator exposes vllm:cache_config_info
    with ThreadPoolExecutor(1) as pool:
        parked = pool.submit(post, stack.url + URL, chat_body(max_tokens=2), {"x-request-id": "held"})
        stack.wait_state(lambda s: s["queue_depth"] == 1, "the request to park")
        stack.sim("/control/metrics_mode", {"mode": mode})

        # Failed polls are counted and change nothing: the last good snapshot stands.
        wait_until(lambda: failures(stack, reason) >= 2, 10, f"two failed polls counted as {reason}")
        state = stack.engine_state()
        assert state["state"] == "fresh", state
        assert state["snapshot"] == good["snapshot"], state
        assert (state["gate_open"], state["queue_depth"]) == (False, 1), state
        assert stack.arrivals() == []

        # After STALE_AFTER failures in a row: stale, counted once, fail open.
        stack.wait_state(lambda s: s["state"] == "stale", "the engine state to go stale", timeout=60)
        assert parked.result(timeout=30).status == 200
    assert stack.arrivals() == ["held"]
    assert stack.metric("engine_state_stale_total", engine="default") == 1
    assert stack.metric("admission_admitted_total", via="admitted_fail_open") == 1
    assert stack.metric("observer_degraded", engine="default") == (1 if reason == "unparsable" else 0)
    assert failures(stack, reason) >= STALE_AFTER

    # Recovery: a good document makes the state fresh, the gate closes again on 0.97.
    stack.sim("/control/metrics_mode", {"mode": "ok"})
    state = stack.wait_state(lambda s: s["state"] == "fresh", "the engine state to be fresh again")
    assert state["snapshot"]["capacity_tokens"] == capacity
    stack.wait_gate(False)
    assert stack.metric("observer_degraded", engine="default") == 0
    assert stack.metric("engine_state_stale_total", engine="default") == 1


def test_a_truncated_document_never_opens_the_gate(make_stack: Callable[..., Stack]) -> None:
    """Defect 8 end to end: with the default stale threshold, a `0.` read as 0.0 would admit at once."""
    stack = make_stack()
    stack.pin(kv_usage=0.97)
    stack.wait_gate(False)
    stack.sim("/control/metrics_mode", {"mode": "truncated"})
    wait_until(lambda: failures(stack, "unparsable") >= 1, 10, "a failed poll counted as unparsable")
    state = stack.engine_state()
    # Either still the last good state (closed) or already stale: never fresh with KV 0.0.
    assert state["snapshot"]["kv_usage"] == 0.97, state
    assert state["state"] == "stale" or not state["gate_open"], state


def test_an_engine_restart_with_another_cache_size_is_taken(make_stack: Callable[..., Stack]) -> None:
    """Restart: unreachable polls make the state stale (fail open); the new engine's capacity is taken."""
    stack = make_stack(sim_args=("--num-gpu-blocks", "600"))
    first = stack.wait_state(lambda s: s["state"] == "fresh" and s["snapshot"], "a first good poll")
    block_size = first["snapshot"]["capacity_tokens"] // 600
    assert first["snapshot"]["capacity_tokens"] == 600 * block_size

    local = stack.local
    assert local.sim is not None
    local.sim.stop()
    stack.wait_state(lambda s: s["state"] == "stale", "the engine state to go stale while the engine is down")
    assert failures(stack, "unreachable") >= 3
    local.sim_args = ("--num-gpu-blocks", "400")
    local.start_sim()

    state = stack.wait_state(lambda s: s["state"] == "fresh", "the restarted engine to be polled")
    assert state["snapshot"]["capacity_tokens"] == 400 * block_size
    assert failures(stack, "unparsable") == 0
    assert stack.metric("observer_degraded", engine="default") == 0
    assert stack.metric("engine_state_stale_total", engine="default") == 1
    assert "KV capacity for the token budget" in stack.service_log()
    reply = post(stack.url + URL, chat_body(max_tokens=2), {"x-request-id": "after-restart"})
    assert reply.status == 200
    assert stack.arrivals() == ["after-restart"]
    assert stack.metric("admission_admitted_total", via="admitted") == 1


def test_a_document_that_loses_cache_config_info_keeps_the_budget(make_stack: Callable[..., Stack]) -> None:
    """Defect 8: a body cut in half must not switch the KV budget off (capacity stays known)."""
    stack = make_stack()
    first = stack.wait_state(lambda s: s["state"] == "fresh" and s["snapshot"], "a first good poll")
    capacity = first["snapshot"]["capacity_tokens"]
    assert capacity
    stack.sim("/control/metrics_mode", {"mode": "half"})
    wait_until(lambda: failures(stack, "unparsable") >= 2, 10, "two failed polls counted as unparsable")
    state = stack.engine_state()
    assert state["snapshot"]["capacity_tokens"] == capacity, state


def test_a_slow_but_answering_metrics_endpoint_is_not_a_failed_poll(make_stack: Callable[..., Stack]) -> None:
    # A busy vLLM API server answers /metrics after the poll interval (17 times in one run on the
    # real CPU engine); a poll that waits for it keeps the gate fresh instead of failing it open.
    stack = make_stack({"ENGINE_POLL_INTERVAL_SECONDS": "0.5", "ENGINE_POLL_TIMEOUT_SECONDS": "4",
                        "ENGINE_STALE_AFTER_POLLS": "2"})
    stack.pin(kv_usage=0.97)  # closed: a stale engine would fail open and admit
    stack.wait_gate(False)
    stack.sim("/control/metrics_mode", {"mode": "ok", "delay_s": 1.0})  # twice the interval, a quarter the timeout
    polls = stack.metric("engine_poll_duration_seconds_count", engine="default")
    wait_until(lambda: stack.metric("engine_poll_duration_seconds_count", engine="default") >= polls + 4, 60,
               "four slow polls")
    assert failures(stack, "timeout") == 0
    state = stack.engine_state()
    assert (state["state"], state["gate_open"]) == ("fresh", False), state
    assert stack.metric("engine_state_stale_total", engine="default") == 0
