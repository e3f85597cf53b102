"""A request the model's context limit refuses is answered at once by the gateway, in the engine's
own words, and never reaches the engine: the simulator lists `max_model_len` on /v1/models as
vLLM does, and Envoy's own upstream counter says whether anything was sent to it."""

from __future__ import annotations

from collections.abc import Callable

from .conftest import Stack
from .http import chat_body, post

URL = "/v1/chat/completions"
#: ~5,000 tokens with the simulator's vocabulary: over a 4,096-token context
LONG = "The quick brown fox jumps over the lazy dog. " * 500
#: 4,096-token context and 32,768 KV tokens: a long prompt fits the KV budget, not the context
ROOMY = ("--max-model-len", "4096", "--num-gpu-blocks", "2048")
SENT_UPSTREAM = r"^cluster\.engine_default\.upstream_rq_total$"


def test_a_prompt_counted_over_max_model_len_is_refused_at_once_and_never_forwarded(
        make_stack: Callable[..., Stack]) -> None:
    # every prompt counted by the engine's /tokenize
    stack = make_stack({"ADMISSION_ESTIMATE": "counted", "ADMISSION_TOKENIZE_ABOVE_BYTES": "1"}, sim_args=ROOMY)
    reply = post(stack.url + URL, chat_body(LONG, max_tokens=16))
    assert reply.status == 400, reply.body
    assert reply.headers["x-admission-outcome"] == "context_length_exceeded"
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("This model's maximum context length is 4096 tokens. However, your prompt "
                                       "contains ")
    assert stack.envoy_stat(SENT_UPSTREAM) == 0  # the engine never saw it
    assert stack.metric("admission_rejected_total", reason="context_length_exceeded") == 1
    state = stack.engine_state()
    assert (state["queue_depth"], state["inflight"]) == (0, 0)  # no slot or queue entry left behind
    assert post(stack.url + URL, chat_body("Hi", max_tokens=4)).status == 200


def test_an_output_limit_over_max_model_len_is_refused_at_once(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack(sim_args=ROOMY)
    reply = post(stack.url + URL, chat_body("Hi", max_tokens=5000))
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["message"].startswith("max_tokens=5000 cannot be greater than max_model_len=4096.")
    assert stack.envoy_stat(SENT_UPSTREAM) == 0


def test_a_prompt_only_estimated_over_the_limit_is_left_to_the_engine(make_stack: Callable[..., Stack]) -> None:
    # Never counted exactly (the engine's /tokenize is not asked): the bytes rule over-estimates
    # on purpose, so the gateway cannot be sure; the request goes on and the engine refuses it
    # itself, before scheduling it.
    stack = make_stack({"ADMISSION_ESTIMATE": "counted", "ADMISSION_TOKENIZE_ABOVE_BYTES": "0"}, sim_args=ROOMY)
    reply = post(stack.url + URL, chat_body(LONG, max_tokens=16))
    assert reply.status == 400, reply.body
    assert reply.headers.get("x-admission-outcome") != "context_length_exceeded"
    assert "maximum context length is 4096" in reply.json()["error"]["message"]  # the engine's own answer
    assert stack.envoy_stat(SENT_UPSTREAM) == 1
    assert stack.engine_state()["inflight"] == 0
