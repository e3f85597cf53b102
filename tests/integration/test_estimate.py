"""The counted prompt estimate on the real stack (Envoy, the service, the simulator counting with
Qwen3's vocabulary): a cold-start burst of dense prompts is reserved at the engine's own count,
where the old bytes/4 estimate lets the whole burst in; the engine counter feeds the ratio."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.text import sized_content
from devstack import http_get, wait_until

from .conftest import Stack
from .http import chat_body, post

URL = "/v1/chat/completions"
# The counted estimate with its defaults (conftest pins the old one for the other tests), asking
# the engine from 1 KiB: the small simulator's cache holds 8,192 tokens, so its prompts are small.
COUNTED = {"ADMISSION_ESTIMATE": "counted", "ADMISSION_BYTES_PER_TOKEN": "2.5",
           "ADMISSION_TOKENIZE_ABOVE_BYTES": "1024"}
HEX = [sized_content("hex", 3000, seed=11, index=i) for i in range(3)]  # 3,000 true tokens, ~3.4 KB each


def burst(stack: Stack) -> tuple[dict[str, Any], list[int]]:
    """Three 3,000-token hex prompts (+ 500 generated) while the engine holds everything: two fit the
    8,192-token cache, three do not. Returns the gate's state once the burst has been decided."""
    stack.sim("/control/hold", {"hold": True})  # the engine allocates nothing: the KV gauge stays at 0
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, stack.url + URL, chat_body(content, max_tokens=500), {"x-request-id": f"hex-{i}"})
                   for i, content in enumerate(HEX)]
        state = stack.wait_state(lambda s: s["inflight"] + s["queue_depth"] == 3, "the burst to be decided")
        stack.sim("/control/hold", {"hold": False})
        statuses = [f.result(timeout=60).status for f in futures]
    return state, statuses


def test_a_cold_start_burst_of_dense_prompts_is_reserved_at_the_engines_count(make_stack: Any) -> None:
    stack = make_stack(COUNTED)
    state, statuses = burst(stack)
    assert (state["inflight"], state["queue_depth"]) == (2, 1)  # the third waits for room
    assert statuses == [200, 200, 200]
    assert stack.metric("admission_estimate_source_total", source="engine") == 3
    assert stack.sim("/control/state")["num_preemptions"] == 0
    # Exact counts: what was estimated is what the engine counted (once a poll has seen it all).
    estimated = stack.metric("admission_estimated_prompt_tokens_total")
    assert estimated == 3 * 3000
    wait_until(lambda: stack.metric("admission_engine_prompt_tokens_total") == estimated, 10.0,
               "the engine's prompt-token counter to reach the estimate")


def test_the_old_estimate_lets_the_same_burst_in_at_once(make_stack: Any) -> None:
    stack = make_stack({"ADMISSION_ESTIMATE": "bytes", "ADMISSION_BYTES_PER_TOKEN": "4"})
    state, statuses = burst(stack)
    assert (state["inflight"], state["queue_depth"]) == (3, 0)  # ~850 tokens each by bytes / 4
    assert statuses == [200, 200, 200]
    assert stack.metric("admission_estimate_source_total", source="bytes") == 3
    assert stack.metric("admission_estimated_prompt_tokens_total") < 3 * 3000 / 3


def test_when_the_engine_is_not_asked_small_prompts_use_the_prior(make_stack: Any) -> None:
    stack = make_stack({**COUNTED, "ADMISSION_TOKENIZE_ABOVE_BYTES": "0"})
    reply = post(stack.url + URL, chat_body("Hello there", max_tokens=4, n=2))
    assert reply.status == 200 and len(reply.json()["choices"]) == 2
    assert stack.metric("admission_estimate_source_total", source="prior") == 1
    # n = 2: two prompts, as the engine counts them ("Hello there" at 2.5 bytes/token + the template).
    assert stack.metric("admission_estimated_prompt_tokens_total") == 2 * (5 + 32 + 5)


# 1,900 one-character text parts: vLLM renders them joined with "\n", 3,807 Qwen3 tokens, in a
# 58 KB body whose text is only 1,900 bytes.
PARTS = [{"role": "user", "content": [{"type": "text", "text": "abcdefghij"[i % 10]} for i in range(1900)]}]
PARTS_TOKENS = 3807


def test_many_tiny_content_parts_are_reserved_at_the_engines_count_and_never_preempt(make_stack: Any) -> None:
    """Four such requests (+ 1,000 generated): one fits the 8,192-token cache at the engine's
    count. Counted by their 1,900 text bytes (797 tokens each) all four were let in, the engine
    started two whose generations outgrew the cache and preempted; counted by the engine (the
    body is over the threshold), one runs at a time."""
    stack = make_stack({**COUNTED, "ADMISSION_TOKENIZE_ABOVE_BYTES": "8192"}, sim_args=("--max-model-len", "8176"))
    body = json.dumps({"model": "sim-model", "messages": PARTS, "max_tokens": 1000}).encode()
    stack.sim("/control/hold", {"hold": True})  # the engine allocates nothing until the burst is decided
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, stack.url + URL, body, {"x-request-id": f"parts-{i}"}) for i in range(4)]
        state = stack.wait_state(lambda s: s["inflight"] + s["queue_depth"] == 4, "the burst to be decided")
        stack.sim("/control/hold", {"hold": False})
        replies = [f.result(timeout=120) for f in futures]
    assert (state["inflight"], state["queue_depth"]) == (1, 3)
    assert [r.status for r in replies] == [200] * 4
    assert [r.json()["usage"]["prompt_tokens"] for r in replies] == [PARTS_TOKENS] * 4
    assert stack.metric("admission_estimate_source_total", source="engine") == 4
    assert stack.metric("admission_estimated_prompt_tokens_total") == 4 * PARTS_TOKENS
    assert engine_counter(stack, "vllm:num_preemptions_total") == 0


def engine_counter(stack: Stack, name: str) -> float:
    """A counter as the engine (the simulator) exposes it on its /metrics, summed over its series."""
    status, text = http_get(f"{stack.local.engine_base}/metrics")
    assert status == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))
