"""The chart renders, lints, validates against Kubernetes' schema, and wires the pod as designed."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from extproc.envoyconf import INFERENCE_STAT_PREFIX

from .conftest import (
    CHART,
    NAMESPACE,
    ROOT,
    SHARED_VALUE_SETS,
    VALUE_SETS,
    Chart,
    Rendered,
    envoy_validate,
    helm,
    mounted_file,
    with_engines,
)

KUBERNETES_VERSION = "1.35.0"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # kubernetes-validate ships no CRD schemas


def test_lint_reports_no_warnings_or_errors_for_any_value_set() -> None:
    for name, values in {**VALUE_SETS, **SHARED_VALUE_SETS}.items():
        report = helm.lint(str(CHART), with_engines(values), strict=True, namespace=NAMESPACE,
                           kube_version=f"v{KUBERNETES_VERSION}")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not problems and not report["errors"], f"{name}: {problems} {report['errors']}"


def validate_manifests(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate every non-CRD manifest against the Kubernetes schema; return the ones checked."""
    checked = []
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}")
        checked.append(obj)
    return checked


def test_every_manifest_validates_against_the_kubernetes_schema(rendered: Rendered) -> None:
    assert len(validate_manifests(rendered.objects)) >= 5


def test_default_shape_is_one_deployment_with_envoy_and_the_service(chart: Chart) -> None:
    r = chart.render()
    assert r.kinds() == ["ConfigMap", "ConfigMap", "ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget",
                         "Service", "Service"]
    assert [c["name"] for c in r.deployment["spec"]["template"]["spec"]["containers"]] == ["envoy", "admission"]
    assert r.container("envoy")["image"].startswith("envoyproxy/envoy:v1.40.")
    assert r.container("admission")["command"][:2] == ["extproc", "serve"]
    # Envoy's config is written at pod start by the service's own image, not kept in the chart.
    assert [c["name"] for c in r.deployment["spec"]["template"]["spec"]["initContainers"]] == ["envoy-config"]
    assert r.init_container()["image"] == r.container("admission")["image"]
    assert r.init_container()["command"][:2] == ["extproc", "envoy-config"]
    assert "envoy.yaml" not in r.one("ConfigMap", "-envoy")["data"]


def test_the_service_listens_for_grpc_and_debug_on_loopback_and_only_for_probes_on_all_addresses(
        rendered: Rendered) -> None:
    env = rendered.env()
    assert env["EXTPROC_LISTEN"].startswith("127.0.0.1:")
    assert env["EXTPROC_ADMIN_LISTEN"] == "127.0.0.1:9005"  # /debug/engines: kubectl port-forward only
    assert env["EXTPROC_PROBE_LISTEN"] == "0.0.0.0:9003"  # /metrics, /healthz, /readyz
    ports = {p["name"]: p["containerPort"] for p in rendered.container("admission")["ports"]}
    assert ports == {"admin": 9003}  # the gRPC port is not declared: nothing outside the pod uses it
    extproc = next(c for c in rendered.envoy["static_resources"]["clusters"] if c["name"] == "extproc")
    address = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert f"{address['address']}:{address['port_value']}" == env["EXTPROC_LISTEN"]


def test_the_inference_service_targets_envoys_listener_and_the_metrics_service_the_admin_ports(
        rendered: Rendered) -> None:
    pod_ports = {p["name"]: p["containerPort"] for c in rendered.deployment["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}
    services = [o for o in rendered.objects if o["kind"] == "Service"]
    inference = next(s for s in services if not s["metadata"]["name"].endswith("-metrics"))
    assert [p["targetPort"] for p in inference["spec"]["ports"]] == ["http"]
    listener = rendered.envoy["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert pod_ports["http"] == listener["port_value"]
    metrics = next(s for s in services if s["metadata"]["name"].endswith("-metrics"))
    assert {p["targetPort"] for p in metrics["spec"]["ports"]} == {"admin", "envoy-health"}
    pod_labels = rendered.deployment["spec"]["template"]["metadata"]["labels"]
    for service in services:
        assert service["spec"]["selector"].items() <= pod_labels.items()


def test_probes_check_envoy_ready_and_the_service_readyz_and_healthz(rendered: Rendered) -> None:
    envoy, service = rendered.container("envoy"), rendered.container("admission")
    assert envoy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "envoy-health"}
    assert envoy["livenessProbe"]["httpGet"] == {"path": "/ready", "port": "envoy-health"}
    assert service["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert service["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    # The health listener forwards exactly /ready and /stats/prometheus to the loopback admin API.
    health = next(lst for lst in rendered.envoy["static_resources"]["listeners"] if lst["name"] == "envoy_health")
    hcm = health["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["match"]["path"] for r in routes] == ["/ready", "/stats/prometheus"]
    assert rendered.envoy["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_envoy_drains_in_prestop_and_the_grace_period_covers_the_drain(rendered: Rendered) -> None:
    envoy, service = rendered.container("envoy"), rendered.container("admission")
    pod = rendered.deployment["spec"]["template"]["spec"]
    command = envoy["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "/bin/bash"
    volume, name = mounted_file(pod, envoy, command[1])
    assert volume["configMap"]["name"] == rendered.one("ConfigMap", "-envoy")["metadata"]["name"]
    script = rendered.one("ConfigMap", "-envoy")["data"][name]
    # Graceful and without closing the listeners: new connections are served while the pod's
    # removal from the endpoints spreads, for at least envoy.drainTimeSeconds.
    assert "POST '/drain_listeners?graceful&skip_exit'" in script
    assert f"\nsleep {_merged(rendered)['envoy']['drainTimeSeconds']}\n" in script
    drain = int(re.search(r"deadline=\$\(\( \$\(date \+%s\) \+ (\d+) \)\)", script).group(1))
    park = _park_cap(rendered)
    merged_allowance = _merged(rendered)["shutdown"]["inflightAllowanceSeconds"]
    assert drain == math.ceil(park) + merged_allowance
    # It reads the generated inference listener's stat prefix.
    assert f"s/^http\\.{INFERENCE_STAT_PREFIX}\\.downstream_rq_active: //p" in script
    assert _hcm(rendered.envoy)["stat_prefix"] == INFERENCE_STAT_PREFIX
    # The service keeps serving until Envoy is gone, then gets its own --grace.
    wait = service["lifecycle"]["preStop"]["exec"]["command"]
    assert wait[:2] == ["python", "-c"] and f"time.monotonic() + {drain + 2}" in wait[2]
    grace = float(service["command"][service["command"].index("--grace") + 1])
    tgps = rendered.deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert tgps >= drain + 2 + grace
    assert tgps > park + 10


def test_resources_have_requests_and_limits_for_both_containers(rendered: Rendered) -> None:
    for name in ("envoy", "admission"):
        resources = rendered.container(name)["resources"]
        assert set(resources) == {"requests", "limits"}, name
        assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
    # The init container gets Envoy's: it never raises what the pod requests.
    assert rendered.init_container()["resources"] == rendered.container("envoy")["resources"]


@pytest.mark.parametrize(
    ("envoy_values", "workers"),
    [
        ({}, 2),  # the default limit: 2 CPUs
        ({"resources": {"limits": {"cpu": "1500m"}}}, 2),
        ({"resources": {"limits": {"cpu": "500m"}}}, 1),
        ({"resources": {"limits": {"cpu": 4}}}, 4),
        ({"resources": {"limits": {"cpu": None}}, "concurrency": 3}, 3),
        ({"concurrency": 1}, 1),
    ],
)
def test_envoy_concurrency_follows_the_cpu_limit_not_the_node(chart: Chart, envoy_values: dict[str, Any],
                                                              workers: int) -> None:
    args = chart.render({"envoy": envoy_values}).container("envoy")["args"]
    assert args[args.index("--concurrency") + 1] == str(workers)


def test_envoy_without_a_cpu_limit_or_concurrency_is_refused(chart: Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match="envoy.resources.limits.cpu or envoy.concurrency must be set"):
        chart.render({"envoy": {"resources": {"limits": {"cpu": None}}}})


def test_pod_disruption_budget_selects_the_deployments_pods(chart: Chart) -> None:
    r = chart.render()
    pdb = r.one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert (pdb["spec"]["selector"]["matchLabels"].items()
            <= r.deployment["spec"]["template"]["metadata"]["labels"].items())
    assert "PodDisruptionBudget" not in chart.render({"podDisruptionBudget": {"enabled": False}}).kinds()


def test_engines_config_and_env_are_accepted_by_the_service_itself(rendered: Rendered, tmp_path: Path) -> None:
    settings = _service_settings(rendered, tmp_path)
    merged = _merged(rendered)
    assert [e.name for e in settings.engines] == [e["name"] for e in merged["engines"]]
    for engine, values in zip(settings.engines, merged["engines"], strict=True):
        assert list(engine.models) == values["models"]
        assert engine.limits.max_park_seconds == values.get("maxParkSeconds", merged["admission"]["maxParkSeconds"])
        assert engine.limits.kv_threshold == values.get("kvThreshold", merged["admission"]["kvThreshold"])
        assert engine.limits.max_inflight == values.get("maxInflight", merged["admission"]["maxInflight"])
        assert engine.limits.max_queue_depth == values.get("maxQueueDepth", merged["admission"]["maxQueueDepth"])
        assert engine.limits.kv_capacity_tokens == values.get("kvCapacityTokens",
                                                              merged["admission"].get("kvCapacityTokens"))
    assert settings.max_body_bytes == merged["admission"]["maxBodyBytes"]
    assert settings.max_streams == merged["admission"]["maxStreams"]
    a = merged["admission"]
    assert ((settings.kv_budget, settings.backfill, settings.local_accounting)
            == (a["kvBudget"], a["backfill"], a["localAccounting"]))
    assert (settings.bytes_per_token, settings.estimate_safety_factor, settings.default_max_tokens) == (
        a["bytesPerToken"], a["estimateSafetyFactor"], a["defaultMaxTokens"])
    assert settings.poll_interval == a["pollIntervalSeconds"] and settings.stale_after_polls == a["staleAfterPolls"]
    assert settings.retry_after_seconds == a["retryAfterSeconds"] and list(settings.gated_paths) == a["gatedPaths"]


def test_envoy_reads_the_config_its_init_container_writes_from_the_services_settings(rendered: Rendered) -> None:
    """One emptyDir from the init container's --output to Envoy's --config-path (checked on every
    rendering, conftest.run_envoy_config); the init container reads the service's settings: the
    same env but the ledger's connection (the Redis URL: the Envoy config does not depend on it),
    the same engines file."""
    pod = rendered.deployment["spec"]["template"]["spec"]
    init, envoy, service = rendered.init_container(), rendered.container("envoy"), rendered.container("admission")
    written, path = mounted_file(pod, init, init["command"][init["command"].index("--output") + 1])
    assert written == {"name": "envoy-config", "emptyDir": {"sizeLimit": "1Mi"}}
    assert mounted_file(pod, envoy, envoy["args"][envoy["args"].index("--config-path") + 1]) == (written, path)
    assert [m for m in envoy["volumeMounts"] if m["name"] == "envoy-config"][0]["readOnly"] is True
    ledger = {"ADMISSION_LEDGER", "ADMISSION_REDIS_URL", "ADMISSION_LEDGER_LEASE_SECONDS",
              "ADMISSION_LEDGER_TIMEOUT_MS", "ADMISSION_LEDGER_KEY_PREFIX", "ADMISSION_REPLICA_ID"}
    assert init["env"] == [e for e in service["env"] if e["name"] not in ledger]
    assert init.get("envFrom") == service.get("envFrom")
    config = rendered.env()["EXTPROC_CONFIG"]
    assert mounted_file(pod, init, config) == mounted_file(pod, service, config)
    assert init["securityContext"] == service["securityContext"]


def test_the_init_container_passes_what_only_the_chart_knows(rendered: Rendered, tmp_path: Path) -> None:
    """The generated config is the generator's for the service's settings and the chart's values
    for Envoy's ports, the ext_proc address, failureMode, the first-token allowance and the memory
    limit (read here from the values, not from the init container's arguments)."""
    from extproc.envoyconf import build_envoy_config, memory_bytes

    settings = _service_settings(rendered, tmp_path)
    merged = _merged(rendered)
    expected = build_envoy_config(
        settings,
        listen_host="0.0.0.0", listen_port=merged["envoy"]["port"],
        admin_host="127.0.0.1", admin_port=merged["envoy"]["adminPort"],
        health_port=merged["envoy"]["healthPort"],
        extproc_host="127.0.0.1", extproc_port=merged["admission"]["grpcPort"],
        failure_mode=merged["admission"]["failureMode"],
        first_token_allowance=merged["envoy"]["firstTokenAllowanceSeconds"],
        memory_limit_bytes=memory_bytes(merged["envoy"]["resources"]["limits"]["memory"]),
        downstream_connections=merged["envoy"].get("maxDownstreamConnections"),
    )
    assert rendered.envoy == expected


def test_envoy_accepts_the_rendered_config(rendered: Rendered) -> None:
    assert envoy_validate(rendered.envoy_text) == ""


@pytest.mark.parametrize("park", [1, 30.5, 120, 300, 3590])
def test_timeouts_follow_the_park_cap(chart: Chart, park: float) -> None:
    r = chart.render({"admission": {"maxParkSeconds": park}})
    hcm = _hcm(r.envoy)
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert hcm["stream_idle_timeout"] == f"{math.ceil(park) + 600}s"
    # A stalled service is not declared dead (and failed open) within 15 s.
    assert ext_proc["message_timeout"] == "15s"
    assert ext_proc["max_message_timeout"] == f"{math.ceil(max(park + 5, 15) + 5)}s"
    # The service parks with one override of park cap + 5 s (at least 15 s): it must fit under both limits.
    assert _seconds(ext_proc["max_message_timeout"]) >= max(park + 5, 15)
    assert _seconds(hcm["stream_idle_timeout"]) > park + 5
    assert all(route["route"]["timeout"] == "0s" for route in hcm["route_config"]["virtual_hosts"][0]["routes"])
    assert r.env()["ADMISSION_MAX_PARK_SECONDS"] == f"{park:g}"


def test_the_longest_per_engine_park_cap_sizes_envoys_timeouts(chart: Chart) -> None:
    r = chart.render(VALUE_SETS["several-engines"])  # qwen parks up to 300 s, the others 120 s
    ext_proc = _hcm(r.envoy)["http_filters"][0]["typed_config"]
    assert ext_proc["max_message_timeout"] == "310s"
    assert _hcm(r.envoy)["stream_idle_timeout"] == "900s"


def test_processing_mode_and_buffer_limit_match_the_body_cap(chart: Chart) -> None:
    r = chart.render({"admission": {"maxBodyBytes": 2 * 1024 * 1024}})
    listener = r.envoy["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 2097152
    assert r.env()["MAX_BODY_BYTES"] == "2097152"
    ext_proc = _hcm(r.envoy)["http_filters"][0]["typed_config"]
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND", "response_header_mode": "SKIP", "request_body_mode": "BUFFERED_PARTIAL",
        "response_body_mode": "NONE", "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP",
    }
    assert ext_proc["allow_mode_override"] is True


def test_failure_mode_open_forwards_and_closed_answers_503(chart: Chart) -> None:
    opened = _hcm(chart.render().envoy)["http_filters"][0]["typed_config"]
    assert opened["failure_mode_allow"] is True and "status_on_error" not in opened
    closed = _hcm(chart.render(VALUE_SETS["failure-mode-closed"]).envoy)["http_filters"][0]["typed_config"]
    assert closed["failure_mode_allow"] is False and closed["status_on_error"] == {"code": 503}


def test_several_engines_get_one_cluster_each_and_header_routes(chart: Chart) -> None:
    r = chart.render(VALUE_SETS["several-engines"])
    clusters = {c["name"]: c for c in r.envoy["static_resources"]["clusters"]}
    assert {"engine_qwen", "engine_llama", "engine_mistral-small"} <= set(clusters)
    assert clusters["engine_llama"]["type"] == "STATIC"  # an IP address
    assert clusters["engine_qwen"]["type"] == "STRICT_DNS"
    mistral = clusters["engine_mistral-small"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert mistral["endpoint"]["address"]["socket_address"] == {"address": "mistral.models.svc.cluster.local",
                                                                "port_value": 80}
    routes = _hcm(r.envoy)["route_config"]["virtual_hosts"][0]["routes"]
    picked = [(rt["match"].get("dynamic_metadata", [{}])[0].get("value", {}).get("string_match", {}).get("exact"),
               rt["route"]["cluster"] if "route" in rt else rt["direct_response"])
              for rt in routes]
    gated = len(r.values["admission"]["gatedPaths"]) + 2  # each gated path + escaped separators + any other POST
    passed = len(r.values["admission"]["passPaths"])
    one_message = sum(1 for rt in routes if "typed_per_filter_config" in rt)  # a POST declaring its body
    assert one_message == sum(1 for p in r.values["admission"]["gatedPaths"] if not p.startswith("/v1/audio/"))
    # No engine named by the service: 503 engine_not_selected, never a guess.
    assert picked == (
        [("qwen", "engine_qwen")] * gated + [("llama", "engine_llama")] * gated
        + [("mistral-small", "engine_mistral-small")] * gated + [(None, {"status": 503})] * one_message
        + [(None, "engine_qwen_ungated")] * passed + [(None, {"status": 503})] * gated
        + [(None, "engine_qwen_ungated")])
    # The engine is named only in the service's metadata, never by a header a client could send.
    assert all(m["filter"] == "llm_admission" for rt in routes for m in rt["match"].get("dynamic_metadata", []))
    assert not any(h["name"].startswith("x-admission-") for rt in routes for h in rt["match"].get("headers", []))
    # One engine: gated paths to its bounded cluster without a header match, the rest ungated.
    single = _hcm(chart.render().envoy)["route_config"]["virtual_hosts"][0]["routes"]
    ungated = [rt for rt in single[:-1] if rt["route"]["cluster"] == "engine_vllm_ungated"]
    assert len(ungated) == len(chart.render().values["admission"]["passPaths"])  # the pass list
    assert {rt["route"]["cluster"] for rt in single[:-1] if rt not in ungated} == {"engine_vllm"}
    assert single[-1] == {"match": {"prefix": "/"}, "route": {"cluster": "engine_vllm_ungated", "timeout": "0s"}}


def test_each_engine_cluster_admits_what_the_gate_admits(chart: Chart) -> None:
    r = chart.render(VALUE_SETS["several-engines"])
    bounds = {c["name"]: c["circuit_breakers"]["thresholds"][0]["max_requests"]
              for c in r.envoy["static_resources"]["clusters"]}
    slots = r.values["admission"]["engineQueueSlots"]
    for engine in r.values["engines"]:
        inflight = engine.get("maxInflight", r.values["admission"]["maxInflight"])
        assert bounds[f"engine_{engine['name']}"] == inflight + slots
    assert bounds["engine_qwen_ungated"] == r.values["admission"]["maxStreams"]


def test_ext_proc_cluster_is_http2_with_circuit_breakers_at_max_streams(chart: Chart) -> None:
    r = chart.render({"admission": {"maxStreams": 4096}})
    extproc = next(c for c in r.envoy["static_resources"]["clusters"] if c["name"] == "extproc")
    options = extproc["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert options["explicit_http_config"]["http2_protocol_options"]["max_concurrent_streams"] == 4096
    assert extproc["circuit_breakers"]["thresholds"][0]["max_requests"] == 4096
    assert r.env()["EXTPROC_MAX_STREAMS"] == "4096"


def test_a_config_change_rolls_the_pods(chart: Chart) -> None:
    """A pod rolls when its template changes: the Envoy config follows the init container's env and
    flags (in the template) and the engines file (its checksum)."""
    before = chart.render().deployment["spec"]["template"]
    after = chart.render({"admission": {"maxParkSeconds": 60}}).deployment["spec"]["template"]
    assert before["spec"]["initContainers"] != after["spec"]["initContainers"]
    assert (before["metadata"]["annotations"]["checksum/envoy"]
            != after["metadata"]["annotations"]["checksum/envoy"])  # preStop
    failure = chart.render({"admission": {"failureMode": "closed"}}).deployment["spec"]["template"]
    assert before["spec"]["initContainers"] != failure["spec"]["initContainers"]
    models = chart.render({"engines": [{"name": "vllm", "url": "http://vllm:8000", "models": ["other"]}]})
    annotations = models.deployment["spec"]["template"]["metadata"]["annotations"]
    assert before["metadata"]["annotations"]["checksum/engines"] != annotations["checksum/engines"]


def test_service_monitor_and_prometheus_rule_are_off_by_default(chart: Chart) -> None:
    assert not CRD_KINDS & set(chart.render().kinds())


def test_service_monitor_scrapes_the_admin_port_with_the_job_the_alerts_expect(chart: Chart) -> None:
    r = chart.render(VALUE_SETS["monitoring-on"])
    monitor = r.one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    metrics = r.one("Service", "-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    admin = monitor["spec"]["endpoints"][0]
    assert admin["port"] in {p["name"] for p in metrics["spec"]["ports"]} and admin["path"] == "/metrics"
    assert {"targetLabel": "job", "replacement": "llm-admission"} in admin["relabelings"]
    rules = yaml.safe_load((ROOT / "alerts" / "llm-admission.rules.yml").read_text())
    assert 'up{job="llm-admission"}' in next(r["expr"] for r in rules["groups"][0]["rules"]
                                             if r["alert"] == "LLMAdmissionServiceDown")


def test_prometheus_rule_carries_the_checked_rules_scoped_to_the_release(chart: Chart, tmp_path: Path,
                                                                         promtool: str) -> None:
    rule = chart.render(VALUE_SETS["monitoring-on"]).one("PrometheusRule")
    text = (ROOT / "alerts" / "llm-admission.rules.yml").read_text()
    scope = 'namespace="inference",service="demo-llm-admission-metrics"'
    text = text.replace('job="llm-admission"', f'job="llm-admission",{scope}')
    text = text.replace('job="llm-admission-envoy"', f'job="llm-admission-envoy",{scope}')
    text = text.replace('container=~"envoy|admission"',
                        'container=~"envoy|admission",namespace="inference",pod=~"demo-llm-admission-.*"')
    assert rule["spec"] == yaml.safe_load(text)
    path = tmp_path / "from-chart.rules.yml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_configmap_has_the_sidecar_label_and_the_committed_dashboard(chart: Chart) -> None:
    r = chart.render(VALUE_SETS["monitoring-on"])
    cm = r.one("ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"]["grafana_folder"] == "LLM"
    assert cm["data"]["llm-admission.json"] == (ROOT / "dashboards" / "llm-admission.json").read_text().rstrip("\n")
    assert "ConfigMap" not in [o["kind"] for o in chart.render({"dashboard": {"enabled": False}}).objects
                               if o["metadata"]["name"].endswith("-dashboard")]


def test_notes_tell_how_to_send_a_first_request_and_where_the_dashboard_is(chart: Chart) -> None:
    notes = chart.render(VALUE_SETS["several-engines"]).notes
    assert "kubectl -n inference port-forward svc/demo-llm-admission 8080:8080" in notes
    assert "curl -si http://127.0.0.1:8080/v1/chat/completions" in notes
    assert '"model": "Qwen/Qwen3-32B"' in notes
    assert 'Grafana dashboard "LLM admission"' in notes and "inference/demo-llm-admission-dashboard" in notes
    assert "prometheusRule.enabled=true" in notes


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"admission": {"maxParkSeconds": -5}}, "at '/admission/maxParkSeconds': exclusiveMinimum: got -5, want 0"),
        ({"admission": {"maxParkSeconds": 0}}, "at '/admission/maxParkSeconds': exclusiveMinimum: got 0, want 0"),
        # Envoy bounds ext_proc's max_message_timeout (park cap + 10 s) at 1 h.
        ({"admission": {"maxParkSeconds": 3591}}, "at '/admission/maxParkSeconds': maximum: got 3,591, want 3,590"),
        ({"admission": {"kvThreshold": 2}}, "at '/admission/kvThreshold': maximum: got 2, want 1"),
        ({"admission": {"failureMode": "sometimes"}},
         "at '/admission/failureMode': value must be one of 'open', 'closed'"),
        ({"admission": {"maxInflight": 0}}, "at '/admission/maxInflight': minimum: got 0, want 1"),
        ({"admission": {"maxBodyBytes": 100}}, "at '/admission/maxBodyBytes': minimum: got 100, want 1,024"),
        ({"admission": {"gatedPaths": ["v1/chat/completions"]}}, "at '/admission/gatedPaths/0'"),
        ({"admision": {"maxInflight": 4}}, "additional properties 'admision' not allowed"),
        ({"engines": [{"name": "Qwen 3", "url": "http://q:8000", "models": ["q"]}]}, "at '/engines/0/name'"),
        ({"engines": [{"name": "q", "url": "https://q:8443", "models": ["q"]}]}, "at '/engines/0/url'"),
        ({"engines": [{"name": "q", "url": "http://q:8000", "models": []}]}, "at '/engines/0/models': minItems"),
        ({"engines": [{"name": "q", "url": "http://q:8000"}]}, "at '/engines/0': missing property 'models'"),
        ({"engines": [{"name": "q", "url": "http://q:8000", "models": ["q"], "kvThreshold": 0}]},
         "at '/engines/0/kvThreshold': exclusiveMinimum"),
        ({"envoy": {"firstTokenAllowanceSeconds": 5}}, "at '/envoy/firstTokenAllowanceSeconds': exclusiveMinimum"),
        ({"shape": "sharded"}, "at '/shape': value must be one of 'sidecar', 'shared'"),
        ({"shape": "shared", "envoy": {"replicas": 0}}, "at '/envoy/replicas': minimum: got 0, want 1"),
        ({"shape": "shared", "clusterDomain": "Cluster.Local."}, "at '/clusterDomain'"),
        # No value sets the shared service's replicas: a second ledger would split the budget.
        ({"shape": "shared", "admissionReplicas": 2}, "additional properties 'admissionReplicas' not allowed"),
    ],
)
def test_schema_rejects_bad_values_naming_the_key(chart: Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as excinfo:
        chart.render(values)
    assert message in str(excinfo.value)


# --- helpers ---------------------------------------------------------------------------------


def _merged(rendered: Rendered) -> dict[str, Any]:
    return rendered.values


def _hcm(envoy: dict[str, Any]) -> dict[str, Any]:
    return envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _seconds(text: str) -> float:
    assert text.endswith("s")
    return float(text[:-1])


def _park_cap(rendered: Rendered) -> float:
    merged = _merged(rendered)
    return max(e.get("maxParkSeconds", merged["admission"]["maxParkSeconds"]) for e in merged["engines"])


def _service_settings(rendered: Rendered, tmp_path: Path) -> Any:
    """Load the rendered env + engines file with the service's own config loader."""
    from extproc.config import load_settings

    path = tmp_path / "engines.yaml"
    path.write_text(rendered.engines_yaml)
    env = rendered.env()
    env["EXTPROC_CONFIG"] = str(path)
    return load_settings(env)


@pytest.mark.parametrize(
    ("envoy_values", "body", "heap", "connections"),
    [
        ({}, 1 << 20, 483183820, 166),
        ({"resources": {"limits": {"memory": "1Gi"}}}, 1 << 20, 966367641, 396),
        ({"resources": {"limits": {"memory": "2G"}}}, 1 << 20, 1800000000, 794),
        ({"resources": {"limits": {"memory": 1073741824}}}, 4 << 20, 966367641, 99),
        ({"maxDownstreamConnections": 1000}, 1 << 20, 483183820, 1000),
    ],
)
def test_envoys_overload_manager_is_sized_from_its_memory_limit_and_the_body_cap(
        chart: Chart, envoy_values: dict[str, Any], body: int, heap: int, connections: int) -> None:
    r = chart.render({"envoy": envoy_values, "admission": {"maxBodyBytes": body}})
    monitors = {m["name"]: m["typed_config"] for m in r.envoy["overload_manager"]["resource_monitors"]}
    assert monitors["envoy.resource_monitors.fixed_heap"]["max_heap_size_bytes"] == heap
    assert (monitors["envoy.resource_monitors.global_downstream_max_connections"]["max_active_downstream_connections"]
            == connections)


def test_an_envoy_without_a_memory_limit_is_refused_at_render(chart: Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape("envoy.resources.limits.memory must be set")):
        chart.render({"envoy": {"resources": {"limits": {"memory": None}}}})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"envoy": {"resources": {"limits": {"memory": "1.5Gi"}}}}, "memory quantity '1.5Gi': want an integer"),
        ({"envoy": {"resources": {"limits": {"memory": "256Mi"}}}, "admission": {"maxBodyBytes": 16 << 20}},
         "Envoy's memory limit (268435456 bytes) leaves room for 3 connections"),
    ],
)
def test_an_envoy_memory_limit_that_cannot_size_the_caps_fails_the_init_container_saying_why(
        chart: Chart, values: dict[str, Any], message: str) -> None:
    """The generator sizes the caps, so its refusal comes at pod start: the envoy-config init
    container exits 2 with the reason in its log, and Envoy never starts with a config that would
    let it be OOM-killed."""
    run = chart.render(values, envoy_config_fails=True).envoy_config_run
    assert run is not None and run.returncode == 2
    assert message in run.stderr
