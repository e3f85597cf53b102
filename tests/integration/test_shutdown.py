"""Stopping the service never lets a request reach a full engine without a decision.

The engine is held with as many requests as the gate admits (max in-flight + one engine queue
slot), two more are parked, and the service gets SIGTERM. Parked requests are answered at once;
newcomers while the admitted ones still run get the service's own 503 `shutting_down` (gRPC
would refuse their streams once its server stops, and Envoy would fail open); newcomers after
the service has exited are stopped by the engine cluster's circuit breaker. The simulator's
timeline is the witness that the engine never held more than the bound.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from devstack import wait_until

from .conftest import Stack
from .http import Reply, chat_body, post

pytestmark = pytest.mark.integration

URL = "/v1/chat/completions"
BOUND = 5  # ADMISSION_MAX_INFLIGHT 4 + one engine queue slot


def _send(stack: Stack, request_id: str) -> Reply:
    return post(stack.url + URL, chat_body(request_id, max_tokens=2), {"x-request-id": request_id})


def _outcome(reply: Reply) -> tuple[int, str | None]:
    return reply.status, reply.headers.get("x-admission-outcome")


def test_sigterm_with_admitted_parked_and_arriving_requests_keeps_the_engine_bound(make_stack) -> None:  # noqa: ANN001
    stack = make_stack()
    stack.sim("/control/hold", {"hold": True})  # the admitted requests stay open: the engine is full
    service = stack.local.extproc
    assert service is not None and service.process is not None
    with ThreadPoolExecutor(BOUND + 2) as pool:
        admitted = [pool.submit(_send, stack, f"admitted-{i}") for i in range(BOUND)]
        wait_until(lambda: len(stack.arrivals()) == BOUND, 10, "the engine to hold the admitted requests")
        parked = [pool.submit(_send, stack, f"parked-{i}") for i in range(2)]
        stack.wait_state(lambda s: s["queue_depth"] == 2, "two requests to park")

        service.process.send_signal(signal.SIGTERM)
        assert [_outcome(f.result(timeout=10)) for f in parked] == [(503, "shutting_down")] * 2
        # The admitted requests keep the service up for its grace: it answers newcomers itself.
        assert service.alive()
        assert _outcome(_send(stack, "during-drain")) == (503, "shutting_down")

        assert service.process.wait(timeout=30) == 0
        # Gone: Envoy fails open, and the engine cluster, full, refuses at once.
        after = _send(stack, "after-exit")
        assert _outcome(after) == (503, "engine_overloaded")
        assert after.json()["error"]["code"] == "engine_overloaded" and after.headers["retry-after"]

        stack.sim("/control/hold", {"hold": False})
        assert [f.result(timeout=30).status for f in admitted] == [200] * BOUND

    assert sorted(stack.arrivals()) == [f"admitted-{i}" for i in range(BOUND)]  # nothing else reached it
    assert max(held for _, held, _ in stack.sim("/control/timeline")["timeline"]) == BOUND


def test_with_the_service_killed_a_full_engine_gets_nothing_more(make_stack) -> None:  # noqa: ANN001
    stack = make_stack()
    stack.sim("/control/hold", {"hold": True})
    with ThreadPoolExecutor(BOUND) as pool:
        admitted = [pool.submit(_send, stack, f"admitted-{i}") for i in range(BOUND)]
        wait_until(lambda: len(stack.arrivals()) == BOUND, 10, "the engine to hold the admitted requests")
        assert stack.local.extproc is not None
        stack.local.extproc.kill()  # SIGKILL: no drain at all
        replies = [_outcome(_send(stack, f"late-{i}")) for i in range(5)]
        assert replies == [(503, "engine_overloaded")] * 5
        stack.sim("/control/hold", {"hold": False})
        # The admitted ones lose their ext_proc stream with the service; Envoy lets them finish.
        assert [f.result(timeout=30).status for f in admitted] == [200] * BOUND
    assert len(stack.arrivals()) == BOUND
    # Once the engine has room again, a fail-open Envoy admits within the bound.
    assert _send(stack, "with-room").status == 200
