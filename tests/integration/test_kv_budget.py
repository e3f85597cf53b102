"""The KV-token budget on the real stack: it sees what a request will cost before the gauge does."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .conftest import Stack
from .http import chat_body, post

URL = "/v1/chat/completions"


def test_capacity_comes_from_the_engines_cache_config_info(stack: Stack) -> None:
    state = stack.engine_state()
    assert state["snapshot"]["capacity_tokens"] == 512 * 16  # the small simulator preset
    assert stack.metric("vllm_kv_capacity_tokens") == 8192
    assert "vllm:cache_config_info" in stack.service_log()


def test_a_request_bigger_than_the_whole_cache_is_refused_at_once(stack: Stack) -> None:
    reply = post(stack.url + URL, chat_body("z" * 40_000, max_tokens=16))  # ~10k tokens > 8,192
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["code"] == "exceeds_kv_capacity" and "8192" in error["message"]
    assert stack.arrivals() == []
    assert stack.engine_state()["queue_depth"] == 0


def test_the_budget_parks_what_the_gauges_cannot_see_yet(stack: Stack) -> None:
    # Each request: 12,000 bytes = 3,000 prompt tokens + 500 generated = 3,504 reserved.
    body = {"max_tokens": 500}
    stack.sim("/control/hold", {"hold": True})  # the engine allocates nothing: KV gauge stays at 0
    with ThreadPoolExecutor(4) as pool:
        first = [pool.submit(post, stack.url + URL, chat_body("a" * 12_000, **body), {"x-request-id": f"kv-{i}"})
                 for i in range(2)]
        stack.wait_state(lambda s: s["inflight"] == 2, "two admitted requests")
        third = pool.submit(post, stack.url + URL, chat_body("b" * 12_000, **body), {"x-request-id": "kv-2"})
        state = stack.wait_state(lambda s: s["queue_depth"] == 1, "the third request to park")
        # The slot and KV-threshold gates are open and the gauge shows no KV in use: only the
        # budget, which knows the two admitted requests will need 7,008 tokens, holds it back.
        assert state["gate_open"] and state["snapshot"]["kv_usage"] == 0.0
        assert stack.metric("admission_kv_reserved_tokens") == 2 * 3504
        assert stack.metric("admission_kv_available_tokens") < 3504
        stack.sim("/control/hold", {"hold": False})
        assert [f.result(timeout=30).status for f in first] == [200, 200]
        assert third.result(timeout=30).status == 200
    arrivals = stack.arrivals()
    assert sorted(arrivals[:2]) == ["kv-0", "kv-1"] and arrivals[2] == "kv-2"
    assert stack.metric("admission_kv_reserved_tokens") == 0
    sim_state = stack.sim("/control/state")
    assert sim_state["num_preemptions"] == 0


def test_envoys_sharing_one_service_share_one_exact_budget(make_stack) -> None:  # noqa: ANN001
    first = make_stack()
    second = make_stack(engine_url=first.local.engine_base, shared_extproc=first.local)
    body = {"max_tokens": 500}  # 3,504 reserved each; two fit in the 8,192-token cache, three do not
    first.sim("/control/hold", {"hold": True})
    with ThreadPoolExecutor(4) as pool:
        a = pool.submit(post, first.url + URL, chat_body("a" * 12_000, **body), {"x-request-id": "via-1"})
        first.wait_state(lambda s: s["inflight"] == 1, "one admitted via the first Envoy")
        b = pool.submit(post, second.url + URL, chat_body("b" * 12_000, **body), {"x-request-id": "via-2"})
        first.wait_state(lambda s: s["inflight"] == 2, "one admitted via the second Envoy")
        c = pool.submit(post, second.url + URL, chat_body("c" * 12_000, **body), {"x-request-id": "via-2b"})
        first.wait_state(lambda s: s["queue_depth"] == 1, "the third to park: the ledger saw both Envoys")
        first.sim("/control/hold", {"hold": False})
        assert [f.result(timeout=30).status for f in (a, b, c)] == [200, 200, 200]
    assert first.arrivals() == ["via-1", "via-2", "via-2b"]
    assert first.sim("/control/state")["num_preemptions"] == 0


def test_envoys_sharing_a_service_fail_open_when_it_is_gone(make_stack) -> None:  # noqa: ANN001
    first = make_stack()
    second = make_stack(engine_url=first.local.engine_base, shared_extproc=first.local)
    assert first.local.extproc is not None
    first.local.extproc.stop()
    for stack, request_id in ((first, "open-1"), (second, "open-2")):
        assert post(stack.url + URL, chat_body(), {"x-request-id": request_id}).status == 200
    assert first.arrivals() == ["open-1", "open-2"]
