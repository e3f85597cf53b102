"""The chart's rendered pod, run for real: Envoy and the service with exactly the rendered config.

Outside Kubernetes, but otherwise as the kubelet would run it: first the envoy-config init
container's command (`extproc envoy-config`, as a process, with its rendered env and arguments:
it writes the Envoy bootstrap), then Envoy and the service with the engines file from the
ConfigMap, the service's environment and both containers' arguments from the Deployment, the
probes' paths, and the two preStop hooks, against the engine simulator.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack import Child, free_port, http_get, simulator_argv, wait_until, with_checkout

from .conftest import Chart, Rendered

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


@dataclass
class Pod:
    rendered: Rendered
    values: dict[str, Any]
    workdir: Path
    sim: Child
    service: Child
    envoy: Child

    def port(self, *keys: str) -> int:
        node: Any = self.values
        for key in keys:
            node = node[key]
        return int(node)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port('envoy', 'port')}"

    def sim_control(self, path: str, doc: dict[str, Any]) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port('sim')}{path}", data=json.dumps(doc).encode(),
                                     method="POST", headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as response:
            response.read()

    def chat(self) -> int:
        return _chat(self.port("envoy", "port"))

    def logs(self) -> str:
        return "\n".join(f"----- {c.name} -----\n{c.log_tail()}" for c in (self.sim, self.service, self.envoy))


def _generate_envoy_config(rendered: Rendered, engines: Path, output: Path, extproc: str | None = None) -> None:
    """Run the init container's command as a process, with its rendered env and arguments; only
    the engines file's and the output's paths are local ones (and, given `extproc`, the service's
    address: outside the cluster its Service's DNS name resolves to nothing)."""
    init = rendered.init_container()
    argv = init["command"] + init.get("args", [])
    argv[argv.index("--output") + 1] = str(output)
    if extproc is not None:
        argv[argv.index("--extproc") + 1] = extproc
    env = {e["name"]: e["value"] for e in init["env"]}
    env["EXTPROC_CONFIG"] = str(engines)
    result = subprocess.run([str(BIN / argv[0]), *argv[1:]], env={"PATH": str(BIN), **env}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert output.is_file()


def _probe(container: dict[str, Any], kind: str, ports: dict[str, int]) -> str:
    get = container[kind]["httpGet"]
    return f"http://127.0.0.1:{ports[get['port']]}{get['path']}"


@pytest.fixture
def pod(chart: Chart, tmp_path: Path) -> Iterator[Pod]:
    values = {
        "sim": free_port(),
        "admission": {"grpcPort": free_port(), "adminPort": free_port(), "debugPort": free_port(), "maxParkSeconds": 2,
                      "pollIntervalSeconds": 0.2, "shutdownGraceSeconds": 2},
        "envoy": {"port": free_port(), "adminPort": free_port(), "healthPort": free_port(), "drainTimeSeconds": 1},
        "shutdown": {"inflightAllowanceSeconds": 30},
    }
    values["engines"] = [{"name": "sim", "url": f"http://127.0.0.1:{values['sim']}", "models": ["sim-model"]}]
    chart_values = {k: v for k, v in values.items() if k != "sim"}
    rendered = chart.render(chart_values)
    (tmp_path / "engines.yaml").write_text(rendered.engines_yaml)
    _generate_envoy_config(rendered, tmp_path / "engines.yaml", tmp_path / "envoy.yaml")

    env = rendered.env()
    env["EXTPROC_CONFIG"] = str(tmp_path / "engines.yaml")
    service_cmd = rendered.container("admission")["command"]
    envoy_args = rendered.container("envoy")["args"]
    envoy_args[envoy_args.index("--config-path") + 1] = str(tmp_path / "envoy.yaml")

    sim = Child("enginesim", simulator_argv("--port", str(values["sim"])), with_checkout({"PATH": str(BIN)}),
                tmp_path / "enginesim.log")
    service = Child("admission", [str(BIN / service_cmd[0]), *service_cmd[1:]], {"PATH": str(BIN), **env},
                    tmp_path / "admission.log")
    envoy = Child("envoy", [str(BIN / "envoy"), *envoy_args], {"PATH": str(BIN)}, tmp_path / "envoy.log")
    p = Pod(rendered, values, tmp_path, sim, service, envoy)
    ports = {"http": values["envoy"]["port"], "envoy-health": values["envoy"]["healthPort"],
             "admin": values["admission"]["adminPort"]}
    try:
        sim.start()
        wait_until(lambda: http_get(f"http://127.0.0.1:{values['sim']}/health")[0] == 200, 20, "the simulator")
        service.start()
        envoy.start()
        for container, name in ((rendered.container("envoy"), "envoy"), (rendered.container("admission"), "admission")):
            for kind in ("readinessProbe", "livenessProbe"):
                url = _probe(container, kind, ports)
                wait_until(lambda url=url: http_get(url, timeout=1.0)[0] == 200, 20, f"{name} {kind} at {url}")
        yield p
    except BaseException:
        print(p.logs())
        raise
    finally:
        for child in (envoy, service, sim):
            child.stop()


def test_the_rendered_pod_serves_a_request_through_envoy_and_the_service(pod: Pod) -> None:
    assert pod.chat() == 200
    status, body = http_get(f"http://127.0.0.1:{pod.port('admission', 'adminPort')}/metrics")
    assert status == 200 and b'admission_admitted_total{engine="sim",model="sim-model",via="admitted"} 1.0' in body
    # The port probes and scrapes reach serves nothing else; the ledger is on loopback only.
    assert http_get(f"http://127.0.0.1:{pod.port('admission', 'adminPort')}/debug/engines")[0] == 404
    assert http_get(f"http://127.0.0.1:{pod.port('admission', 'debugPort')}/debug/engines")[0] == 200
    # Envoy's own metrics are reachable on the health port, its admin API is not.
    status, body = http_get(f"http://127.0.0.1:{pod.port('envoy', 'healthPort')}/stats/prometheus")
    assert status == 200 and b"envoy_http_downstream_rq_total" in body
    assert http_get(f"http://127.0.0.1:{pod.port('envoy', 'healthPort')}/quitquitquit")[0] == 404


def test_prestop_drains_envoy_until_the_request_in_flight_ends_then_the_service_follows(pod: Pod) -> None:
    prestop = pod.workdir / "prestop.sh"
    prestop.write_text(pod.rendered.one("ConfigMap", "-envoy")["data"]["prestop.sh"])
    service_wait = pod.rendered.container("admission")["lifecycle"]["preStop"]["exec"]["command"]
    assert service_wait[0] == "python"

    pod.sim_control("/control/hold", {"hold": True})  # the engine takes no step: the request stays in flight
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(pod.chat)
        wait_until(lambda: b"inference.downstream_rq_active: 1" in http_get(
            f"http://127.0.0.1:{pod.port('envoy', 'adminPort')}/stats?filter=downstream_rq_active")[1], 10,
            "one request in flight")
        started = time.monotonic()
        envoy_hook = subprocess.Popen(["/bin/bash", str(prestop)])
        service_hook = subprocess.Popen([sys.executable, *service_wait[1:]])
        try:
            time.sleep(2.0)
            assert envoy_hook.poll() is None, "Envoy's preStop returned while a request was still in flight"
            assert service_hook.poll() is None, "the service's preStop returned while Envoy was running"
            # Draining, past --drain-time-s: a client still sent here (the endpoint removal has not
            # reached it yet) is served, not refused, and told to close its connection.
            status, connection = _get_models(pod)
            assert (status, connection) == (200, "close")
            pod.sim_control("/control/hold", {"hold": False})
            assert in_flight.result(timeout=20) == 200  # the request in flight finished normally
            assert envoy_hook.wait(timeout=10) == 0
            assert time.monotonic() - started < 15, "Envoy's preStop waited for its deadline, not for the request"
            # The kubelet now stops Envoy; the service's preStop sees its admin port close and returns.
            assert service_hook.poll() is None
            pod.envoy.stop()
            assert service_hook.wait(timeout=10) == 0
            assert pod.service.alive()  # only now would the kubelet send the service SIGTERM
        finally:
            for hook in (envoy_hook, service_hook):
                if hook.poll() is None:
                    hook.kill()
                    hook.wait()


def test_the_rendered_shared_shape_two_envoys_one_service_one_ledger(chart: Chart, tmp_path: Path) -> None:
    """shape=shared for real on loopback: the extproc Deployment's container as rendered (gRPC on
    0.0.0.0), two Envoys with the bootstrap their init containers write (only the Service's DNS
    name replaced by `localhost`, so the cluster is STRICT_DNS as in the cluster), one simulator.
    A request through each Envoy is decided by the one ledger; with the service gone, Envoy fails
    open as documented."""
    sim_port, grpc_port, admin_port = free_port(), free_port(), free_port()
    base = {
        "shape": "shared",
        "engines": [{"name": "sim", "url": f"http://127.0.0.1:{sim_port}", "models": ["sim-model"]}],
        "admission": {"grpcPort": grpc_port, "adminPort": admin_port, "debugPort": free_port(), "maxParkSeconds": 2,
                      "pollIntervalSeconds": 0.2, "shutdownGraceSeconds": 2},
    }
    envoy_ports = [{"port": free_port(), "adminPort": free_port(), "healthPort": free_port()} for _ in range(2)]
    renders = [chart.render({**base, "envoy": ports}) for ports in envoy_ports]
    first = renders[0]
    dns = f"{first.one('Service', '-extproc')['metadata']['name']}.inference.svc.cluster.local"
    assert all(r.env() == first.env() for r in renders)  # the service does not depend on the Envoys

    (tmp_path / "engines.yaml").write_text(first.engines_yaml)
    env = first.env()
    assert env["EXTPROC_LISTEN"] == f"0.0.0.0:{grpc_port}"
    env["EXTPROC_CONFIG"] = str(tmp_path / "engines.yaml")
    service_cmd = first.container("admission")["command"]
    children = [
        Child("enginesim", simulator_argv("--port", str(sim_port)), with_checkout({"PATH": str(BIN)}),
              tmp_path / "enginesim.log"),
        Child("admission", [str(BIN / service_cmd[0]), *service_cmd[1:]], {"PATH": str(BIN), **env},
              tmp_path / "admission.log"),
    ]
    for i, r in enumerate(renders):
        assert r.envoy_text.count(f"address: {dns}\n") == 1
        config = tmp_path / f"envoy-{i}.yaml"
        _generate_envoy_config(r, tmp_path / "engines.yaml", config, extproc=f"localhost:{grpc_port}")
        clusters = yaml.safe_load(config.read_text())["static_resources"]["clusters"]
        extproc = next(c for c in clusters if c["name"] == "extproc")
        assert extproc["type"] == "STRICT_DNS"
        args = r.container("envoy")["args"]
        args[args.index("--config-path") + 1] = str(config)
        children.append(Child(f"envoy-{i}", [str(BIN / "envoy"), *args], {"PATH": str(BIN)},
                              tmp_path / f"envoy-{i}.log"))
    sim, service, *envoys = children
    try:
        sim.start()
        wait_until(lambda: http_get(f"http://127.0.0.1:{sim_port}/health")[0] == 200, 20, "the simulator")
        for child in (service, *envoys):
            child.start()
        probes = [(first.container("admission"), {"admin": admin_port})]
        probes += [(r.container("envoy"), {"envoy-health": p["healthPort"]})
                   for r, p in zip(renders, envoy_ports, strict=True)]
        for container, ports in probes:
            for kind in ("readinessProbe", "livenessProbe"):
                url = _probe(container, kind, ports)
                wait_until(lambda url=url: http_get(url, timeout=1.0)[0] == 200, 20,
                           f"{container['name']} {kind} at {url}")

        for ports in envoy_ports:
            assert _chat(ports["port"]) == 200
        status, body = http_get(f"http://127.0.0.1:{admin_port}/metrics")
        assert status == 200
        # one ledger, both Envoys
        assert b'admission_admitted_total{engine="sim",model="sim-model",via="admitted"} 2.0' in body

        service.stop()  # a restart of the shared service: every Envoy fails open (failureMode open)
        for ports in envoy_ports:
            assert _chat(ports["port"]) == 200
    except BaseException:
        print("\n".join(f"----- {c.name} -----\n{c.log_tail()}" for c in children))
        raise
    finally:
        for child in reversed(children):
            child.stop()


def _get_models(pod: Pod) -> tuple[int, str | None]:
    conn = http.client.HTTPConnection("127.0.0.1", pod.port("envoy", "port"), timeout=10)
    try:
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        response.read()
        return response.status, response.getheader("connection")
    finally:
        conn.close()


def _chat(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"content-type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_the_rendered_envoys_own_answers_are_shaped_like_the_services(pod: Pod) -> None:
    """Engine gone: Envoy itself answers, on gated and ungated paths, in the service's JSON shape."""
    pod.sim.stop()
    for method, path, body in (("POST", "/v1/chat/completions", b'{"model": "sim-model", "messages": []}'),
                               ("GET", "/v1/models", None)):
        conn = http.client.HTTPConnection("127.0.0.1", pod.port("envoy", "port"), timeout=10)
        conn.request(method, path, body=body, headers={"content-type": "application/json"})
        response = conn.getresponse()
        doc = json.loads(response.read())
        conn.close()
        assert response.status == 503
        assert response.getheader("content-type") == "application/json"
        assert response.getheader("x-admission-outcome") == "engine_unavailable"
        assert response.getheader("retry-after") == str(pod.rendered.values["admission"]["retryAfterSeconds"])
        assert doc["error"]["code"] == "engine_unavailable" and doc["error"]["type"] == "service_unavailable"


def test_prestop_on_an_idle_pod_keeps_serving_new_connections_for_the_minimum_drain(pod: Pod) -> None:
    """Nothing in flight: the hook still waits envoy.drainTimeSeconds, serving whoever still comes."""
    prestop = pod.workdir / "prestop.sh"
    prestop.write_text(pod.rendered.one("ConfigMap", "-envoy")["data"]["prestop.sh"])
    minimum = pod.rendered.values["envoy"]["drainTimeSeconds"]
    started = time.monotonic()
    hook = subprocess.Popen(["/bin/bash", str(prestop)])
    try:
        # Served throughout; told to close once the hook has started Envoy's drain (the hook is a
        # separate process: poll until it has, well within the minimum drain).
        deadline = started + minimum
        while (answer := _get_models(pod)) != (200, "close"):
            assert answer[0] == 200, answer
            assert time.monotonic() < deadline, "never told to close during the drain"
            time.sleep(0.05)
        assert pod.chat() == 200
        assert hook.wait(timeout=30) == 0
        assert time.monotonic() - started >= minimum
        assert _get_models(pod)[0] == 200  # the listener is still open until the kubelet stops Envoy
    finally:
        if hook.poll() is None:
            hook.kill()
            hook.wait()
