"""Every answer Envoy makes itself has the service's shape: an OpenAI-style JSON error body, the
`x-admission-outcome` header naming the same code, and `Retry-After` where a retry makes sense.

Each case is produced on the real Envoy binary by the fault that causes it in production: an
engine that refuses connections, one that dies mid-request, one that says nothing for the stream
idle timeout, a failed admission service behind `--failure-mode closed`, malformed HTTP, oversized
headers. The service's own answers pass through untouched.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from devstack import free_port, wait_until
from extproc.envoyconf import LOCAL_REPLIES
from extproc.outcomes import ENVOY_REJECTIONS, REJECTIONS, Outcome

from .conftest import Stack, two_engine_env
from .http import Reply, chat_body, get, post

URL = "/v1/chat/completions"
PARK = 1  # park cap in seconds: the stream idle timeout may then be as short as 7 s
IDLE = 7


def _shaped(reply: Reply, outcome: Outcome, *, retry: bool) -> dict[str, str]:
    """Assert the service's shape with `outcome`'s status, code and type; return the error object."""
    row = ENVOY_REJECTIONS.get(outcome) or REJECTIONS[outcome]
    assert reply.status == row.status, (reply.status, reply.body)
    assert reply.headers["content-type"] == "application/json"
    assert reply.headers["x-admission-outcome"] == outcome.value
    assert ("retry-after" in reply.headers) is retry
    if retry:
        assert int(reply.headers["retry-after"]) >= 1
    error = json.loads(reply.body)["error"]
    assert set(error) == {"message", "type", "code"}
    assert (error["code"], error["type"]) == (outcome.value, row.error_type)
    assert error["message"]
    return error


def _raw(url: str, data: bytes) -> Reply:
    """Send bytes as they are and parse Envoy's HTTP/1.1 answer (it closes the connection)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return Reply(int(status_line.split()[1]), headers, body[: int(headers["content-length"])])


def _stack(make_stack: Callable[..., Stack]) -> Stack:
    return make_stack({"ADMISSION_MAX_PARK_SECONDS": str(PARK)},
                      envoy_args={"failure_mode": "closed", "stream_idle_timeout": IDLE})


def test_the_services_own_answers_pass_through_unchanged(make_stack: Callable[..., Stack]) -> None:
    stack = _stack(make_stack)
    reply = post(stack.url + URL, b'{"messages": []}')
    error = _shaped(reply, Outcome.MISSING_MODEL, retry=False)
    assert "model" in error["message"]  # the service's message, not a generic one
    reply = post(stack.url + URL, chat_body(model="nobody-serves-this"))
    error = _shaped(reply, Outcome.UNKNOWN_MODEL, retry=False)
    assert "sim-model" in error["message"]  # the service lists the known models
    assert post(stack.url + URL, chat_body(max_tokens=2)).status == 200


def test_malformed_http_and_oversized_headers(make_stack: Callable[..., Stack]) -> None:
    stack = _stack(make_stack)
    reply = _raw(stack.url, b"GARBAGE / HTTP/1.1\r\n\r\n")
    assert "codec" in _shaped(reply, Outcome.BAD_REQUEST, retry=False)["message"]
    reply = _raw(stack.url, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n")
    _shaped(reply, Outcome.HEADERS_TOO_LARGE, retry=False)


def test_an_engine_that_says_nothing_times_out_as_json(make_stack: Callable[..., Stack]) -> None:
    stack = _stack(make_stack)
    stack.sim("/control/hold", {"hold": True})
    reply = post(stack.url + URL, chat_body(max_tokens=2), timeout=IDLE + 20)
    assert "stream_idle_timeout" in _shaped(reply, Outcome.ENGINE_TIMEOUT, retry=False)["message"]


def test_an_engine_that_dies_or_refuses_and_a_failed_service(make_stack: Callable[..., Stack]) -> None:
    stack = _stack(make_stack)
    local = stack.local
    assert local.sim is not None and local.extproc is not None
    # Dies mid-request: the engine has the request, then its process is gone (reset before answering).
    stack.sim("/control/hold", {"hold": True})
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, stack.url + URL, chat_body(max_tokens=2), {"x-request-id": "cut"})
        wait_until(lambda: stack.arrivals() == ["cut"], 10, "the engine to receive the request")
        local.sim.kill()
        error = _shaped(pending.result(timeout=30), Outcome.ENGINE_UNAVAILABLE, retry=True)
    assert "upstream_reset" in error["message"]
    # Refuses connections: gated and ungated paths alike.
    error = _shaped(post(stack.url + URL, chat_body(max_tokens=2)), Outcome.ENGINE_UNAVAILABLE, retry=True)
    assert "connection_failure" in error["message"]
    _shaped(get(stack.url + "/v1/models"), Outcome.ENGINE_UNAVAILABLE, retry=True)
    # The admission service is gone and Envoy fails closed.
    local.extproc.stop()
    error = _shaped(post(stack.url + URL, chat_body(max_tokens=2)), Outcome.ADMISSION_UNAVAILABLE, retry=True)
    assert "ext_proc_error" in error["message"]


def test_with_several_engines_a_request_no_engine_was_chosen_for_is_refused_not_misrouted(
        make_stack: Callable[..., Stack], tmp_path: Path) -> None:
    sim_port = free_port()
    stack = make_stack(two_engine_env(tmp_path, sim_port, free_port(), "model-b"), sim_port=sim_port)
    assert stack.local.extproc is not None
    stack.local.extproc.kill()  # Envoy fails open: the request reaches the router without an engine
    reply = post(stack.url + URL, chat_body(model="model-b", max_tokens=2), {"x-request-id": "b"})
    error = _shaped(reply, Outcome.ENGINE_NOT_SELECTED, retry=True)
    assert "does not guess" in error["message"]
    # Chunked (two messages, not the one-message route): refused the same way.
    reply = post(stack.url + URL, chat_body(model="model-b", max_tokens=2), {"x-request-id": "b2"}, chunked=True)
    _shaped(reply, Outcome.ENGINE_NOT_SELECTED, retry=True)
    assert stack.arrivals() == []  # engine a never saw engine b's requests
    assert get(stack.url + "/v1/models").status == 200  # ungated paths keep the default route


def test_every_envoy_outcome_has_a_local_reply() -> None:
    """The table the config is built from covers every outcome Envoy answers itself."""
    assert {r.outcome for r in LOCAL_REPLIES} == set(ENVOY_REJECTIONS) | {Outcome.BODY_TOO_LARGE}
