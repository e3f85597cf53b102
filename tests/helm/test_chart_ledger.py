"""The chart's `ledger` values: where the gates' state lives (local, or Redis shared by the pods).

`ledger.backend: redis` with `ledger.redis.url` or `ledger.redis.existingSecret` becomes the
service's ADMISSION_LEDGER* / ADMISSION_REDIS_URL environment (the URL read from the Secret with
`secretKeyRef` when one is named); the schema refuses a redis ledger without a URL and values the
service would refuse at startup. The default renders ADMISSION_LEDGER=local and nothing else of
the ledger: the other settings only mean something with Redis.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import CHART, NAMESPACE, RELEASE, Chart, Rendered, helm, with_engines
from .test_chart import KUBERNETES_VERSION, validate_manifests

LEDGER_ENV = ("ADMISSION_LEDGER", "ADMISSION_REDIS_URL", "ADMISSION_LEDGER_LEASE_SECONDS",
              "ADMISSION_LEDGER_TIMEOUT_MS", "ADMISSION_LEDGER_KEY_PREFIX")
URL = "redis://:s3cret@redis-master.data.svc:6379/2"
WITH_URL: dict[str, Any] = {"replicaCount": 3, "ledger": {"backend": "redis", "redis": {"url": URL}}}
WITH_SECRET: dict[str, Any] = {
    "replicaCount": 3,
    "ledger": {"backend": "redis", "redis": {"existingSecret": "gateway-redis", "secretKey": "redis-url"},
               "leaseSeconds": 2.5, "timeoutMs": 20, "keyPrefix": "team-x:gw"},
}
SHARED_WITH_URL: dict[str, Any] = {"shape": "shared", "ledger": {"backend": "redis", "redis": {"url": URL}}}


def admission_env(r: Rendered) -> dict[str, dict[str, Any]]:
    """The admission container's env entries by name, `value` and `valueFrom` alike."""
    entries = r.container("admission")["env"]
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), f"an env var is set twice: {names}"
    return {e["name"]: e for e in entries}


def ledger_env(r: Rendered) -> dict[str, dict[str, Any]]:
    return {name: e for name, e in admission_env(r).items() if name in LEDGER_ENV}


def service_settings(r: Rendered, tmp_path: Path, secret_value: str | None = None) -> Any:
    """Load the rendered env + engines file with the service's own config loader; a secretKeyRef
    is resolved to `secret_value`, as the kubelet would from the Secret."""
    from extproc.config import load_settings

    path = tmp_path / "engines.yaml"
    path.write_text(r.engines_yaml)
    env: dict[str, str] = {}
    for name, entry in admission_env(r).items():
        if entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[name] = f"{RELEASE}-llm-admission-7d9f8c6b5-x2x9q"  # what the kubelet puts there
        elif "valueFrom" in entry:
            assert secret_value is not None, f"{name} comes from {entry['valueFrom']}"
            env[name] = secret_value
        else:
            env[name] = entry["value"]
    env["EXTPROC_CONFIG"] = str(path)
    return load_settings(env)


@pytest.mark.parametrize("values", [{}, {"shape": "shared"}, {"replicaCount": 1}], ids=["sidecar", "shared", "one-pod"])
def test_the_default_is_the_local_ledger_and_nothing_else_of_the_ledger(chart: Chart, values: dict[str, Any],
                                                                        tmp_path: Path) -> None:
    r = chart.render(values)
    assert ledger_env(r) == {"ADMISSION_LEDGER": {"name": "ADMISSION_LEDGER", "value": "local"}}
    settings = service_settings(r, tmp_path)
    assert (settings.ledger, settings.redis_url) == ("local", None)


def test_a_redis_url_becomes_the_services_ledger_settings(chart: Chart, tmp_path: Path) -> None:
    r = chart.render(WITH_URL)
    env = {name: e["value"] for name, e in ledger_env(r).items()}
    assert env == {
        "ADMISSION_LEDGER": "redis",
        "ADMISSION_REDIS_URL": URL,
        "ADMISSION_LEDGER_LEASE_SECONDS": "5",
        "ADMISSION_LEDGER_TIMEOUT_MS": "50",
        "ADMISSION_LEDGER_KEY_PREFIX": f"{NAMESPACE}.{RELEASE}-llm-admission",
    }
    settings = service_settings(r, tmp_path)
    assert (settings.ledger, settings.redis_url) == ("redis", URL)
    assert (settings.ledger_lease_seconds, settings.ledger_timeout_seconds) == (5.0, 0.05)
    assert settings.ledger_key_prefix == "inference.demo-llm-admission"
    assert r.deployment["spec"]["replicas"] == 3


def test_with_redis_each_pod_is_a_replica_named_after_itself(chart: Chart, tmp_path: Path) -> None:
    r = chart.render(WITH_URL)
    assert admission_env(r)["ADMISSION_REPLICA_ID"] == {
        "name": "ADMISSION_REPLICA_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    assert service_settings(r, tmp_path).replica_id == f"{RELEASE}-llm-admission-7d9f8c6b5-x2x9q"
    assert "ADMISSION_REPLICA_ID" not in admission_env(chart.render({}))


def test_an_existing_secret_provides_the_url_through_a_secret_key_ref(chart: Chart, tmp_path: Path) -> None:
    r = chart.render(WITH_SECRET)
    env = ledger_env(r)
    assert env["ADMISSION_REDIS_URL"] == {
        "name": "ADMISSION_REDIS_URL",
        "valueFrom": {"secretKeyRef": {"name": "gateway-redis", "key": "redis-url"}},
    }
    assert {name: e["value"] for name, e in env.items() if name != "ADMISSION_REDIS_URL"} == {
        "ADMISSION_LEDGER": "redis",
        "ADMISSION_LEDGER_LEASE_SECONDS": "2.5",
        "ADMISSION_LEDGER_TIMEOUT_MS": "20",
        "ADMISSION_LEDGER_KEY_PREFIX": "team-x:gw",
    }
    settings = service_settings(r, tmp_path, secret_value="rediss://:pw@redis.example:6380/0")
    assert (settings.ledger, settings.redis_url) == ("redis", "rediss://:pw@redis.example:6380/0")
    assert (settings.ledger_lease_seconds, settings.ledger_timeout_seconds, settings.ledger_key_prefix) == (
        2.5, 0.02, "team-x:gw")


def test_the_secret_key_defaults_to_url(chart: Chart) -> None:
    r = chart.render({"ledger": {"backend": "redis", "redis": {"existingSecret": "gateway-redis"}}})
    assert ledger_env(r)["ADMISSION_REDIS_URL"]["valueFrom"] == {"secretKeyRef": {"name": "gateway-redis",
                                                                                  "key": "url"}}


def test_the_shared_shapes_one_service_gets_the_same_ledger_settings(chart: Chart) -> None:
    r = chart.render(SHARED_WITH_URL)
    assert r.deployment_of("admission")["metadata"]["name"].endswith("-extproc")
    assert ledger_env(r)["ADMISSION_REDIS_URL"]["value"] == URL
    assert ledger_env(r)["ADMISSION_LEDGER"]["value"] == "redis"


@pytest.mark.parametrize("values", [WITH_URL, WITH_SECRET, SHARED_WITH_URL], ids=["url", "secret", "shared"])
def test_redis_ledger_manifests_validate_and_lint(chart: Chart, values: dict[str, Any]) -> None:
    assert len(validate_manifests(chart.render(values).objects)) >= 5
    report = helm.lint(str(CHART), with_engines(values), strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBERNETES_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], f"{problems} {report['errors']}"


LONG_NAMESPACE = "a-namespace-name-that-uses-all-sixty-three-characters-allowed-x"
LONG_FULLNAME = "a-rather-long-release-name-for-the-admission-gateway-of-team-"


def key_prefix(chart: Chart, release: str, namespace: str, values: dict[str, Any]) -> str:
    values = {"ledger": {"backend": "redis", "redis": {"url": "redis://redis:6379/0"}}, **values}
    out = chart._chart.render(with_engines(values), name=release, namespace=namespace)
    deployment = next(d for path, text in out.items() if path.endswith("deployment.yaml")
                      for d in yaml.safe_load_all(text) if d)
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "admission")
    return next(e["value"] for e in container["env"] if e["name"] == "ADMISSION_LEDGER_KEY_PREFIX")


def test_the_default_key_prefix_is_one_per_release_and_one_the_service_accepts(chart: Chart) -> None:
    """Engines are keyed by name under the prefix: two releases on one Redis (both with an engine
    "vllm", the tests' engine) must not share gate state unless an operator gives them one prefix."""
    from extproc.config import load_settings

    releases = [
        ("demo", "inference", {}),
        ("other", "inference", {}),
        ("demo", "staging", {}),
        ("x", LONG_NAMESPACE, {"fullnameOverride": LONG_FULLNAME + "x"}),
        ("x", LONG_NAMESPACE, {"fullnameOverride": LONG_FULLNAME + "y"}),
    ]
    prefixes = [key_prefix(chart, *release) for release in releases]
    assert prefixes[:3] == ["inference.demo-llm-admission", "inference.other-llm-admission",
                            "staging.demo-llm-admission"]
    assert len(set(prefixes)) == len(prefixes), prefixes
    for prefix in prefixes:
        assert re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", prefix), prefix
        settings = load_settings({"ADMISSION_OBSERVE_MODELS": "m", "ADMISSION_LEDGER": "redis",
                                  "ADMISSION_REDIS_URL": "redis://redis:6379/0", "ADMISSION_LEDGER_KEY_PREFIX": prefix})
        assert settings.ledger_key_prefix == prefix
    assert key_prefix(chart, "demo", "inference", {"ledger": {"backend": "redis", "redis": {"url": "redis://r"},
                                                              "keyPrefix": "shared-budget"}}) == "shared-budget"


@pytest.mark.parametrize("url", [
    "redis://redis:6379/0",
    "redis://redis",
    "rediss://:p%40ss@redis.example.com:6380/1",
    "redis://default:pw@10.0.0.5:6379",
    "rediss://redis.example.com:6380/0?ssl_cert_reqs=required",
    "unix:///var/run/redis/redis.sock",
])
def test_urls_the_schema_accepts_the_service_accepts(chart: Chart, url: str, tmp_path: Path) -> None:
    r = chart.render({"ledger": {"backend": "redis", "redis": {"url": url}}})
    assert service_settings(r, tmp_path).redis_url == url


@pytest.mark.parametrize(
    ("ledger", "message"),
    [
        ({"backend": "redis"},
         "at '/ledger/redis': 'anyOf' failed"),
        ({"backend": "redis", "redis": {"url": "", "existingSecret": ""}},
         "at '/ledger/redis/url': minLength: got 0, want 1"),
        ({"backend": "redis", "redis": {"url": URL, "existingSecret": "gateway-redis"}},
         "at '/ledger/redis': 'not' failed"),
        ({"backend": "redis", "redis": {"url": "http://redis:6379"}}, "at '/ledger/redis/url'"),
        ({"backend": "redis", "redis": {"url": "redis://"}}, "at '/ledger/redis/url'"),
        ({"backend": "redis", "redis": {"existingSecret": "Not_A_Secret_Name"}}, "at '/ledger/redis/existingSecret'"),
        ({"backend": "etcd"}, "at '/ledger/backend': value must be one of 'local', 'redis'"),
        ({"leaseSeconds": 0.4}, "at '/ledger/leaseSeconds': minimum: got 0.4, want 0.5"),
        ({"leaseSeconds": 301}, "at '/ledger/leaseSeconds': maximum: got 301, want 300"),
        ({"timeoutMs": 0}, "at '/ledger/timeoutMs': minimum: got 0, want 1"),
        ({"timeoutMs": 10001}, "at '/ledger/timeoutMs': maximum: got 10,001, want 10,000"),
        ({"keyPrefix": "team x"}, "at '/ledger/keyPrefix'"),
        ({"keyPrefix": "p" * 65}, "at '/ledger/keyPrefix'"),
        ({"redis": {"password": "pw"}}, "additional properties 'password' not allowed"),
        ({"backnd": "redis"}, "additional properties 'backnd' not allowed"),
    ],
)
def test_schema_refuses_a_redis_ledger_without_a_url_and_bad_ledger_values(
        chart: Chart, ledger: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as excinfo:
        chart.render({"ledger": ledger})
    assert message in str(excinfo.value)


def test_the_ranges_the_schema_admits_are_the_ones_the_service_admits(chart: Chart, tmp_path: Path) -> None:
    for lease, timeout in ((0.5, 1), (300, 10000)):
        r = chart.render({"ledger": {"backend": "redis", "redis": {"url": "redis://redis:6379/0"},
                                     "leaseSeconds": lease, "timeoutMs": timeout, "keyPrefix": "k" * 64}})
        settings = service_settings(r, tmp_path)
        assert (settings.ledger_lease_seconds, settings.ledger_timeout_seconds) == (lease, timeout / 1000)


def test_notes_recommend_the_redis_ledger_for_several_pods_and_never_print_the_url(chart: Chart) -> None:
    local = chart.render({"replicaCount": 3}).notes
    assert "Ledger: local. Each of the 3 pods knows only its own admissions" in local
    assert "ledger.backend=redis" in local
    assert "Ledger:" not in chart.render({"replicaCount": 1}).notes  # one pod is exact on its own
    assert "Ledger:" not in chart.render({"shape": "shared"}).notes  # so is the one shared service
    with_url = chart.render(WITH_URL).notes
    assert "Ledger: redis, key prefix inference.demo-llm-admission" in with_url
    assert "The 3 pods share each engine's state" in with_url and "admission_ledger_degraded" in with_url
    assert "s3cret" not in with_url and URL not in with_url
    with_secret = chart.render(WITH_SECRET).notes
    assert "URL from Secret gateway-redis, key redis-url" in with_secret
    assert "within 2.5 s" in with_secret and "within\n  20 ms" in with_secret
    assert "exact on its own" in chart.render(SHARED_WITH_URL).notes
