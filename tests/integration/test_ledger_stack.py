"""Two replicas (each an Envoy with its own admission service) share one engine through Redis.

The real processes: one enginesim, two Envoys, two `extproc serve`, one Debian redis-server.
With ADMISSION_MAX_INFLIGHT=1 the two replicas together admit one request at a time: a request
sent through the second Envoy parks behind one admitted by the first, and the first's completion
releases it without a poll. A replica whose service is SIGKILLed holding a request: its lease
expires, and the scrape charges the request it left running to `others` until it ends. A Redis
flushed under eight parked requests: both replicas find the state lost and put their requests
back, and every parked client gets the service's own answer, none Envoy's fail-open.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from devstack import LocalStack, RedisServer

from .conftest import FAST, Stack
from .http import chat_body, post
from .test_ledger import _require_redis

URL = "/v1/chat/completions"


@pytest.fixture
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Stack, Stack, RedisServer]]:
    _require_redis()
    redis = RedisServer(tmp_path / "redis").start()
    env = {**FAST, "ADMISSION_LEDGER": "redis", "ADMISSION_REDIS_URL": redis.url, "ADMISSION_MAX_INFLIGHT": "1",
           "ADMISSION_ENGINE_QUEUE_SLOTS": "0", "ADMISSION_LEDGER_LEASE_SECONDS": "1",
           **getattr(request, "param", {})}
    first = LocalStack(tmp_path / "a", extproc_env=env)
    stacks = [first]
    try:
        first.start()
        second = LocalStack(tmp_path / "b", engine_url=first.engine_base, extproc_env=env)
        stacks.append(second)
        second.start()
        yield Stack(first), Stack(second), redis
    finally:
        failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
        for local in reversed(stacks):
            if failed:
                print(f"\n===== logs of {local.workdir.name} =====\n{local.logs()}")
            local.stop()
        redis.stop()


def _peak_held(stack: Stack) -> int:
    """The most requests the simulator ever held at once (its own timeline)."""
    return max((held for _, held, _ in stack.sim("/control/timeline")["timeline"]), default=0)


def _fresh(stack: Stack) -> None:
    stack.wait_state(lambda s: s["state"] == "fresh", "a good poll")


@pytest.mark.parametrize("pair", [{"ENGINE_POLL_INTERVAL_SECONDS": "60"}], indirect=True)
def test_a_completion_behind_one_envoy_releases_a_request_parked_behind_the_other(pair) -> None:  # noqa: ANN001
    a, b, _ = pair
    _fresh(a), _fresh(b)
    a.sim("/control/hold", {"hold": True})
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(post, a.url + URL, chat_body("first"), {"x-request-id": "first"})
        a.wait_state(lambda s: s["inflight"] == 1, "the first request admitted (shared state)")
        second = pool.submit(post, b.url + URL, chat_body("second"), {"x-request-id": "second"})
        b.wait_state(lambda s: s["queue_depth"] == 1, "the second request parked behind the other replica's")
        assert a.arrivals() == ["first"]
        polls = a.metric("engine_poll_duration_seconds_count") + b.metric("engine_poll_duration_seconds_count")
        a.sim("/control/hold", {"hold": False})
        assert first.result(timeout=30).status == 200
        assert second.result(timeout=30).status == 200
    # Polls are 60 s apart: only replica A's completion, published through Redis, released it.
    assert a.metric("engine_poll_duration_seconds_count") + b.metric("engine_poll_duration_seconds_count") == polls
    assert a.arrivals() == ["first", "second"]
    assert b.metric("admission_admitted_total", via="admitted_after_park") == 1
    assert a.metric("admission_parked_total") == 0
    b.wait_state(lambda s: s["inflight"] == 0 and s["queue_depth"] == 0, "nothing left in the shared state")


def test_a_killed_replicas_lease_expires_and_its_running_request_is_charged_by_the_scrape(pair) -> None:  # noqa: ANN001
    a, b, _ = pair
    _fresh(a), _fresh(b)
    a.sim("/control/hold", {"hold": True})
    with ThreadPoolExecutor(4) as pool:
        orphan = pool.submit(post, b.url + URL, chat_body("orphan"), {"x-request-id": "orphan"})
        a.wait_state(lambda s: s["inflight"] == 1, "B's request admitted (shared state)")
        assert b.local.extproc is not None and b.local.extproc.process is not None
        b.local.extproc.process.send_signal(signal.SIGKILL)  # B's service dies holding the request
        b.local.extproc.process.wait(10)
        # Within a lease (1 s) plus a renewal, A drops B's ticket...
        a.wait_state(lambda s: s["inflight"] == 0, "B's dead lease dropped", timeout=10)
        assert a.metric("admission_ledger_lease_expiries_total") == 1
        # ...but B's request still runs at the engine: the scrape shows it, so A still parks.
        a.wait_state(lambda s: s["snapshot"] is not None and s["snapshot"]["running"] + s["snapshot"]["waiting"] == 1,
                     "the engine's gauges show it")
        waiting = pool.submit(post, a.url + URL, chat_body("waiting"), {"x-request-id": "waiting"})
        a.wait_state(lambda s: s["queue_depth"] == 1, "A's request parked behind the orphan")
        assert a.arrivals() == ["orphan"]
        a.sim("/control/hold", {"hold": False})
        assert waiting.result(timeout=30).status == 200
        assert orphan.result(timeout=30).status == 200  # B's Envoy still proxies what it admitted
    assert a.arrivals() == ["orphan", "waiting"]
    # A's ticket is released when Envoy closes the ext_proc stream, which can come just after the client's 200.
    a.wait_state(lambda s: s["inflight"] == 0, "A's ticket released when its stream closed")


PARKED = 8  # VLLM_MAX_QUEUE_DEPTH's default: the most one engine parks


@pytest.mark.parametrize("pair", [{"ADMISSION_MAX_PARK_SECONDS": "4"}], indirect=True)
def test_a_flushed_ledger_never_sends_parked_requests_ungated_to_a_full_engine(pair) -> None:  # noqa: ANN001
    import redis as redis_client

    a, b, redis = pair
    _fresh(a), _fresh(b)
    a.sim("/control/hold", {"hold": True})  # nothing finishes: the engine stays full throughout
    with ThreadPoolExecutor(PARKED + 2) as pool:
        holder = pool.submit(post, a.url + URL, chat_body("holder"), {"x-request-id": "holder"})
        a.wait_state(lambda s: s["inflight"] == 1, "the holder admitted: the engine is full (bound 1)")
        parked = [pool.submit(post, (a, b)[i % 2].url + URL, chat_body(f"parked {i}"), {"x-request-id": f"p{i}"},
                              timeout=60) for i in range(PARKED)]
        a.wait_state(lambda s: s["queue_depth"] == PARKED, "eight requests parked across both replicas")
        with redis_client.Redis.from_url(redis.url) as client:
            assert client.flushall()
        replies = [f.result(timeout=60) for f in parked]
        # Every parked client got the service's own answer at the cap, none Envoy's fail-open...
        assert [r.status for r in replies] == [503] * PARKED
        assert [r.headers.get("x-admission-outcome") for r in replies] == ["park_timeout"] * PARKED
        assert all(r.json()["error"]["code"] == "park_timeout" and "retry-after" in r.headers for r in replies)
        # ...so nothing but the holder ever reached the engine.
        assert a.arrivals() == ["holder"]
        a.sim("/control/hold", {"hold": False})
        assert holder.result(timeout=30).status == 200
    assert _peak_held(a) <= 1
    # Each replica found the state it knew gone and put its own requests back.
    for x in (a, b):
        assert x.metric("admission_ledger_state_lost_total") >= 1
        x.wait_state(lambda s: s["inflight"] == 0 and s["queue_depth"] == 0, "the ledger empty again")
    print(f"flush under {PARKED} parked: {dict(Counter(r.headers.get('x-admission-outcome') for r in replies))}; "
          f"answered by the replica's own deadline: {a.metric('admission_park_deadline_local_total')} + "
          f"{b.metric('admission_park_deadline_local_total')}; engine arrivals {a.arrivals()}, peak held "
          f"{_peak_held(a)}")
    # The gate still works on the rebuilt state: a new request through B is admitted and served.
    assert post(b.url + URL, chat_body("after"), {"x-request-id": "after"}).status == 200
    assert a.arrivals() == ["holder", "after"]
