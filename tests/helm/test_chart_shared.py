"""The "shared" shape: N Envoys whose ext_proc cluster points at ONE admission service.

The service's single ledger is what makes the KV budget exact cluster-wide, so it runs with one
replica and never two at once; the Envoys are the sidecar shape's Envoys with another ext_proc
address.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from .conftest import CHART, NAMESPACE, SHARED_VALUE_SETS, VALUE_SETS, Chart, Rendered, envoy_validate, helm
from .test_chart import _park_cap, _service_settings, validate_manifests


def _extproc_dns(r: Rendered) -> str:
    service = r.one("Service", "-extproc")
    return f"{service['metadata']['name']}.{NAMESPACE}.svc.{r.values['clusterDomain']}"


def _pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict[str, str], deployment: dict[str, Any]) -> bool:
    return selector.items() <= _pod_labels(deployment).items()


def _declared_ports(deployment: dict[str, Any]) -> set[str]:
    return {p["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}


def test_every_manifest_validates_against_the_kubernetes_schema(shared: Rendered) -> None:
    checked = validate_manifests(shared.objects)
    assert len(checked) >= 6
    for obj in checked:
        if obj["kind"] == "Service":  # a DNS label: the Envoys resolve the shared one by name
            assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]


def test_shared_shape_is_an_envoy_deployment_and_one_admission_service(chart: Chart) -> None:
    r = chart.render(SHARED_VALUE_SETS["shared-default"])
    assert r.kinds() == ["ConfigMap", "ConfigMap", "ConfigMap", "Deployment", "Deployment", "NetworkPolicy",
                         "NetworkPolicy", "PodDisruptionBudget", "Service", "Service", "Service"]
    assert sorted(d["metadata"]["name"] for d in r.deployments) == ["demo-llm-admission-envoy",
                                                                    "demo-llm-admission-extproc"]
    assert [c["name"] for c in r.one("Deployment", "-envoy")["spec"]["template"]["spec"]["containers"]] == ["envoy"]
    assert ([c["name"] for c in r.one("Deployment", "-extproc")["spec"]["template"]["spec"]["containers"]]
            == ["admission"])
    # The two Deployments' selectors are disjoint: neither adopts the other's pods.
    envoy, extproc = r.one("Deployment", "-envoy"), r.one("Deployment", "-extproc")
    assert not _selects(envoy["spec"]["selector"]["matchLabels"], extproc)
    assert not _selects(extproc["spec"]["selector"]["matchLabels"], envoy)


def test_the_admission_service_runs_one_replica_never_two_at_once_and_listens_on_all_addresses(
        shared: Rendered) -> None:
    deployment = shared.one("Deployment", "-extproc")
    assert deployment["spec"]["replicas"] == 1  # one ledger; not a value
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # no surge pod, no second ledger
    a = shared.values["admission"]
    env = shared.env()
    assert env["EXTPROC_LISTEN"] == f"0.0.0.0:{a['grpcPort']}"
    assert env["EXTPROC_ADMIN_LISTEN"] == f"127.0.0.1:{a['debugPort']}"
    assert env["EXTPROC_PROBE_LISTEN"] == f"0.0.0.0:{a['adminPort']}"
    service = shared.container("admission")
    assert {p["name"]: p["containerPort"] for p in service["ports"]} == {"grpc": a["grpcPort"], "admin": a["adminPort"]}
    assert service["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert service["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert "lifecycle" not in service  # no Envoy beside it to wait for
    grace = float(service["command"][service["command"].index("--grace") + 1])
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= grace + 5


def test_replica_count_does_not_reach_the_admission_service(chart: Chart) -> None:
    r = chart.render({"shape": "shared", "replicaCount": 7, "envoy": {"replicas": 4}})
    assert r.one("Deployment", "-extproc")["spec"]["replicas"] == 1
    assert r.one("Deployment", "-envoy")["spec"]["replicas"] == 4


def test_the_admission_service_is_a_cluster_ip_service_for_grpc_and_metrics(shared: Rendered) -> None:
    service = shared.one("Service", "-extproc")
    a = shared.values["admission"]
    assert service["spec"]["type"] == "ClusterIP"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"] == {"name": "grpc", "port": a["grpcPort"], "targetPort": "grpc", "protocol": "TCP",
                             "appProtocol": "grpc"}
    assert ports["admin"]["port"] == a["adminPort"] and ports["admin"]["targetPort"] == "admin"
    assert _selects(service["spec"]["selector"], shared.one("Deployment", "-extproc"))
    assert not _selects(service["spec"]["selector"], shared.one("Deployment", "-envoy"))


def test_envoys_run_the_sidecar_shapes_envoy_container_and_the_inference_service_selects_them(
    chart: Chart, shared: Rendered, shared_value_set: tuple[str, dict[str, Any]]
) -> None:
    deployment = shared.one("Deployment", "-envoy")
    assert deployment["spec"]["replicas"] == shared.values["envoy"]["replicas"]
    # The same named template renders Envoy in both shapes: identical container, identical volume.
    sidecar_values = {k: v for k, v in shared_value_set[1].items() if k != "shape"}
    sidecar = chart.render(sidecar_values)
    assert shared.container("envoy") == sidecar.container("envoy")
    envoy_volume = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "envoy-config"]
    assert envoy_volume == [v for v in sidecar.deployment["spec"]["template"]["spec"]["volumes"]
                            if v["name"] == "envoy-config"]
    assert (shared.one("ConfigMap", "-envoy")["data"]["prestop.sh"]
            == sidecar.one("ConfigMap", "-envoy")["data"]["prestop.sh"])
    # So is its config's init container, but for where the service is: the shared Service's name.
    init, sidecar_init = shared.init_container(), sidecar.init_container()
    at = init["command"].index("--extproc") + 1
    assert init["command"][at] == f"{_extproc_dns(shared)}:{shared.values['admission']['grpcPort']}"
    assert sidecar_init["command"][at] == f"127.0.0.1:{shared.values['admission']['grpcPort']}"
    assert {**init, "command": init["command"][:at] + init["command"][at + 1:], "env": None} == {
        **sidecar_init, "command": sidecar_init["command"][:at] + sidecar_init["command"][at + 1:], "env": None}
    # The env differs only where the service listens (0.0.0.0 for the Envoys of the shared shape).
    differ = [(a, b) for a, b in zip(init["env"], sidecar_init["env"], strict=True) if a != b]
    assert [a["name"] for a, _ in differ] == ["EXTPROC_LISTEN"]
    # Its pods wait for Envoy's drain only (there is no service beside it).
    drain = math.ceil(_park_cap(shared)) + shared.values["shutdown"]["inflightAllowanceSeconds"]
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == drain + 2 + 5

    inference = next(s for s in shared.objects if s["kind"] == "Service"
                     and s["metadata"].get("labels", {}).get("app.kubernetes.io/component") is None)
    assert _selects(inference["spec"]["selector"], deployment)
    assert not _selects(inference["spec"]["selector"], shared.one("Deployment", "-extproc"))
    assert [p["targetPort"] for p in inference["spec"]["ports"]] == ["http"] and "http" in _declared_ports(deployment)


def test_the_pod_disruption_budget_covers_the_envoys_only(shared: Rendered) -> None:
    pdbs = [o for o in shared.objects if o["kind"] == "PodDisruptionBudget"]
    if not shared.values["podDisruptionBudget"]["enabled"]:
        assert pdbs == []
        return
    assert len(pdbs) == 1
    selector = pdbs[0]["spec"]["selector"]["matchLabels"]
    assert _selects(selector, shared.one("Deployment", "-envoy"))
    # One replica: any budget that protected it would block every node drain.
    assert not _selects(selector, shared.one("Deployment", "-extproc"))


def test_rendered_envoy_config_is_what_the_generator_builds_for_the_shared_service(shared: Rendered,
                                                                                   tmp_path: Path) -> None:
    """The init container's config, from the values read here: the ext_proc cluster is the shared
    Service's DNS name (STRICT_DNS: it resolves to the ClusterIP)."""
    from extproc.envoyconf import build_envoy_config, memory_bytes

    settings = _service_settings(shared, tmp_path)
    assert settings.grpc_host == "0.0.0.0"
    merged = shared.values
    expected = build_envoy_config(
        settings,
        listen_host="0.0.0.0", listen_port=merged["envoy"]["port"],
        admin_host="127.0.0.1", admin_port=merged["envoy"]["adminPort"],
        health_port=merged["envoy"]["healthPort"],
        extproc_host=_extproc_dns(shared), extproc_port=merged["admission"]["grpcPort"],
        failure_mode=merged["admission"]["failureMode"],
        first_token_allowance=merged["envoy"]["firstTokenAllowanceSeconds"],
        memory_limit_bytes=memory_bytes(merged["envoy"]["resources"]["limits"]["memory"]),
        downstream_connections=merged["envoy"].get("maxDownstreamConnections"),
    )
    got = shared.envoy
    assert got == expected
    extproc = next(c for c in got["static_resources"]["clusters"] if c["name"] == "extproc")
    assert extproc["type"] == "STRICT_DNS"
    address = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert address == {"address": _extproc_dns(shared), "port_value": merged["admission"]["grpcPort"]}


def test_envoy_accepts_the_rendered_config(shared: Rendered) -> None:
    assert envoy_validate(shared.envoy_text) == ""


def test_metrics_job_llm_admission_is_the_admission_service_in_both_shapes(chart: Chart) -> None:
    """The ServiceMonitor's admin endpoint (job="llm-admission") reaches the admission containers only."""
    for values in (VALUE_SETS["monitoring-on"], SHARED_VALUE_SETS["shared-custom"]):
        r = chart.render(values)
        monitor = r.one("ServiceMonitor")
        services = [s for s in r.objects if s["kind"] == "Service"
                    and monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert [s["metadata"]["name"] for s in services] == [r.one("Service", "-metrics")["metadata"]["name"]]
        jobs = {}
        for endpoint in monitor["spec"]["endpoints"]:
            job = next(x["replacement"] for x in endpoint["relabelings"] if x["targetLabel"] == "job")
            port = next(p for p in services[0]["spec"]["ports"] if p["name"] == endpoint["port"])
            # A Service port's endpoints are the selected pods that declare its (named) target port.
            jobs[job] = sorted(
                c["name"] for d in r.deployments if _selects(services[0]["spec"]["selector"], d)
                for c in d["spec"]["template"]["spec"]["containers"]
                if port["targetPort"] in {p["name"] for p in c["ports"]})
        assert jobs == {"llm-admission": ["admission"], "llm-admission-envoy": ["envoy"]}
        assert r.one("PrometheusRule")["spec"]["groups"]
        assert r.one("ConfigMap", "-dashboard")["data"]["llm-admission.json"]


def test_config_changes_roll_the_pods_that_read_them(chart: Chart) -> None:
    def annotations(values: dict[str, Any], suffix: str) -> dict[str, str]:
        deployment = chart.render({"shape": "shared", **values}).one("Deployment", suffix)
        return deployment["spec"]["template"]["metadata"]["annotations"]

    assert (annotations({}, "-envoy")["checksum/envoy"]
            != annotations({"admission": {"maxParkSeconds": 60}}, "-envoy")["checksum/envoy"])
    other = {"engines": [{"name": "vllm", "url": "http://vllm:8000", "models": ["other"]}]}
    assert annotations({}, "-extproc")["checksum/engines"] != annotations(other, "-extproc")["checksum/engines"]
    # The Envoys' config is generated from the engines file too.
    assert annotations({}, "-envoy")["checksum/engines"] != annotations(other, "-envoy")["checksum/engines"]


def test_notes_name_the_shared_service_and_what_a_restart_does(chart: Chart) -> None:
    notes = chart.render(SHARED_VALUE_SETS["shared-default"]).notes
    assert "kubectl -n inference port-forward svc/demo-llm-admission 8080:8080" in notes
    assert "3 Envoy pods (Deployment demo-llm-admission-envoy)" in notes
    assert "port-forward deploy/demo-llm-admission-extproc 9005" in notes
    assert "1 replica" in notes and "forwards requests ungated" in notes
    closed = chart.render({"shape": "shared", "admission": {"failureMode": "closed"}}).notes
    assert "EVERY Envoy, for every restart" in closed



# --- changing the shape on upgrade ---------------------------------------------------------------


def _guard_chart(tmp_path: Path, previous_selector: dict[str, str] | None) -> Path:
    """A copy of the chart whose extra template runs the guard on a given live Service (what
    `lookup` returns against a cluster; offline it returns nothing)."""
    copy = tmp_path / "llm-admission"
    shutil.copytree(CHART, copy)
    previous = {"spec": {"selector": previous_selector}} if previous_selector is not None else {}
    literal = json.dumps(json.dumps(previous))  # a Go string literal holding the JSON
    (copy / "templates" / "zz-guard.yaml").write_text(
        f'{{{{- include "llm-admission.shapeChangeGuard" (dict "ctx" . "previous" (fromJson {literal})) }}}}\n')
    return copy


SIDECAR_SERVICE = {"app.kubernetes.io/name": "llm-admission", "app.kubernetes.io/instance": "demo"}
SHARED_SERVICE = {**SIDECAR_SERVICE, "app.kubernetes.io/component": "envoy"}


@pytest.mark.parametrize(
    ("previous", "values", "refused"),
    [
        (SIDECAR_SERVICE, {"shape": "shared"}, 'this release runs shape "sidecar" and the upgrade asks for "shared"'),
        (SHARED_SERVICE, {}, 'this release runs shape "shared" and the upgrade asks for "sidecar"'),
        (SIDECAR_SERVICE, {"shape": "shared", "shapeChange": {"allow": True}}, None),
        (SIDECAR_SERVICE, {}, None),
        (SHARED_SERVICE, {"shape": "shared"}, None),
        (None, {"shape": "shared"}, None),  # a first install: no live Service
    ],
)
def test_an_upgrade_that_changes_the_shape_is_refused_unless_allowed(
        tmp_path: Path, previous: dict[str, str] | None, values: dict[str, Any], refused: str | None) -> None:
    copy = _guard_chart(tmp_path, previous)
    with helm.Chart.load(str(copy)) as loaded:
        chart = Chart(loaded)
        if refused is None:
            chart.render(values, is_upgrade=True)
            return
        with pytest.raises(helm.HelmRenderError) as excinfo:
            chart.render(values, is_upgrade=True)
    message = str(excinfo.value)
    assert refused in message and "shapeChange.allow=true" in message and "no Ready pod" in message


def test_the_inference_service_runs_the_guard_on_the_live_service_of_the_same_name() -> None:
    text = (CHART / "templates" / "service.yaml").read_text()
    assert ('{{- include "llm-admission.shapeChangeGuard" (dict "ctx" . "previous" '
            '(lookup "v1" "Service" .Release.Namespace (include "llm-admission.fullname" .))) }}') in text


@pytest.mark.parametrize(("shape", "selector"), [("sidecar", SIDECAR_SERVICE), ("shared", SHARED_SERVICE)])
def test_the_guard_reads_the_shape_from_the_selector_each_shape_renders(chart: Chart, shape: str,
                                                                         selector: dict[str, str]) -> None:
    inference = next(s for s in chart.render({"shape": shape}).objects
                     if s["kind"] == "Service" and s["metadata"]["name"] == "demo-llm-admission")
    assert inference["spec"]["selector"] == selector
