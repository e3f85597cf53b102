"""Render helm/llm-admission with Helm's own engine (helm-python-sdk: Helm v4's Go code, no binary)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the test extras: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "llm-admission"
RELEASE = "demo"
NAMESPACE = "inference"

# The chart ships no engine (helm install without one fails, tests/helm/test_chart_engines.py):
# every rendering that does not name its own gets this one, ONE vLLM process behind a
# single-replica Service.
ENGINES: list[dict[str, Any]] = [{"name": "vllm", "url": "http://vllm:8000", "models": ["qwen3"]}]


def with_engines(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """`values`, plus the test engine unless they name engines themselves."""
    values = dict(values or {})
    values.setdefault("engines", ENGINES)
    return values

# Value sets every structural test runs over: the defaults and the shapes operators will use.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "several-engines": {
        "engines": [
            {"name": "qwen", "url": "http://vllm-qwen:8000", "models": ["Qwen/Qwen3-32B", "qwen3"],
             "maxInflight": 8, "kvThreshold": 0.85, "maxParkSeconds": 300},
            {"name": "llama", "url": "http://10.0.0.7:8001", "metricsUrl": "http://10.0.0.7:9090/metrics",
             "models": ["meta-llama/Llama-3.1-8B-Instruct"], "maxQueueDepth": 16, "kvCapacityTokens": 152432},
            {"name": "mistral-small", "url": "http://mistral.models.svc.cluster.local",
             "models": ["mistralai/Mistral-Small-3.2-24B-Instruct-2506"]},
        ],
    },
    "failure-mode-closed": {"admission": {"failureMode": "closed"}},
    "custom-park-cap": {
        "admission": {"maxParkSeconds": 30.5, "maxBodyBytes": 4194304, "maxStreams": 2048, "kvBudget": False,
                      "backfill": False, "bytesPerToken": 3.5, "estimateSafetyFactor": 1.25, "defaultMaxTokens": 256,
                      "kvCapacityTokens": 65536},
        "envoy": {"firstTokenAllowanceSeconds": 120, "resources": {"limits": {"cpu": "1500m"}}},
        "shutdown": {"inflightAllowanceSeconds": 15},
    },
    "monitoring-on": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "dashboard": {"namespace": "monitoring", "folder": "LLM"},
    },
    "minimal": {
        "replicaCount": 1,
        "podDisruptionBudget": {"enabled": False},
        "dashboard": {"enabled": False},
        "service": {"type": "LoadBalancer"},
    },
}

# The "shared" shape (N Envoys, one admission service), over the same kinds of variation.
SHARED_VALUE_SETS: dict[str, dict[str, Any]] = {
    "shared-default": {"shape": "shared"},
    "shared-several-engines": {
        "shape": "shared",
        "engines": VALUE_SETS["several-engines"]["engines"],
        "envoy": {"replicas": 5},
    },
    "shared-custom": {
        "shape": "shared",
        "clusterDomain": "corp.example",
        "fullnameOverride": "a-rather-long-release-name-for-the-admission-gateway-of-team-x",
        "admission": {"grpcPort": 50051, "adminPort": 8081, "failureMode": "closed", "maxParkSeconds": 30.5,
                      "maxStreams": 2048, "shutdownGraceSeconds": 20},
        "envoy": {"replicas": 2, "resources": {"limits": {"cpu": "1500m"}}},
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
    },
    "shared-minimal": {
        "shape": "shared",
        "envoy": {"replicas": 1},
        "podDisruptionBudget": {"enabled": False},
        "dashboard": {"enabled": False},
    },
}


@dataclass
class Rendered:
    """One rendering: every Kubernetes object, plus NOTES.txt."""

    objects: list[dict[str, Any]]
    notes: str
    values: dict[str, Any]  # the chart's defaults coalesced with the values given

    def one(self, kind: str, suffix: str = "") -> dict[str, Any]:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
        assert len(found) == 1, f"expected one {kind} named *{suffix}, got {[o['metadata']['name'] for o in found]}"
        return found[0]

    def kinds(self) -> list[str]:
        return sorted(o["kind"] for o in self.objects)

    @property
    def deployment(self) -> dict[str, Any]:
        return self.one("Deployment")

    @property
    def deployments(self) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == "Deployment"]

    def container(self, name: str) -> dict[str, Any]:
        """The container called `name`, in whichever Deployment runs it (it must be exactly one)."""
        found = [c for d in self.deployments for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == name]
        assert len(found) == 1, f"expected one container {name!r}, got {len(found)}"
        return found[0]

    def deployment_of(self, container: str) -> dict[str, Any]:
        return next(d for d in self.deployments
                    if container in [c["name"] for c in d["spec"]["template"]["spec"]["containers"]])

    def env(self) -> dict[str, str]:
        return {e["name"]: e["value"] for e in self.container("admission")["env"]}

    @property
    def envoy_text(self) -> str:
        return self.one("ConfigMap", "-envoy")["data"]["envoy.yaml"]

    @property
    def envoy(self) -> dict[str, Any]:
        return yaml.safe_load(self.envoy_text)

    @property
    def engines_yaml(self) -> str:
        return self.one("ConfigMap", "-engines")["data"]["engines.yaml"]


class Chart:
    def __init__(self, chart: Any) -> None:
        self._chart = chart

    def render(self, values: Mapping[str, Any] | None = None, *, as_given: bool = False, **options: Any) -> Rendered:
        """Render with `values` (plus the test engine unless they name engines, or `as_given`)."""
        values = dict(values or {}) if as_given else with_engines(values)
        out = self._chart.render(values, name=RELEASE, namespace=NAMESPACE, **options)
        objects: list[dict[str, Any]] = []
        notes = ""
        for path, text in sorted(out.items()):
            if path.endswith("NOTES.txt"):
                notes = text
                continue
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
        return Rendered(objects, notes, self._chart.merge_values(values))

    def merged(self, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self._chart.merge_values(with_engines(values))


@pytest.fixture(scope="session")
def chart() -> Iterator[Chart]:
    with helm.Chart.load(str(CHART)) as loaded:
        yield Chart(loaded)


@pytest.fixture(scope="session", params=sorted(VALUE_SETS))
def value_set(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param, VALUE_SETS[request.param]


@pytest.fixture(scope="session")
def rendered(chart: Chart, value_set: tuple[str, dict[str, Any]]) -> Rendered:
    return chart.render(value_set[1])


@pytest.fixture(scope="session", params=sorted(SHARED_VALUE_SETS))
def shared_value_set(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param, SHARED_VALUE_SETS[request.param]


@pytest.fixture(scope="session")
def shared(chart: Chart, shared_value_set: tuple[str, dict[str, Any]]) -> Rendered:
    return chart.render(shared_value_set[1])
