"""Bad requests get an OpenAI-style JSON error from the gateway and never reach the engine."""

from __future__ import annotations

import json

import pytest

from .conftest import Stack
from .http import chat_body, post

URL = "/v1/chat/completions"


@pytest.mark.parametrize(
    "body,status,code",
    [
        (b"this is not json", 400, "invalid_body"),
        (b'["a", "list"]', 400, "invalid_body"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "missing_model"),
        (b'{"messages": [], "model": "a", "model": "sim-model"}', 400, "duplicate_model"),
        (b'{"messages": [], "model": "gpt-9"}', 404, "unknown_model"),
    ],
)
def test_bad_bodies_get_a_json_error_and_never_reach_the_engine(stack: Stack, body: bytes, status: int,
                                                                code: str) -> None:
    reply = post(stack.url + URL, body)
    assert reply.status == status
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    assert stack.arrivals() == []
    assert stack.metric("admission_rejected_total", reason=code) == 1


def test_unknown_model_lists_the_known_models(stack: Stack) -> None:
    reply = post(stack.url + URL, chat_body(model="gpt-9", model_last=True))
    assert reply.status == 404 and "sim-model" in reply.json()["error"]["message"]


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_body_is_413_without_reaching_the_engine(make_stack, chunked: bool) -> None:  # noqa: ANN001
    stack = make_stack({"MAX_BODY_BYTES": "65536"})
    stack.pin(running=4, waiting=1)  # a full engine must not delay the 413
    stack.wait_gate(False)
    big = chat_body("x" * 70000)
    reply = post(stack.url + URL, big, chunked=chunked)
    assert reply.status == 413
    assert reply.json()["error"]["code"] == "body_too_large"
    assert "65536" in reply.json()["error"]["message"]
    assert stack.engine_state()["queue_depth"] == 0
    assert stack.arrivals() == []


def test_body_exactly_at_the_cap_is_admitted(make_stack) -> None:  # noqa: ANN001
    # 64 bytes per token keeps the 64 KiB prompt inside the small simulator's context.
    stack = make_stack({"MAX_BODY_BYTES": "65536", "ADMISSION_BYTES_PER_TOKEN": "64"},
                       sim_args=("--bytes-per-token", "64"))
    skeleton = len(chat_body(""))
    body = chat_body("y" * (65536 - skeleton))
    assert len(body) == 65536
    for chunked in (False, True):
        assert post(stack.url + URL, body, chunked=chunked).status == 200


def test_post_without_a_body_is_a_400(stack: Stack) -> None:
    reply = post(stack.url + URL, b"")
    assert reply.status == 400
    assert json.loads(reply.body)["error"]["code"] == "invalid_body"
