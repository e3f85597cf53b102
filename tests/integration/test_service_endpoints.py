"""The service's own endpoints: health, readiness, gRPC health, metrics, debug state."""

from __future__ import annotations

import json

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devstack import http_get

from .conftest import Stack


def test_liveness_and_readiness_do_not_depend_on_the_engine(stack: Stack) -> None:
    admin = stack.local.admin_url
    assert http_get(f"{admin}/healthz")[0] == 200
    assert http_get(f"{admin}/readyz")[0] == 200
    stack.sim("/control/metrics_mode", {"mode": "fail"})
    stack.wait_state(lambda s: s["state"] == "stale", "the engine to go stale")
    assert http_get(f"{admin}/readyz")[0] == 200  # a metrics outage is not an inference outage


def test_grpc_health_reports_the_ext_proc_service_serving(stack: Stack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.local.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_expose_the_reference_series(stack: Stack) -> None:
    status, body = http_get(f"{stack.local.admin_url}/metrics")
    text = body.decode()
    assert status == 200
    for name in ("admission_parked_total", "admission_rejected_total", "engine_state_stale_total",
                 "vllm_requests_running", "vllm_kv_usage_perc", "observer_degraded", "admission_admitted_total",
                 "admission_queue_depth", "admission_inflight", "admission_park_duration_seconds",
                 "admission_decision_latency_seconds"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert 'observer_degraded{engine="default"} 0.0' in text


def test_startup_logs_the_effective_configuration_once_in_readable_lines(stack: Stack) -> None:
    records = [json.loads(line) for line in stack.service_log().splitlines() if line.startswith("{")]
    groups = [r for r in records if r["msg"].startswith("configuration: ")]
    assert [r["level"] for r in groups] == ["INFO"] * len(groups) and len(groups) >= 5
    assert all(len(json.dumps(r)) < 400 for r in groups), max(groups, key=lambda r: len(json.dumps(r)))
    (engine,) = [r for r in groups if r["msg"] == "configuration: engine default"]
    assert (engine["max_inflight"], engine["kv_threshold"]) == (4, 0.9)
    # The whole document once, at DEBUG (these stacks log at DEBUG).
    (full,) = [r for r in records if r["msg"] == "effective configuration"]
    assert full["level"] == "DEBUG" and full["config"]["engines"][0]["max_inflight"] == 4
