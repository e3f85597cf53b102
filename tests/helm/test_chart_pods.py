"""Pod hygiene a platform team expects: a default spread over nodes, scheduling per component,
no service account token, escape hatches for volumes and env, and pod labels that a chart bump
does not change."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import CHART, Chart, Rendered, helm, with_engines

SPREAD = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}


def _spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def _envoy_pods(r: Rendered) -> dict[str, Any]:
    return r.deployment_of("envoy")


def test_pods_that_run_envoy_spread_over_nodes_by_default(rendered: Rendered, shared: Rendered) -> None:
    for r in (rendered, shared):
        deployment = _envoy_pods(r)
        [spread] = _spec(deployment)["topologySpreadConstraints"]
        assert {k: spread[k] for k in SPREAD} == SPREAD
        # Counted among this Deployment's own pods only, per ReplicaSet (a surge pod does not skew it).
        assert spread["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
        assert spread["matchLabelKeys"] == ["pod-template-hash"]
    # The shared service has one replica: nothing to spread.
    assert "topologySpreadConstraints" not in _spec(shared.one("Deployment", "-extproc"))


def test_the_default_spread_can_be_replaced_tuned_or_switched_off(chart: Chart) -> None:
    own = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": "x"}}}]
    assert _spec(chart.render({"topologySpreadConstraints": own}).deployment)["topologySpreadConstraints"] == own
    zones = chart.render({"topologySpread": {"topologyKey": "topology.kubernetes.io/zone", "maxSkew": 2,
                                             "whenUnsatisfiable": "DoNotSchedule"}})
    [spread] = _spec(zones.deployment)["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["maxSkew"], spread["whenUnsatisfiable"]) == (
        "topology.kubernetes.io/zone", 2, "DoNotSchedule")
    off = chart.render({"topologySpread": {"enabled": False}})
    assert "topologySpreadConstraints" not in _spec(off.deployment)


def test_each_component_schedules_on_its_own_settings_over_the_shared_ones(chart: Chart) -> None:
    gpu_taint = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    values = {
        "shape": "shared",
        "nodeSelector": {"pool": "general"},
        "tolerations": gpu_taint,
        "envoy": {"scheduling": {"nodeSelector": {"pool": "edge"}}},
        "extproc": {"scheduling": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["control"]}]}]}}}}},
    }
    r = chart.render(values)
    envoy, extproc = _spec(r.one("Deployment", "-envoy")), _spec(r.one("Deployment", "-extproc"))
    assert envoy["nodeSelector"] == {"pool": "edge"} and envoy["tolerations"] == gpu_taint
    assert "affinity" not in envoy
    assert extproc["nodeSelector"] == {"pool": "general"} and extproc["tolerations"] == gpu_taint
    assert extproc["affinity"] == values["extproc"]["scheduling"]["affinity"]
    # The sidecar shape's pods run Envoy: envoy.scheduling is theirs.
    sidecar = _spec(chart.render({k: v for k, v in values.items() if k != "shape"}).deployment)
    assert sidecar["nodeSelector"] == {"pool": "edge"}


def test_no_pod_mounts_a_service_account_token(rendered: Rendered, shared: Rendered, chart: Chart) -> None:
    for r in (rendered, shared):
        for deployment in r.deployments:
            assert _spec(deployment)["automountServiceAccountToken"] is False
            assert "serviceAccountName" not in _spec(deployment)
    named = chart.render({"serviceAccountName": "llm-gateway"}).deployment
    assert _spec(named)["serviceAccountName"] == "llm-gateway" and _spec(named)["automountServiceAccountToken"] is False


def test_extra_volumes_mounts_and_env_from_reach_the_containers(chart: Chart) -> None:
    values = {
        "extraVolumes": [{"name": "tokenizer", "configMap": {"name": "qwen3-tokenizer"}},
                         {"name": "ca", "secret": {"secretName": "corp-ca"}}],
        "admission": {"extraVolumeMounts": [{"name": "tokenizer", "mountPath": "/tokenizer", "readOnly": True}],
                      "envFrom": [{"secretRef": {"name": "hf-token"}}],
                      "estimate": {"tokenizer": "/tokenizer/tokenizer.json"}},
        "envoy": {"extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}]},
    }
    for shape in ("sidecar", "shared"):
        # The tokenizer's ConfigMap is the operator's: its file stands in for it where the
        # envoy-config init container is run (it mounts what the service mounts).
        r = chart.render({**values, "shape": shape}, volume_files={"tokenizer": {"tokenizer.json": "{}"}})
        assert {"name": "tokenizer", "mountPath": "/tokenizer", "readOnly": True} in r.init_container()["volumeMounts"]
        admission, envoy = r.container("admission"), r.container("envoy")
        assert {"name": "tokenizer", "mountPath": "/tokenizer", "readOnly": True} in admission["volumeMounts"]
        assert admission["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
        assert {"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True} in envoy["volumeMounts"]
        assert "envFrom" not in envoy
        for deployment in r.deployments:
            volumes = [v["name"] for v in _spec(deployment)["volumes"]]
            assert {"tokenizer", "ca"} <= set(volumes), deployment["metadata"]["name"]
    plain = chart.render()
    assert "envFrom" not in plain.container("admission")
    assert [m["name"] for m in plain.container("admission")["volumeMounts"]] == ["engines"]


@pytest.mark.parametrize("shape", ["sidecar", "shared"])
def test_a_chart_version_bump_changes_no_pod_template(chart: Chart, shape: str, tmp_path: Path) -> None:
    """Pod templates carry no chart version (a changed label restarts the pods, and in the shared
    shape the one admission service); the objects' own metadata still does."""
    bumped_dir = tmp_path / "llm-admission"
    shutil.copytree(CHART, bumped_dir)
    chart_yaml = bumped_dir / "Chart.yaml"
    meta = yaml.safe_load(chart_yaml.read_text())
    chart_yaml.write_text(chart_yaml.read_text().replace(f"version: {meta['version']}", "version: 9.9.9"))
    values = with_engines({"shape": shape, "image": {"tag": "0.1.0"}})
    with helm.Chart.load(str(bumped_dir)) as loaded:
        bumped = Chart(loaded).render(values)
    before = chart.render(values)
    assert len(before.deployments) == len(bumped.deployments) >= 1
    for old, new in zip(before.deployments, bumped.deployments, strict=True):
        assert new["metadata"]["labels"]["helm.sh/chart"] == "llm-admission-9.9.9"
        assert old["metadata"]["labels"]["helm.sh/chart"] != new["metadata"]["labels"]["helm.sh/chart"]
        assert old["spec"]["template"] == new["spec"]["template"], old["metadata"]["name"]
        labels = new["spec"]["template"]["metadata"]["labels"]
        assert "helm.sh/chart" not in labels and "app.kubernetes.io/version" not in labels
        assert new["spec"]["selector"]["matchLabels"].items() <= labels.items()
    custom = chart.render({"shape": shape, "podLabels": {"team": "inference"}})
    for deployment in custom.deployments:
        assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "inference"
