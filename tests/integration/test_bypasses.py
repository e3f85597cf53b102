"""Every way in: no request reaches a full engine without an admission decision.

The engine is pinned full and the park holds nothing (VLLM_MAX_QUEUE_DEPTH=0), so a gated request
is answered 503 `queue_full` at once. Envoy's own upstream counter for the engine cluster is the
witness: it counts every request Envoy sent to the engine, whatever the engine made of it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from devstack import Child, console_script, free_port, http_get, simulator_argv, wait_until, with_checkout
from extproc.endpoints import DEFAULT_GATED_PATHS
from extproc.outcomes import ENVOY_REJECTIONS

from .conftest import Stack, two_engine_env
from .http import Reply, chat_body, get, post

pytestmark = pytest.mark.integration

CLOSED = {"VLLM_MAX_QUEUE_DEPTH": "0"}


def _exchange(stack: Stack, request: bytes) -> Reply:
    """Send `request` byte for byte and read the whole answer."""
    with socket.create_connection(("127.0.0.1", stack.local.envoy_port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
    return Reply(int(lines[0].split()[1]), {k.strip().lower(): v.strip() for k, v in fields.items()}, payload)


def raw(stack: Stack, request_line: str, body: bytes = b"", headers: dict[str, str] | None = None) -> Reply:
    """Send exactly `request_line` (method, target, version) and read the whole answer."""
    head = [request_line, "host: gateway", "connection: close", f"content-length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in {"content-type": "application/json", **(headers or {})}.items()]
    return _exchange(stack, ("\r\n".join(head) + "\r\n\r\n").encode() + body)


def upstream_requests(stack: Stack, cluster: str = "engine_default") -> int:
    """Requests Envoy has sent to the engine, over both its clusters (gated and ungated paths)."""
    return stack.envoy_stat(f"^cluster\\.{cluster}(_ungated)?\\.upstream_rq_total$")


def closed_stack(make_stack, env: dict[str, str] | None = None) -> Stack:  # noqa: ANN001
    stack = make_stack({**CLOSED, **(env or {})})
    stack.pin(running=4, waiting=1)
    stack.wait_gate(False)
    return stack


BODY = chat_body("hi", max_tokens=2)

# (request line, what the gateway must answer). "envoy" = refused by Envoy itself (no decision needed,
# nothing forwarded); otherwise the x-admission-outcome the service must give.
TRICKS = [
    ("POST /v1/chat/completions HTTP/1.1", "queue_full"),
    ("POST /v1/chat%2Fcompletions HTTP/1.1", "ambiguous_path"),
    ("POST /v1/chat%2fcompletions HTTP/1.1", "ambiguous_path"),
    ("POST /v1%2Fchat%2Fcompletions HTTP/1.1", "ambiguous_path"),
    ("POST /v1%2fchat%2fcompletions?x=1 HTTP/1.1", "ambiguous_path"),
    ("POST /v1/chat%252Fcompletions HTTP/1.1", "ambiguous_path"),
    ("POST /v1/chat%5Ccompletions HTTP/1.1", "ambiguous_path"),
    ("POST /v1/chat/completions/ HTTP/1.1", "ambiguous_path"),
    ("POST /v1/chat/completions;x=1 HTTP/1.1", "ambiguous_path"),
    ("POST /v1/chat/completions%3Bx HTTP/1.1", "ambiguous_path"),
    ("POST /v1/chat/completions%3Fx=1 HTTP/1.1", "ambiguous_path"),
    ("POST /v1/chat/completions%20 HTTP/1.1", "ambiguous_path"),
    ("POST /V1/Chat/Completions HTTP/1.1", "ambiguous_path"),
    ("POST /v1/%2e%2e/v1/chat%2fcompletions HTTP/1.1", "ambiguous_path"),
    ("GET /v1/chat%2Fcompletions HTTP/1.1", "ambiguous_path"),
    ("POST http://gateway/v1/chat%2Fcompletions HTTP/1.1", "ambiguous_path"),
    ("POST //v1//chat/completions HTTP/1.1", "queue_full"),  # Envoy merges the slashes
    ("POST /v1/./x/../chat/completions HTTP/1.1", "queue_full"),  # Envoy resolves the dot segments
    ("POST /v1/%63hat/completions HTTP/1.1", "queue_full"),  # Envoy decodes unreserved characters
    ("POST /v1\\chat\\completions HTTP/1.1", "queue_full"),  # Envoy turns backslashes into slashes
    ("POST /v1/chat/completions?stream=true HTTP/1.1", "queue_full"),
    ("POST http://gateway/v1/chat/completions HTTP/1.1", "queue_full"),
    ("POST /v1/embeddings%2F HTTP/1.1", "ambiguous_path"),
    ("post /v1/chat/completions HTTP/1.1", "envoy"),
    ("Post /v1/chat/completions HTTP/1.1", "envoy"),
    ("POST /v1/chat/completions HTTP/1.0", "envoy"),
    ("POST /v1/chat/completions#x HTTP/1.1", "envoy"),
    ("POST /v1/chat/completions%00 HTTP/1.1", "envoy"),
]


def test_path_and_method_tricks_against_a_closed_gate_never_reach_the_engine(make_stack) -> None:  # noqa: ANN001
    stack = closed_stack(make_stack)
    answers = {}
    for line, _ in TRICKS:
        reply = raw(stack, line, BODY)
        outcome = reply.headers.get("x-admission-outcome")
        # Envoy's own refusals come in the service's shape too, with one of Envoy's outcomes.
        by_envoy = outcome in {o.value for o in ENVOY_REJECTIONS} and reply.status in (400, 426)
        answers[line] = "envoy" if by_envoy else (outcome or reply.status)
        if answers[line] == "ambiguous_path":
            assert reply.status == 400
            assert reply.json()["error"] == {**reply.json()["error"], "type": "invalid_request_error",
                                             "code": "ambiguous_path"}
    assert answers == dict(TRICKS)
    assert upstream_requests(stack) == 0
    assert stack.arrivals() == []
    assert stack.metric("admission_rejected_total", reason="ambiguous_path") == sum(
        1 for _, want in TRICKS if want == "ambiguous_path")
    # The witness counts: an ungated request does reach the engine.
    assert get(f"{stack.url}/v1/models").status == 200
    assert upstream_requests(stack) == 1


_HEAD = "{method} /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n{framing}\r\n"
_CHUNKED = "transfer-encoding: chunked\r\n"

# (what the request does with its body, the request, the x-admission-outcome the service must give)
FRAMINGS = [
    ("chunked, no content-length", (_HEAD.format(method="POST", framing=_CHUNKED)).encode()
     + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n", "queue_full"),
    ("chunked, in two chunks", (_HEAD.format(method="POST", framing=_CHUNKED)).encode()
     + b"%x\r\n" % 5 + BODY[:5] + b"\r\n" + b"%x\r\n" % (len(BODY) - 5) + BODY[5:] + b"\r\n0\r\n\r\n",
     "queue_full"),
    ("chunked, empty", (_HEAD.format(method="POST", framing=_CHUNKED)).encode() + b"0\r\n\r\n", "invalid_body"),
    ("no body, no content-length", _HEAD.format(method="POST", framing="").encode(), "invalid_body"),
    ("content-length 0", _HEAD.format(method="POST", framing="content-length: 0\r\n").encode(), "invalid_body"),
    ("content-length 0, then bytes", _HEAD.format(method="POST", framing="content-length: 0\r\n").encode() + BODY,
     "invalid_body"),
]


def test_body_framing_tricks_against_a_closed_gate_never_reach_the_engine(make_stack) -> None:  # noqa: ANN001
    stack = closed_stack(make_stack)
    answers = {name: _exchange(stack, request).headers.get("x-admission-outcome") for name, request, _ in FRAMINGS}
    assert answers == {framing: outcome for framing, _, outcome in FRAMINGS}
    assert upstream_requests(stack) == 0
    assert stack.arrivals() == []


def test_a_post_declaring_its_body_is_one_message_to_the_service_and_still_gated(make_stack) -> None:  # noqa: ANN001
    stack = closed_stack(make_stack)

    def messages() -> int:
        return stack.envoy_stat(r"^http\.inference\.ext_proc\.stream_msgs_sent$")

    before = messages()
    assert raw(stack, "POST /v1/chat/completions HTTP/1.1", BODY).headers.get("x-admission-outcome") == "queue_full"
    assert messages() - before == 1  # the body alone: the route names the endpoint
    before = messages()
    chunked = FRAMINGS[0][1]
    assert _exchange(stack, chunked).headers.get("x-admission-outcome") == "queue_full"
    assert messages() - before == 2  # no declared length: headers, then the body
    assert upstream_requests(stack) == 0 and stack.arrivals() == []


def _multipart(fields: list[tuple[str, bytes, str | None]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    out = b""
    for name, value, filename in fields:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        kind = "\r\ncontent-type: audio/wav" if filename else ""
        out += f"--{boundary}\r\ncontent-disposition: {disposition}{kind}\r\n\r\n".encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _endpoint_request(path: str) -> tuple[bytes, str]:
    if path.startswith("/v1/audio/"):
        return _multipart([("model", b"sim-model", None), ("file", b"RIFF" + bytes(2048), "a.wav")])
    bodies = {
        "/v1/responses": {"input": [{"role": "user", "content": "hi"}], "instructions": "be brief",
                          "max_output_tokens": 8},
        "/v1/embeddings": {"input": ["a", "b"]},
        "/pooling": {"input": "a"},
        "/classify": {"input": ["a"]},
        "/score": {"text_1": "a", "text_2": ["b"]},
        "/v1/score": {"queries": "a", "documents": ["b"]},
        "/rerank": {"query": "a", "documents": ["b", {"text": "c"}]},
        "/v1/rerank": {"query": "a", "documents": ["b"]},
        "/v2/rerank": {"query": "a", "documents": ["b"]},
        "/generate": {"prompt": "a", "max_tokens": 2},
        "/inference/v1/generate": {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}},
        "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/invocations": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/chat/completions/batch": {"messages": [[{"role": "user", "content": "hi"}]], "max_tokens": 2},
        "/v2/embed": {"texts": ["a"], "input_type": "search_query"},
        "/v9/new-thing": {"anything": {"text": "hi"}},
    }
    doc = bodies.get(path, {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"})
    return json.dumps({"model": "sim-model", **doc}).encode(), "application/json"


def _assert_gated(stack: Stack, paths: Iterable[str]) -> None:
    """Each path, on a full engine with no room to park, gets the gate's 503 queue_full + Retry-After."""
    for path in paths:
        body, content_type = _endpoint_request(path)
        reply = post(stack.url + path, body, {"content-type": content_type})
        assert (path, reply.status, reply.headers.get("x-admission-outcome")) == (path, 503, "queue_full")
        assert "retry-after" in reply.headers


def test_every_default_gated_endpoint_is_gated_while_the_engine_is_full(make_stack) -> None:  # noqa: ANN001
    stack = closed_stack(make_stack)
    _assert_gated(stack, DEFAULT_GATED_PATHS)
    for path in ("/v1/responses", "/v1/embeddings", "/invocations", "/pooling", "/score", "/v1/score", "/rerank",
                 "/v1/rerank", "/v2/rerank", "/classify", "/generate", "/v1/audio/transcriptions",
                 "/v1/audio/translations"):
        assert path in DEFAULT_GATED_PATHS
    assert upstream_requests(stack) == 0
    assert stack.metric("admission_rejected_total", reason="queue_full") == len(DEFAULT_GATED_PATHS)


def test_an_audio_upload_above_the_body_cap_is_gated_on_its_model_field(make_stack) -> None:  # noqa: ANN001
    stack = make_stack({"MAX_BODY_BYTES": "4096", "VLLM_MAX_QUEUE_DEPTH": "0"})
    url = stack.url + "/v1/audio/transcriptions"
    audio = b"RIFF" + bytes(64 * 1024)
    body, content_type = _multipart([("model", b"sim-model", None), ("file", audio, "a.wav")])
    reply = post(url, body, {"content-type": content_type})
    # Admitted and forwarded whole: the simulator has no audio route, so the engine answers 404.
    assert reply.status == 404 and "x-admission-outcome" not in reply.headers
    assert stack.metric("admission_admitted_total", model="sim-model", via="admitted") == 1
    assert upstream_requests(stack) == 1

    late, late_type = _multipart([("file", audio, "a.wav"), ("model", b"sim-model", None)])
    reply = post(url, late, {"content-type": late_type})
    assert (reply.status, reply.headers["x-admission-outcome"]) == (400, "missing_model")
    assert "before the file" in reply.json()["error"]["message"]

    stack.pin(running=4, waiting=1)
    stack.wait_gate(False)
    reply = post(url, body, {"content-type": content_type})
    assert (reply.status, reply.headers["x-admission-outcome"]) == (503, "queue_full")
    assert upstream_requests(stack) == 1


def test_a_model_the_engine_serves_is_gated_even_when_the_configuration_does_not_list_it(make_stack) -> None:  # noqa: ANN001
    # The engine serves `sim-model`; the operator only listed another name (an alias, or a LoRA
    # adapter loaded since): the gate learns the served names from the engine's /v1/models.
    stack = closed_stack(make_stack, {"ADMISSION_OBSERVE_MODELS": "listed-model"})
    reply = post(stack.url + "/v1/chat/completions", chat_body(model="sim-model"))
    assert (reply.status, reply.headers.get("x-admission-outcome")) == (503, "queue_full")
    unknown = post(stack.url + "/v1/chat/completions", chat_body(model="not-served"))
    assert (unknown.status, unknown.headers["x-admission-outcome"]) == (404, "unknown_model")
    assert "sim-model" in unknown.json()["error"]["message"]
    assert upstream_requests(stack) == 0
    stack.sim("/control/unpin", {})
    stack.wait_gate(True)
    assert post(stack.url + "/v1/chat/completions", chat_body(model="sim-model", max_tokens=2)).status == 200
    assert stack.metric("admission_admitted_total", model="sim-model", via="admitted") == 1


@pytest.fixture
def engine_b(tmp_path: Path):  # noqa: ANN201
    port = free_port()
    child = Child("enginesim-b", simulator_argv("--port", str(port), "--model", "model-b"),
                  with_checkout({}), tmp_path / "enginesim-b.log")
    child.start()
    wait_until(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, 30, "engine b")
    yield port
    child.stop()


def test_a_client_set_admission_header_never_picks_the_engine(make_stack, engine_b: int, tmp_path: Path) -> None:  # noqa: ANN001
    sim_port = free_port()
    stack = make_stack(two_engine_env(tmp_path, sim_port, engine_b, "model-b"), sim_port=sim_port)
    spoof = {"x-admission-engine": "b", "X-Admission-Outcome": "admitted"}

    def models_via_gateway() -> list[str]:
        reply = raw(stack, "GET /v1/models HTTP/1.1", headers=spoof)
        assert reply.status == 200
        return [m["id"] for m in reply.json()["data"]]

    assert models_via_gateway() == ["sim-model"]  # an ungated path: engine a, the default route
    reply = post(f"{stack.url}/v1/chat/completions", chat_body(model="sim-model", max_tokens=2),
                 {**spoof, "x-request-id": "gated"})
    assert (reply.status, reply.json()["model"]) == (200, "sim-model")
    # The service is down and Envoy fails open: nobody names an engine, so with several engines a
    # gated request is answered 503 engine_not_selected (never sent to a guessed engine), whatever
    # the client says; ungated paths still take the default route.
    assert stack.local.extproc is not None
    stack.local.extproc.kill()
    reply = post(f"{stack.url}/v1/chat/completions", chat_body(model="sim-model", max_tokens=2),
                 {**spoof, "x-request-id": "fail-open"})
    assert (reply.status, reply.headers["x-admission-outcome"]) == (503, "engine_not_selected")
    assert models_via_gateway() == ["sim-model"]
    assert stack.arrivals() == ["gated"]
    assert upstream_requests(stack, "engine_b") == 0


def test_a_short_parking_load_never_fails_a_stream(make_stack) -> None:  # noqa: ANN001
    # Many parks, each released by a completion a few milliseconds later: the interleaving in which
    # a ticket is admitted while its park answer is still being written happens here if anywhere.
    stack = make_stack({"VLLM_MAX_QUEUE_DEPTH": "64", "ADMISSION_MAX_PARK_SECONDS": "30"})
    clients, per_client = 7, 40

    def client(n: int) -> list[int]:
        return [post(f"{stack.url}/v1/chat/completions", chat_body(f"c{n}-{i}", max_tokens=2)).status
                for i in range(per_client)]

    with ThreadPoolExecutor(clients) as pool:
        statuses = [s for batch in pool.map(client, range(clients)) for s in batch]
    assert statuses == [200] * clients * per_client
    assert stack.metric("admission_parked_total") > 0  # the park path was exercised
    assert stack.metric("extproc_internal_errors_total") == 0
    stack.wait_state(lambda s: s["queue_depth"] == 0 and s["inflight"] == 0, "queue and in-flight back to 0")
    assert len(stack.arrivals()) == clients * per_client


def test_the_admin_listener_is_loopback_by_default() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ADMISSION_", "EXTPROC_"))}
    out = subprocess.run([console_script("extproc"), "check-config"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["admin_listen"] == "127.0.0.1:9003"


def test_the_probe_listener_serves_probes_and_scrapes_but_not_the_debug_state(make_stack) -> None:  # noqa: ANN001
    port = free_port()
    stack = make_stack({"EXTPROC_PROBE_LISTEN": f"127.0.0.1:{port}"})
    for path in ("/metrics", "/healthz", "/readyz"):
        assert http_get(f"http://127.0.0.1:{port}{path}")[0] == 200, path
    assert http_get(f"http://127.0.0.1:{port}/debug/engines")[0] == 404
    assert http_get(f"{stack.local.admin_url}/debug/engines")[0] == 200


#: vLLM 0.33's engine routes the gate did not know before (docs/concepts/design.md), and a route no release has yet.
NEW_ENGINE_ROUTES = ("/v1/chat/completions/batch", "/v1/decisions", "/v1/systemone", "/generative_scoring",
                     "/v2/embed", "/inference/v1/generate", "/v1/audio/translations", "/cohere/v2/chat",
                     "/v9/new-thing")


def test_every_vllm_engine_route_and_any_unknown_post_is_gated_while_the_engine_is_full(make_stack) -> None:  # noqa: ANN001
    stack = closed_stack(make_stack)
    _assert_gated(stack, NEW_ENGINE_ROUTES)
    # An unknown POST without a model, or an admin POST without a body, is refused, not passed.
    no_model = post(stack.url + "/v9/new-thing", json.dumps({"prompt": "hi"}).encode())
    assert (no_model.status, no_model.headers.get("x-admission-outcome")) == (400, "missing_model")
    sleep = raw(stack, "POST /sleep?level=1 HTTP/1.1")
    assert (sleep.status, sleep.headers.get("x-admission-outcome")) == (400, "invalid_body")
    assert upstream_requests(stack) == 0 and stack.arrivals() == []
    assert stack.metric("admission_rejected_total", reason="queue_full") == len(NEW_ENGINE_ROUTES)
    # The cheap routes pass, whatever the method: the engine answers them.
    tokenized = post(stack.url + "/tokenize", json.dumps({"model": "sim-model", "prompt": "hi"}).encode())
    assert tokenized.status == 200 and "x-admission-outcome" not in tokenized.headers
    assert get(stack.url + "/v1/models").status == 200 and get(stack.url + "/health").status == 200
    assert upstream_requests(stack) == 3
    assert stack.metric("admission_passthrough_total", reason="path_not_gated") == 3
