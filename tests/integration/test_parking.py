"""A full engine parks requests in FIFO order; capacity, the park cap or the client ends the park."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from .conftest import Stack
from .http import Reply, chat_body, open_raw, post

URL = "/v1/chat/completions"


def _park(pool: ThreadPoolExecutor, stack: Stack, ids: list[str], **body: object) -> list[Future[Reply]]:
    """Send one request per id, each only once the previous one is parked, so FIFO order is known."""
    futures = []
    for request_id in ids:
        depth_before = stack.engine_state()["queue_depth"]
        futures.append(pool.submit(post, stack.url + URL, chat_body(request_id, **body), {"x-request-id": request_id}))
        stack.wait_state(lambda s, d=depth_before: s["queue_depth"] == d + 1, f"{request_id} to park")
    return futures


def test_full_engine_parks_in_fifo_order_and_a_poll_releases_them(stack: Stack) -> None:
    stack.pin(running=4, waiting=1)
    stack.wait_gate(False)
    ids = [f"fifo-{i}" for i in range(5)]
    with ThreadPoolExecutor(8) as pool:
        futures = _park(pool, stack, ids)
        assert stack.arrivals() == []  # nothing reached the engine while parked
        stack.sim("/control/unpin", {})
        replies = [f.result(timeout=30) for f in futures]
    assert [r.status for r in replies] == [200] * 5
    assert stack.arrivals() == ids
    assert stack.metric("admission_parked_total") == 5
    assert stack.metric("admission_admitted_total", via="admitted_after_park") == 5
    assert stack.metric("admission_park_duration_seconds_count", outcome="admitted_after_park") == 5


def test_local_completion_releases_the_head_without_waiting_for_a_poll(make_stack) -> None:  # noqa: ANN001
    # Polls are 60 s apart: only a completion seen on the ext_proc stream can release the head.
    stack = make_stack({"ENGINE_POLL_INTERVAL_SECONDS": "60"})
    stack.sim("/control/hold", {"hold": True})
    # Four slots plus the one request allowed to wait inside the engine (ADMISSION_ENGINE_QUEUE_SLOTS).
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(post, stack.url + URL, chat_body(f"r{i}"), {"x-request-id": f"run-{i}"})
                   for i in range(5)]
        stack.wait_state(lambda s: s["inflight"] == 5, "five admitted requests in flight")
        (parked,) = _park(pool, stack, ["waiter"])
        polls = stack.metric("engine_poll_duration_seconds_count")
        stack.sim("/control/hold", {"hold": False})
        assert parked.result(timeout=30).status == 200
        assert all(f.result(timeout=30).status == 200 for f in running)
    assert stack.metric("engine_poll_duration_seconds_count") == polls  # no poll happened in between
    assert stack.arrivals()[-1] == "waiter"
    # Tickets are released when Envoy closes each ext_proc stream, which can come just after the client's 200.
    stack.wait_state(lambda s: s["inflight"] == 0, "every ticket released when its stream closed")


def test_park_cap_answers_503_with_retry_after(make_stack) -> None:  # noqa: ANN001
    stack = make_stack({"ADMISSION_MAX_PARK_SECONDS": "1", "ADMISSION_RETRY_AFTER_SECONDS": "7"})
    stack.pin(kv_usage=0.95)
    stack.wait_gate(False)
    started = time.monotonic()
    reply = post(stack.url + URL, chat_body(), {"x-request-id": "capped"})
    assert time.monotonic() - started >= 1.0
    assert reply.status == 503
    assert reply.headers["retry-after"] == "7"
    assert reply.headers["x-admission-outcome"] == "park_timeout"
    assert reply.json()["error"]["code"] == "park_timeout"
    assert stack.arrivals() == []
    assert stack.metric("admission_rejected_total", reason="park_timeout") == 1
    assert stack.engine_state()["queue_depth"] == 0


def test_queue_overflow_is_rejected_at_once_while_the_queue_still_waits(make_stack) -> None:  # noqa: ANN001
    stack = make_stack({"VLLM_MAX_QUEUE_DEPTH": "2"})
    stack.pin(running=4, waiting=1)
    stack.wait_gate(False)
    with ThreadPoolExecutor(4) as pool:
        parked = _park(pool, stack, ["q-0", "q-1"])
        overflow = post(stack.url + URL, chat_body(), {"x-request-id": "q-2"})
        assert overflow.status == 503
        assert overflow.headers["x-admission-outcome"] == "queue_full"
        assert "retry-after" in overflow.headers
        assert all(not f.done() for f in parked)  # the queue is still waiting
        stack.sim("/control/unpin", {})
        assert [f.result(timeout=30).status for f in parked] == [200, 200]
    assert stack.arrivals() == ["q-0", "q-1"]
    assert stack.metric("admission_rejected_total", reason="queue_full") == 1


def test_client_disconnect_while_parked_frees_the_place_and_is_never_admitted(stack: Stack) -> None:
    stack.pin(running=4, waiting=1)
    stack.wait_gate(False)
    sock = open_raw(stack.url + URL, chat_body("bye"), "leaver")
    stack.wait_state(lambda s: s["queue_depth"] == 1, "the request to park")
    sock.close()
    stack.wait_state(lambda s: s["queue_depth"] == 0, "the abandoned request to leave the queue")
    assert stack.metric("admission_rejected_total", reason="client_gone") == 1
    stack.sim("/control/unpin", {})
    stack.wait_gate(True)
    assert post(stack.url + URL, chat_body(), {"x-request-id": "after"}).status == 200
    assert stack.arrivals() == ["after"]
    # Envoy answers the client before the service sees the stream end: the slot frees just after.
    stack.wait_state(lambda s: s["inflight"] == 0, "the finished request's slot to free")


def test_sigterm_answers_parked_requests_before_exiting(stack: Stack) -> None:
    stack.pin(running=4, waiting=1)
    stack.wait_gate(False)
    with ThreadPoolExecutor(2) as pool:
        (parked,) = _park(pool, stack, ["drained"])
        assert stack.local.extproc is not None
        assert stack.local.extproc.stop() == 0
        reply = parked.result(timeout=30)
    assert reply.status == 503
    assert reply.headers["x-admission-outcome"] == "shutting_down"
    assert stack.arrivals() == []


@pytest.mark.parametrize("gauge", [{"running": 2, "waiting": 3}, {"kv_usage": 0.9}])
def test_either_limit_closes_the_gate(stack: Stack, gauge: dict) -> None:
    stack.pin(**gauge)
    stack.wait_gate(False)
    with ThreadPoolExecutor(2) as pool:
        (parked,) = _park(pool, stack, ["limited"])
        stack.sim("/control/unpin", {})
        assert parked.result(timeout=30).status == 200
