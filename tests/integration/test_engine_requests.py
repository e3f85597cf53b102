"""A request that becomes several engine requests (`n`, a prompt list) takes that many slots: the
engine never holds more than the gate's bound, whatever each HTTP request asks for."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .conftest import Stack
from .http import chat_body, post

URL = "/v1/chat/completions"


def test_n_choices_take_n_slots_and_the_engine_never_holds_more_than_the_bound(stack: Stack) -> None:
    # Bound: 4 slots + 1 engine queue slot = 5 engine requests. Each request asks for 4 choices,
    # which the engine runs as 4 requests: one fits, the next two must wait at the gate.
    stack.sim("/control/hold", {"hold": True})  # nothing finishes: the engine's queue shows all it got
    with ThreadPoolExecutor(3) as pool:
        replies = [pool.submit(post, stack.url + URL, chat_body(f"choices {i}", n=4, max_tokens=4),
                               {"x-request-id": f"n4-{i}"}) for i in range(3)]
        stack.wait_state(lambda s: s["queue_depth"] == 2, "the second and third request to park")
        engine = stack.sim("/control/state")
        assert engine["running"] + engine["waiting"] == 4, engine  # one request's four choices, not twelve
        stack.sim("/control/hold", {"hold": False})
        done = [r.result(timeout=60) for r in replies]
    assert [r.status for r in done] == [200, 200, 200]
    assert all(len(r.json()["choices"]) == 4 for r in done)
    assert stack.metric("admission_admitted_total", via="admitted_after_park") == 2
