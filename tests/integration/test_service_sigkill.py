"""The service SIGKILLed while it holds parked requests on a full engine: nothing answers those
requests for the service (no drain, no 503 `shutting_down`), so Envoy's failure mode does.
Fail-open (the default) sends each parked request on to the router, where the engine cluster's
circuit breaker (max in-flight + engine queue slots) refuses it with Envoy's own 503
`engine_overloaded`; fail-closed answers each 503 `admission_unavailable`. Either way the
simulator's arrivals and timeline are the witness: the engine never holds more than the bound.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from devstack import wait_until

from .http import Reply, chat_body, post

pytestmark = pytest.mark.integration

URL = "/v1/chat/completions"
BOUND = 5  # ADMISSION_MAX_INFLIGHT 4 + one engine queue slot
PARKED = 6  # within VLLM_MAX_QUEUE_DEPTH (8)


def _send(url: str, request_id: str) -> Reply:
    return post(url + URL, chat_body(request_id, max_tokens=2), {"x-request-id": request_id}, timeout=60)


def _outcome(reply: Reply) -> tuple[int, str | None]:
    return reply.status, reply.headers.get("x-admission-outcome")


# (failure mode, what each parked request gets, what each admitted one whose response had not
# started gets): fail-closed also ends the admitted requests' HTTP streams when their ext_proc
# stream breaks, before the engine's answer starts.
CASES = [("open", (503, "engine_overloaded"), (200, None)),
         ("closed", (503, "admission_unavailable"), (503, "admission_unavailable"))]


@pytest.mark.parametrize("failure_mode,parked_answer,admitted_answer", CASES, ids=[c[0] for c in CASES])
def test_a_service_killed_with_parked_requests_never_lets_them_past_the_engine_bound(
        make_stack, failure_mode: str, parked_answer: tuple[int, str],  # noqa: ANN001
        admitted_answer: tuple[int, str | None]) -> None:
    stack = make_stack(envoy_args={"failure_mode": failure_mode})
    service = stack.local.extproc
    assert service is not None and service.process is not None
    stack.sim("/control/hold", {"hold": True})  # the admitted requests stay open: the engine is full
    with ThreadPoolExecutor(BOUND + PARKED) as pool:
        admitted = [pool.submit(_send, stack.url, f"admitted-{i}") for i in range(BOUND)]
        wait_until(lambda: len(stack.arrivals()) == BOUND, 20, "the engine to hold the admitted requests")
        parked = [pool.submit(_send, stack.url, f"parked-{i}") for i in range(PARKED)]
        stack.wait_state(lambda s: s["queue_depth"] == PARKED, f"{PARKED} requests to park", timeout=20)

        service.process.send_signal(signal.SIGKILL)
        assert service.process.wait(timeout=30) == -signal.SIGKILL
        replies = [f.result(timeout=60) for f in parked]
        assert [_outcome(r) for r in replies] == [parked_answer] * PARKED
        assert all(r.json()["error"]["code"] == parked_answer[1] and r.headers["retry-after"] for r in replies)
        assert sorted(stack.arrivals()) == sorted(f"admitted-{i}" for i in range(BOUND))  # no parked one got in

        stack.sim("/control/hold", {"hold": False})
        # The admitted requests lose their ext_proc stream with the service: fail-open lets them
        # finish; fail-closed answers them itself.
        assert [_outcome(f.result(timeout=60)) for f in admitted] == [admitted_answer] * BOUND
    assert len(stack.arrivals()) == BOUND
    assert max(held for _, held, _ in stack.sim("/control/timeline")["timeline"]) == BOUND
