"""NetworkPolicies, on by default: who may reach each port of each pod, and where the pods may go.

A small evaluator applies the rendered policies the way the NetworkPolicy API defines them (a pod
no policy selects is open; a selected pod admits what any rule of any selecting policy allows; a
rule without `from`/`to` allows any peer; podSelector alone means the policy's namespace), so the
tests state reachability, not YAML shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from .conftest import NAMESPACE, VALUE_SETS, Chart, Rendered
from .test_chart import validate_manifests

MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
APPS = {"kubernetes.io/metadata.name": "apps", "team": "apps"}
KUBE_SYSTEM = {"kubernetes.io/metadata.name": "kube-system"}
HOME = {"kubernetes.io/metadata.name": NAMESPACE}


@dataclass
class Peer:
    labels: dict[str, str] = field(default_factory=dict)
    namespace: dict[str, str] = field(default_factory=lambda: dict(HOME))
    ip: str = "10.1.2.3"


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the chart only renders matchLabels
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict[str, Any], who: Peer) -> bool:
    if "ipBlock" in peer:
        import ipaddress
        return ipaddress.ip_address(who.ip) in ipaddress.ip_network(peer["ipBlock"]["cidr"])
    ns_ok = _matches(peer["namespaceSelector"], who.namespace) if "namespaceSelector" in peer else who.namespace == HOME
    pod_ok = _matches(peer["podSelector"], who.labels) if "podSelector" in peer else True
    return ns_ok and pod_ok


def _port_matches(rule_port: dict[str, Any], port: int, protocol: str, named: dict[str, int]) -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    wanted = rule_port["port"]
    return (named.get(wanted) if isinstance(wanted, str) else wanted) == port


def _policies(r: Rendered) -> list[dict[str, Any]]:
    return [o for o in r.objects if o["kind"] == "NetworkPolicy"]


def _selecting(r: Rendered, pod_labels: dict[str, str], kind: str) -> list[dict[str, Any]]:
    return [p for p in _policies(r)
            if _matches(p["spec"]["podSelector"], pod_labels) and kind in p["spec"]["policyTypes"]]


def _named_ports(deployment: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"]
            for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]}


def ingress_allowed(r: Rendered, deployment: dict[str, Any], port: int, source: Peer, protocol: str = "TCP") -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    policies = _selecting(r, labels, "Ingress")
    if not policies:
        return True
    named = _named_ports(deployment)
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and not any(_port_matches(p, port, protocol, named) for p in rule["ports"]):
                continue
            if not rule.get("from") or any(_peer_matches(peer, source) for peer in rule["from"]):
                return True
    return False


def egress_allowed(r: Rendered, deployment: dict[str, Any], port: int, destination: Peer, protocol: str = "TCP",
                   destination_ports: dict[str, int] | None = None) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    policies = _selecting(r, labels, "Egress")
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("egress", []):
            if rule.get("ports") and not any(_port_matches(p, port, protocol, destination_ports or {})
                                             for p in rule["ports"]):
                continue
            if not rule.get("to") or any(_peer_matches(peer, destination) for peer in rule["to"]):
                return True
    return False


def _pod_labels(d: dict[str, Any]) -> dict[str, str]:
    return dict(d["spec"]["template"]["metadata"]["labels"])


# --- tests ------------------------------------------------------------------------------------


def test_policies_are_rendered_by_default_and_select_every_pod_of_the_release(rendered: Rendered,
                                                                              shared: Rendered) -> None:
    for r in (rendered, shared):
        policies = _policies(r)
        assert policies and len(validate_manifests(policies)) == len(policies)
        for deployment in r.deployments:
            selecting = [p for p in policies if _matches(p["spec"]["podSelector"], _pod_labels(deployment))]
            assert len(selecting) == 1, deployment["metadata"]["name"]
            assert selecting[0]["spec"]["policyTypes"] == ["Ingress", "Egress"]


def test_policies_can_be_switched_off(chart: Chart) -> None:
    for shape in ("sidecar", "shared"):
        assert "NetworkPolicy" not in chart.render({"shape": shape, "networkPolicy": {"enabled": False}}).kinds()


@pytest.mark.parametrize("shape", ["sidecar", "shared"])
def test_the_inference_port_is_open_by_default_and_limited_to_the_configured_peers(chart: Chart, shape: str) -> None:
    r = chart.render({"shape": shape})
    envoy = r.deployment_of("envoy")
    port = r.values["envoy"]["port"]
    assert ingress_allowed(r, envoy, port, Peer(namespace=APPS))
    assert ingress_allowed(r, envoy, port, Peer(namespace={}, ip="203.0.113.9"))  # a LoadBalancer's client
    limited = chart.render({"shape": shape, "networkPolicy": {
        "inferenceFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]}})
    envoy = limited.deployment_of("envoy")
    assert ingress_allowed(limited, envoy, port, Peer(namespace=APPS))
    assert not ingress_allowed(limited, envoy, port, Peer(namespace={"kubernetes.io/metadata.name": "other"}))
    assert not ingress_allowed(limited, envoy, port, Peer())  # not even from the release's own namespace


@pytest.mark.parametrize("shape", ["sidecar", "shared"])
def test_metrics_ports_only_from_the_monitoring_namespace(chart: Chart, shape: str) -> None:
    r = chart.render({"shape": shape})
    for deployment in r.deployments:
        ports = _named_ports(deployment)
        for name in ("admin", "envoy-health"):
            if name not in ports:
                continue
            assert ingress_allowed(r, deployment, ports[name], Peer(labels={"app": "prometheus"}, namespace=MONITORING))
            assert not ingress_allowed(r, deployment, ports[name], Peer(namespace=APPS)), name
            assert not ingress_allowed(r, deployment, ports[name], Peer()), name
    other = chart.render({"shape": shape, "networkPolicy": {
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {"obs": "yes"}}}]}})
    deployment = other.deployment_of("admission")
    admin = _named_ports(deployment)["admin"]
    assert ingress_allowed(other, deployment, admin, Peer(namespace={"obs": "yes"}))
    assert not ingress_allowed(other, deployment, admin, Peer(namespace=MONITORING))


def test_the_shared_grpc_port_only_from_this_releases_envoys(chart: Chart) -> None:
    r = chart.render({"shape": "shared"})
    extproc, envoy = r.one("Deployment", "-extproc"), r.one("Deployment", "-envoy")
    grpc = _named_ports(extproc)["grpc"]
    assert ingress_allowed(r, extproc, grpc, Peer(labels=_pod_labels(envoy)))
    another_release = {**_pod_labels(envoy), "app.kubernetes.io/instance": "other"}
    assert not ingress_allowed(r, extproc, grpc, Peer(labels=another_release))
    assert not ingress_allowed(r, extproc, grpc, Peer(labels=_pod_labels(envoy), namespace=APPS))
    assert not ingress_allowed(r, extproc, grpc, Peer(labels={"app": "curl"}))
    assert not ingress_allowed(r, extproc, grpc, Peer(labels={"app": "prometheus"}, namespace=MONITORING))
    # ... and the Envoys may reach it.
    assert egress_allowed(r, envoy, grpc, Peer(labels=_pod_labels(extproc)))
    assert not egress_allowed(r, envoy, grpc, Peer(labels={"app": "curl"}))


def test_egress_reaches_dns_and_the_engines_ports_and_nothing_else(chart: Chart) -> None:
    r = chart.render(VALUE_SETS["several-engines"])  # ports 8000 (qwen), 8001 + metrics 9090 (llama), 80 (mistral)
    pod = r.deployment
    kube_dns = Peer(labels={"k8s-app": "kube-dns"}, namespace=KUBE_SYSTEM)
    assert egress_allowed(r, pod, 53, kube_dns, "UDP") and egress_allowed(r, pod, 53, kube_dns, "TCP")
    assert not egress_allowed(r, pod, 53, Peer(labels={"app": "dns"}, namespace=APPS), "UDP")
    for port in (8000, 8001, 9090, 80):
        assert egress_allowed(r, pod, port,
                              Peer(namespace={"kubernetes.io/metadata.name": "models"}, ip="10.8.0.5")), port
    for port in (443, 6379, 22, 9002):
        assert not egress_allowed(r, pod, port, Peer(namespace=APPS)), port
    narrowed = chart.render({**VALUE_SETS["several-engines"],
                             "networkPolicy": {"enginesTo": [{"ipBlock": {"cidr": "10.8.0.0/16"}}]}})
    assert egress_allowed(narrowed, narrowed.deployment, 8000, Peer(ip="10.8.3.4"))
    assert not egress_allowed(narrowed, narrowed.deployment, 8000, Peer(ip="10.9.3.4"))


@pytest.mark.parametrize(
    ("ledger", "port"),
    [
        ({"backend": "local"}, None),
        ({"backend": "redis", "redis": {"url": "redis://:secret@redis.cache:6380/0"}}, 6380),
        ({"backend": "redis", "redis": {"url": "rediss://redis.cache/0"}}, 6379),
        ({"backend": "redis", "redis": {"existingSecret": "gw-redis"}}, 6379),
        ({"backend": "redis", "redis": {"url": "unix:///run/redis.sock"}}, None),
    ],
)
@pytest.mark.parametrize("shape", ["sidecar", "shared"])
def test_redis_egress_only_with_the_redis_ledger(chart: Chart, ledger: dict[str, Any], port: int | None,
                                                 shape: str) -> None:
    r = chart.render({"shape": shape, "ledger": ledger})
    redis = Peer(labels={"app": "redis"}, namespace={"kubernetes.io/metadata.name": "cache"})
    service = r.deployment_of("admission")
    for candidate in (6379, 6380):
        assert egress_allowed(r, service, candidate, redis) == (candidate == port), candidate
    if shape == "shared":  # the Envoys never talk to Redis
        assert not egress_allowed(r, r.deployment_of("envoy"), 6379, redis)


def test_extra_rules_are_added(chart: Chart) -> None:
    values = {"networkPolicy": {
        "extraIngress": [{"ports": [{"port": 9999}]}],
        "extraEgress": [{"to": [{"ipBlock": {"cidr": "10.50.0.0/16"}}], "ports": [{"port": 4317}]}]}}
    r = chart.render(values)
    assert ingress_allowed(r, r.deployment, 9999, Peer(namespace=APPS))
    assert egress_allowed(r, r.deployment, 4317, Peer(ip="10.50.1.1"))
    assert not egress_allowed(r, r.deployment, 4317, Peer(ip="10.51.1.1"))


def test_the_install_notes_say_what_the_policies_let_in(chart: Chart) -> None:
    notes = chart.render({"shape": "shared"}).notes
    assert "NetworkPolicies are on: inference from any source (narrow it with networkPolicy.inferenceFrom)" in notes
    assert "the Envoys to the admission service's gRPC port only" in notes
    assert "NetworkPolicies are on" not in chart.render({"networkPolicy": {"enabled": False}}).notes
