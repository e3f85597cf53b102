"""Admitted requests reach the engine unchanged and come back unchanged, whatever the client."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from devstack import Child, free_port, simulator_argv, wait_until, with_checkout

from .conftest import Stack, two_engine_env
from .http import Reply, chat_body, get, post


def _arrival(stack: Stack, request_id: str) -> dict:
    (entry,) = [a for a in stack.sim("/control/arrivals")["arrivals"] if a["id"] == request_id]
    return entry


def test_admitted_requests_pass_byte_for_byte_both_ways(stack: Stack) -> None:
    for i, (stream, model_last) in enumerate([(False, False), (False, True), (True, False), (True, True)]):
        body = chat_body(f"request {i}", model_last=model_last, stream=stream, max_tokens=8)
        reply = post(f"{stack.url}/v1/chat/completions", body, {"x-request-id": f"bytes-{i}"})
        assert reply.status == 200
        entry = _arrival(stack, f"bytes-{i}")
        assert entry["body_sha256"] == hashlib.sha256(body).hexdigest()
        stack.wait_state(lambda s: s["inflight"] == 0, "the finished request to leave the ledger")
        entry = _arrival(stack, f"bytes-{i}")
        assert entry["response_sha256"] == hashlib.sha256(reply.body).hexdigest()
        if stream:
            assert reply.headers["content-type"].startswith("text/event-stream")
            assert reply.body.rstrip().endswith(b"data: [DONE]")
    assert stack.metric("admission_admitted_total", via="admitted") == 4


def test_official_openai_client_streaming_and_not(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason == "length" or chunks[-1].choices == []
    legacy = client.completions.create(model="sim-model", prompt="Once upon", max_tokens=4)
    assert legacy.choices[0].text
    assert stack.metric("admission_admitted_total", via="admitted") == 3


def test_unknown_model_through_the_openai_client_is_a_not_found_error(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    try:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])
    except openai.NotFoundError as exc:
        assert "gpt-9" in str(exc) and "sim-model" in str(exc)
    else:
        raise AssertionError("expected a 404")


def test_ungated_paths_pass_through_even_while_the_gate_is_closed(stack: Stack) -> None:
    stack.pin(running=4, waiting=1)
    stack.wait_gate(False)
    models = get(f"{stack.url}/v1/models")
    assert models.status == 200 and models.json()["data"][0]["id"] == "sim-model"
    assert get(f"{stack.url}/health").status == 200
    assert stack.metric("admission_passthrough_total", reason="path_not_gated") == 2
    assert stack.engine_state()["queue_depth"] == 0


def test_no_observed_models_admits_everything_ungated(make_stack) -> None:  # noqa: ANN001
    stack = make_stack({"ADMISSION_OBSERVE_MODELS": ""})
    stack.pin(running=4, waiting=1)
    reply = post(f"{stack.url}/v1/chat/completions", chat_body(model="anything-at-all"))
    assert reply.status == 404  # the engine's own answer: the gateway did not judge the model
    assert "x-admission-outcome" not in reply.headers
    assert json.loads(reply.body)["error"]["type"] == "NotFoundError"
    assert stack.metric("admission_passthrough_total", reason="no_models_configured") == 1


def test_several_engines_are_routed_by_model(make_stack, tmp_path: Path) -> None:  # noqa: ANN001
    sim_port, other_port = free_port(), free_port()
    other = Child("enginesim-b", simulator_argv("--port", str(other_port), "--model", "other-model"),
                  with_checkout({}), tmp_path / "enginesim-b.log")
    other.start()
    try:
        stack = make_stack(two_engine_env(tmp_path, sim_port, other_port, "other-model"), sim_port=sim_port)

        def sent(body: bytes, request_id: str, chunked: bool = False) -> tuple[dict, int]:
            """The answer, and how many messages the service got for the request."""
            before = stack.envoy_stat(r"^http\.inference\.ext_proc\.stream_msgs_sent$")
            reply = post(f"{stack.url}/v1/chat/completions", body, {"x-request-id": request_id}, chunked=chunked)
            assert reply.status == 200, reply.body
            return reply.json(), stack.envoy_stat(r"^http\.inference\.ext_proc\.stream_msgs_sent$") - before

        # A POST declaring its body is one message (the body alone) with several engines too: the
        # service names the engine in the request's metadata and Envoy chooses the route again.
        a, messages_a = sent(chat_body(model="sim-model"), "to-a")
        b, messages_b = sent(chat_body(model="other-model", model_last=True), "to-b")
        assert (a["model"], messages_a) == ("sim-model", 1)
        assert (b["model"], messages_b) == ("other-model", 1)
        # A chunked body keeps two messages (headers, then the body) and the same routing.
        c, messages_c = sent(chat_body(model="other-model"), "to-b-chunked", chunked=True)
        assert (c["model"], messages_c) == ("other-model", 2)
        assert stack.arrivals() == ["to-a"]
        assert stack.metric("admission_admitted_total", engine="b", model="other-model") == 2
    finally:
        other.stop()


def test_with_several_engines_a_parked_one_message_request_reaches_its_engine_only_once_admitted(
        make_stack, tmp_path: Path) -> None:  # noqa: ANN001
    sim_port = free_port()  # engine a; engine b is never asked here
    stack = make_stack(two_engine_env(tmp_path, sim_port, free_port(), "model-b"), sim_port=sim_port)
    stack.pin(running=4, waiting=1)
    stack.wait_state(lambda s: s["gate_open"] is False, "engine a full", engine="a")
    sent = stack.envoy_stat(r"^http\.inference\.ext_proc\.stream_msgs_sent$")
    with ThreadPoolExecutor(1) as pool:
        parked = pool.submit(post, f"{stack.url}/v1/chat/completions", chat_body(model="sim-model", max_tokens=2),
                             {"x-request-id": "parked"})
        stack.wait_state(lambda s: s["queue_depth"] == 1, "the request to park", engine="a")
        assert stack.arrivals() == []  # held: its route answers no engine until the service names one
        stack.sim("/control/unpin", {})
        reply = parked.result(timeout=30)
    assert (reply.status, reply.json()["model"]) == (200, "sim-model")
    assert stack.arrivals() == ["parked"]
    assert stack.envoy_stat(r"^http\.inference\.ext_proc\.stream_msgs_sent$") - sent == 1  # the body alone
    assert stack.metric("admission_admitted_total", engine="a", via="admitted_after_park") == 1


def _h2_post_with_trailers(port: int, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """POST over HTTP/2 (prior knowledge) with the body in one DATA frame and request trailers after it."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", "gateway"),
                              ("content-type", "application/json"), ("te", "trailers")])
        conn.send_data(1, body)
        conn.send_headers(1, [("x-checksum", "abc")], end_stream=True)
        sock.sendall(conn.data_to_send())
        status, headers, data = 0, {}, b""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            for event in conn.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    headers = dict(event.headers)
                    status = int(headers[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    return status, headers, data
            sock.sendall(conn.data_to_send())
    raise AssertionError("no complete HTTP/2 answer within 30 s")


def test_request_trailers_do_not_make_a_small_body_too_large(stack: Stack) -> None:
    body = chat_body("hi", max_tokens=2)
    assert len(body) < 100
    status, headers, data = _h2_post_with_trailers(stack.local.envoy_port, "/v1/chat/completions", body)
    assert (status, headers.get("x-admission-outcome")) == (200, None), data
    assert json.loads(data)["model"] == "sim-model"
    assert stack.metric("admission_admitted_total", via="admitted") == 1
    assert stack.metric("admission_rejected_total", reason="body_too_large") == 0


def test_with_several_engines_a_chunked_body_after_the_headers_answer_reaches_the_engine_the_service_named(
        make_stack, tmp_path: Path) -> None:  # noqa: ANN001
    # The body arrives only once the service has answered the headers: Envoy must still hold the
    # headers until the body's answer names the engine (before the fix it let them on to the router,
    # which chose the engine_not_selected route, and the answer could no longer re-route).
    sim_port = free_port()
    stack = make_stack(two_engine_env(tmp_path, sim_port, free_port(), "model-b"), sim_port=sim_port)
    answers = r"^http\.inference\.ext_proc\.stream_msgs_received$"
    body = chat_body(model="sim-model", max_tokens=2)
    for attempt in range(3):
        before = stack.envoy_stat(answers)
        with socket.create_connection(("127.0.0.1", stack.local.envoy_port), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                         b"x-request-id: late-body-%d\r\ntransfer-encoding: chunked\r\n\r\n" % attempt)
            wait_until(lambda before=before: stack.envoy_stat(answers) > before, 10,
                       "the service's answer to the headers")
            sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            reply = _read_http1(sock)
        assert (reply.status, reply.headers.get("x-admission-outcome")) == (200, None), reply.body
    assert stack.arrivals() == [f"late-body-{i}" for i in range(3)]
    assert stack.metric("admission_admitted_total", engine="a", model="sim-model") == 3


def _read_http1(sock: socket.socket) -> Reply:
    """One HTTP/1.1 answer with a content-length, read off `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(payload) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        assert chunk, payload
        payload += chunk
    return Reply(int(lines[0].split()[1]), headers, payload)
