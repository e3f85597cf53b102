"""The gRPC port's transport: mTLS between the real Envoy and the real service with certificates
made at test time (tests/certs.py), and where a listener without a host binds.

With EXTPROC_TLS_* set, Envoy (with its client certificate) gets the service's decisions; a
client without a certificate, with one from another CA, or speaking plaintext fails the
handshake, so it cannot open a Process stream and cannot take a slot. The positive control
(a client with a certificate from the right CA opens a stream and is admitted) shows that the
refusals are the handshake's, not a mistake in the client.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from devstack import Child, console_script, free_port, wait_until, with_checkout
from extproc.envoyconf import ExtprocTls
from extproc.wire import base_pb2, pb, pb_grpc

from ..certs import Pair, make_ca, make_cert, openssl_or_skip
from .conftest import FAST, Stack
from .http import chat_body, post

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pair]:
    openssl_or_skip()
    folder = tmp_path_factory.mktemp("pki")
    ca = make_ca(folder, "ca")
    rogue_ca = make_ca(folder, "rogue-ca")
    return {
        "ca": ca,
        "service": make_cert(folder, "service", ca, sans=("IP:127.0.0.1", "DNS:localhost")),
        "envoy": make_cert(folder, "envoy", ca, usages=("clientAuth",)),
        "rogue": make_cert(folder, "rogue", rogue_ca, usages=("clientAuth",)),
    }


def _tls_env(pki: dict[str, Pair]) -> dict[str, str]:
    return {"EXTPROC_TLS_CERT": str(pki["service"].cert), "EXTPROC_TLS_KEY": str(pki["service"].key),
            "EXTPROC_TLS_CLIENT_CA": str(pki["ca"].cert)}


def _envoy_tls(pki: dict[str, Pair]) -> ExtprocTls:
    return ExtprocTls(str(pki["envoy"].cert), str(pki["envoy"].key), str(pki["ca"].cert))


def _chat_stream_messages(request_id: str) -> list[pb.ProcessingRequest]:
    """What Envoy sends for a gated chat POST on the two-message path: headers, then the body."""
    body = chat_body(request_id, max_tokens=2)
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json"),
               ("content-length", str(len(body))), ("x-request-id", request_id)]
    return [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]))),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]


def _open_stream(channel: grpc.Channel, request_id: str) -> list[pb.ProcessingResponse]:
    """One Process stream: the chat request's messages, then every answer until the service has
    answered both (or the stream fails)."""
    stub = pb_grpc.ExternalProcessorStub(channel)
    messages = _chat_stream_messages(request_id)
    answers: list[pb.ProcessingResponse] = []
    call = stub.Process(iter(messages), timeout=20)
    try:
        for answer in call:
            answers.append(answer)
            if len(answers) == len(messages):
                break
    finally:
        call.cancel()
    return answers


def _credentials(pki: dict[str, Pair], client: str | None) -> grpc.ChannelCredentials:
    """TLS that trusts the service's CA, presenting `client`'s certificate (None: none)."""
    ca = pki["ca"].cert.read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=pki[client].key.read_bytes(),
                                        certificate_chain=pki[client].cert.read_bytes())


def test_envoy_with_its_client_certificate_gets_the_services_decisions(
        make_stack: Callable[..., Stack], pki: dict[str, Pair]) -> None:
    stack = make_stack(_tls_env(pki), envoy_args={"extproc_tls": _envoy_tls(pki)})
    reply = post(f"{stack.url}/v1/chat/completions", chat_body("over mTLS", max_tokens=2), {"x-request-id": "tls-1"})
    assert reply.status == 200
    # Decided by the service, not forwarded by a fail-open Envoy that could not reach it.
    assert stack.metric("admission_admitted_total", via="admitted") == 1
    assert stack.envoy_stat(r"^http\.inference\.ext_proc\.(failure_mode_allowed|streams_failed)$") == 0
    assert stack.envoy_stat(r"^cluster\.extproc\.ssl\.handshake$") >= 1  # Envoy spoke TLS to the service
    assert stack.arrivals() == ["tls-1"]


def test_envoy_presenting_the_services_own_certificate_by_default_gets_decisions(
        make_stack: Callable[..., Stack], pki: dict[str, Pair]) -> None:
    stack = make_stack(_tls_env(pki))  # Envoy's side from the service's settings: one Secret for both
    assert post(f"{stack.url}/v1/chat/completions", chat_body("default", max_tokens=2)).status == 200
    assert stack.metric("admission_admitted_total", via="admitted") == 1


@pytest.mark.parametrize("client", ["plaintext", "no certificate", "another CA's certificate"])
def test_a_client_without_a_certificate_from_the_ca_cannot_open_a_stream_or_take_a_slot(
        make_stack: Callable[..., Stack], pki: dict[str, Pair], client: str) -> None:
    stack = make_stack(_tls_env(pki))
    target = f"127.0.0.1:{stack.local.grpc_port}"
    channel = (grpc.insecure_channel(target) if client == "plaintext" else
               grpc.secure_channel(target, _credentials(pki, None if client == "no certificate" else "rogue")))
    with channel, pytest.raises(grpc.RpcError) as info:
        _open_stream(channel, "intruder")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    state = stack.engine_state()
    assert (state["inflight"], state["queue_depth"]) == (0, 0)
    assert stack.metric("admission_admitted_total") == 0 and stack.metric("admission_parked_total") == 0

    # The control: the same request from a client with a certificate from the CA is decided (admitted).
    with grpc.secure_channel(target, _credentials(pki, "envoy")) as trusted:
        answers = _open_stream(trusted, "trusted")
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    assert stack.metric("admission_admitted_total", via="admitted") == 1


@pytest.fixture
def bare_service(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], Child]]:
    started: list[Child] = []

    def start(env: dict[str, str]) -> Child:
        child = Child("extproc", [console_script("extproc"), "serve", "--grace", "1"],
                      with_checkout({**FAST, "ADMISSION_OBSERVE_MODELS": "", **env}), tmp_path / "extproc.log")
        started.append(child)
        child.start()
        return child

    yield start
    for child in started:
        child.stop()


def _listening(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_a_listen_address_without_a_host_binds_loopback_only(
        bare_service: Callable[[dict[str, str]], Child]) -> None:
    if not Path("/proc/net/tcp").exists():
        pytest.skip("reads the listening sockets from /proc/net/tcp")
    grpc_port, admin_port = free_port(), free_port()
    child = bare_service({"EXTPROC_LISTEN": f":{grpc_port}", "EXTPROC_ADMIN_LISTEN": f":{admin_port}"})
    wait_until(lambda: _listening(grpc_port) and _listening(admin_port) or not child.alive(), 30,
               "the service to listen")
    assert child.alive(), child.log_tail()
    # 127.0.0.1 as /proc/net/tcp writes it, and as /proc/net/tcp6 writes ::ffff:127.0.0.1 (gRPC's IPv4 socket).
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    assert _listening(grpc_port) and _listening(grpc_port) <= loopback
    assert _listening(admin_port) and _listening(admin_port) <= loopback
    serving = [json.loads(line) for line in child.log_tail(200).splitlines() if '"msg": "serving"' in line]
    assert serving and serving[0]["grpc"] == f"127.0.0.1:{grpc_port}" and serving[0]["grpc_tls"] == "plaintext"


def test_an_envoy_whose_certificate_the_service_refuses_is_answered_by_its_failure_mode(
        make_stack: Callable[..., Stack], pki: dict[str, Pair]) -> None:
    rogue = ExtprocTls(str(pki["rogue"].cert), str(pki["rogue"].key), str(pki["ca"].cert))
    stack = make_stack(_tls_env(pki), envoy_args={"extproc_tls": rogue})
    reply = post(f"{stack.url}/v1/chat/completions", chat_body("refused", max_tokens=2), {"x-request-id": "rogue-1"})
    # As with a service that is down: fail-open forwards it ungated (within the engine's breaker).
    assert reply.status == 200 and stack.arrivals() == ["rogue-1"]
    assert stack.metric("admission_admitted_total") == 0
    assert stack.envoy_stat(r"^http\.inference\.ext_proc\.failure_mode_allowed$") >= 1
