"""A real Prometheus scrapes the real stack: every dashboard query returns data, the alerts fire.

The stack is the one `make run` starts (simulator + `extproc serve` + Envoy, devstack),
with fast clocks and the shared ledger on a throwaway redis-server (ADMISSION_LEDGER=redis: the
`admission_ledger_*` series the dashboard's "Shared ledger (Redis)" row and two alerts use exist
only then; every other series is exported with either ledger). Prometheus (the Debian package's
binary) scrapes the service as job="llm-admission" and the simulator as job="vllm", once a
second, and loads alerts/llm-admission.rules.yml. The test drives admissions, parks, park
timeouts, queue-full rejections, a park with a predicted wait (long generations fill the slots,
a request parks once the gate has measured the engine, and is admitted), an unknown model, an
ungated path and a short engine outage, then evaluates every query of the committed dashboard
through Prometheus' HTTP API, then stops
Redis, breaks the engine's metrics and stops the service and watches the alert expressions turn
true. (The lease-expiry alert needs a second replica to die: its promtool unit test covers it.)
"""

from __future__ import annotations

import http.client
import json
import math
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack import LocalStack, RedisServer, free_port, http_get, wait_until

from .dashboard_queries import concrete, dashboard, targets

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "llm-admission.rules.yml"
PARK_SECONDS = 1.5
SERVICE_ENV = {
    "ENGINE_POLL_INTERVAL_SECONDS": "0.2",
    "ENGINE_STALE_AFTER_POLLS": "3",
    "ADMISSION_OBSERVE_MODELS": "sim-model",
    "ADMISSION_MAX_INFLIGHT": "4",
    "VLLM_MAX_QUEUE_DEPTH": "2",
    "ADMISSION_MAX_PARK_SECONDS": str(PARK_SECONDS),
}
CHAT = "/v1/chat/completions"
#: max_tokens of prediction_round's long requests: the simulator's small preset decodes four at once
#: at ~5 ms a step, ~5 s for these (the gate needs 8 busy polls, 1.6 s, to measure the engine).
LONG_TOKENS = 1000
#: Series only a kubelet exports (cAdvisor): the local stack has no containers, so the queries and
#: variables that read them are checked as PromQL (test_dashboard.py), not for data here.
KUBELET_ONLY = "container_cpu_cfs_"


class Prometheus:
    def __init__(self, binary: str, workdir: Path, targets: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                               for job, target in targets.items()],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{self.log_tail()}")
            return http_get(f"{self.url}/-/ready", timeout=1.0)[0] == 200

        wait_until(ready, timeout, "prometheus to be ready")

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as response:
            doc = json.loads(response.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", f"{expr}: {data['resultType']}"
        return data["result"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def finite(result: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in result if math.isfinite(float(s["value"][1]))]


@pytest.fixture
def observed(tmp_path: Path, prometheus_binary: str,
             redis_server_binary: str) -> Iterator[tuple[LocalStack, Prometheus, RedisServer]]:
    redis = RedisServer(tmp_path / "redis")
    stack = LocalStack(workdir=tmp_path / "stack", extproc_env=SERVICE_ENV)
    prometheus: Prometheus | None = None
    try:
        redis.start()
        stack.extproc_env = {**SERVICE_ENV, "ADMISSION_LEDGER": "redis", "ADMISSION_REDIS_URL": redis.url}
        stack.start()
        prometheus = Prometheus(prometheus_binary, tmp_path, {
            "llm-admission": f"127.0.0.1:{stack.admin_port}",
            "vllm": f"127.0.0.1:{stack.sim_port}",
        })
        prometheus.wait_ready()
        yield stack, prometheus, redis
    except BaseException:
        print(stack.logs())
        if prometheus is not None:
            print(f"----- prometheus -----\n{prometheus.log_tail()}")
        raise
    finally:
        if prometheus is not None:
            prometheus.stop()
        stack.stop()
        redis.stop()


# --- driving the stack -----------------------------------------------------------------------


def post(stack: LocalStack, path: str, doc: dict[str, Any]) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.envoy_port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(doc), headers={"content-type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status, response.getheader("x-admission-outcome") or ""
    finally:
        conn.close()


def chat(stack: LocalStack, model: str = "sim-model") -> tuple[int, str]:
    return post(stack, CHAT, {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})


def sim(stack: LocalStack, path: str, doc: dict[str, Any]) -> None:
    req = urllib.request.Request(f"{stack.engine_base}{path}", data=json.dumps(doc).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as response:
        response.read()


def engine_state(stack: LocalStack) -> dict[str, Any]:
    return json.loads(http_get(f"{stack.admin_url}/debug/engines")[1])["default"]


def wait_state(stack: LocalStack, predicate: Callable[[dict[str, Any]], bool], what: str) -> None:
    wait_until(lambda: predicate(engine_state(stack)), 10.0, what)


def park_round(stack: LocalStack) -> list[tuple[int, str]]:
    """Engine full: four requests park or are turned away, one more parks and is released."""
    sim(stack, "/control/pin", {"running": 4, "waiting": 1})
    wait_state(stack, lambda s: s["gate_open"] is False, "the gate to close")
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, stack) for _ in range(4)]
        replies = [f.result(timeout=30) for f in futures]
    with ThreadPoolExecutor(1) as pool:
        released = pool.submit(chat, stack)
        wait_state(stack, lambda s: s["queue_depth"] == 1, "a request to park")
        sim(stack, "/control/unpin", {})
        replies.append(released.result(timeout=30))
    return replies


def service_sample(stack: LocalStack, name: str) -> float:
    """One sample of the service's /metrics (the first line for `name`, labels included)."""
    for line in http_get(f"{stack.admin_url}/metrics")[1].decode().splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in the service's /metrics")


def prediction_round(stack: LocalStack) -> None:
    """Long generations fill the slots; a request parked once the gate has measured the engine gets
    a predicted wait, and one admitted from the park the error of its prediction.

    Five requests of LONG_TOKENS fill max in-flight (4) and the engine queue slot (1): the engine
    decodes four for ~5 s, its KV growing with no finish, which is what the gate measures its rates
    on. A request that arrives then is parked or, when its predicted wait runs past the 1.5 s park
    cap, answered at once; the ones sent within the cap of the first four ending park and are then
    admitted, which observes admission_wait_prediction_error_seconds.
    """
    errors = 'admission_wait_prediction_error_seconds_count{engine="default",kind="expected"}'
    assert service_sample(stack, errors) == 0
    allowed = {(200, ""), (503, "expected_wait_too_long"), (503, "park_timeout")}
    with ThreadPoolExecutor(7) as pool:
        long = [pool.submit(post, stack, CHAT, {"model": "sim-model", "max_tokens": LONG_TOKENS,
                                                "messages": [{"role": "user", "content": "Hello"}]})
                for _ in range(5)]
        wait_until(lambda: math.isfinite(service_sample(stack, "admission_engine_throughput_bound_tokens_per_second")),
                   10.0, "the gate to measure the engine's throughput")
        # Two short requests in flight, sent at different polls: when the four running long ones end
        # together, one of them is parked even if the other has just timed out (with one at a time,
        # the moment between a park timeout and the next send could miss it).
        shorts: list[Future[tuple[int, str]]] = []

        def one_admitted_from_the_park() -> bool:
            assert not all(f.done() for f in long), "the long requests ended before one parked"
            for f in [f for f in shorts if f.done()]:
                shorts.remove(f)
                assert f.result() in allowed, f.result()
            if len(shorts) < 2:  # the queue depth: a third would be turned away queue_full
                shorts.append(pool.submit(chat, stack))
            return service_sample(stack, errors) > 0

        wait_until(one_admitted_from_the_park, 15.0, "a request parked with a prediction to be admitted", interval=0.2)
        assert all(f.result(timeout=30) in allowed for f in shorts)
        assert [f.result(timeout=30)[0] for f in long] == [200] * 5


def drive(stack: LocalStack) -> None:
    prediction_round(stack)
    for _ in range(3):
        assert chat(stack)[0] == 200
    assert chat(stack, model="no-such-model")[0] == 404
    assert http_get(f"{stack.url}/v1/models")[0] == 200  # not gated: passthrough
    # A short engine metrics outage: polls fail, the state goes stale, one request fails open.
    sim(stack, "/control/metrics_mode", {"mode": "fail"})
    wait_state(stack, lambda s: s["state"] == "stale", "the engine state to go stale")
    assert chat(stack)[0] == 200
    sim(stack, "/control/metrics_mode", {"mode": "ok"})
    wait_state(stack, lambda s: s["state"] == "fresh", "the engine state to be fresh")
    # Two rounds of parking, a scrape apart, so that rates and park-time quantiles are defined.
    # Which 503 each of the four gets (queue_full, park_timeout, expected_wait_too_long) is the
    # gate's business; here it matters that some park and time out and that all are turned away.
    for _ in range(2):
        replies = park_round(stack)
        assert [status for status, _ in replies] == [503, 503, 503, 503, 200], replies
        assert ("503", "park_timeout") in {(str(s), o) for s, o in replies}, replies
        time.sleep(2.5)
        for _ in range(3):
            assert chat(stack)[0] == 200


def wait_for(prometheus: Prometheus, expr: str, what: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    return wait_until(lambda: finite(prometheus.query(expr)), timeout, what, interval=0.5)


# --- the test --------------------------------------------------------------------------------


def test_every_dashboard_query_has_data_and_the_alerts_fire_on_a_live_stack(
        observed: tuple[LocalStack, Prometheus, RedisServer]) -> None:
    stack, prometheus, redis = observed
    wait_for(prometheus, 'up{job="llm-admission"} == 1', "the first scrape of the service")
    wait_for(prometheus, 'up{job="vllm"} == 1', "the first scrape of the simulator")
    drive(stack)
    time.sleep(2.5)  # two more scrapes after the last request

    # Every query of every panel, with the variables at "All" and $__rate_interval at 1m.
    missing: list[str] = []
    deadline = time.monotonic() + 20
    while True:
        missing = [f"{title} [{ref}]: {concrete(expr)}" for title, ref, expr in targets()
                   if KUBELET_ONLY not in expr and not finite(prometheus.query(concrete(expr)))]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, "queries without data:\n" + "\n".join(missing)

    # The template variables' label_values() queries find their labels.
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query" and KUBELET_ONLY not in variable["query"]:
            metric, label = variable["query"].removeprefix("label_values(").removesuffix(")").split(", ")
            assert any(label in s["metric"] for s in prometheus.query(metric)), variable["query"]

    # The gateway and vLLM agree once the engine is idle (the two lines of the side-by-side panels).
    running = wait_for(prometheus,
                       'sum({__name__=~"vllm[:_]num_requests_running"}) == 0 and on() sum(vllm_requests_running) == 0',
                       "both views of running to read 0")
    assert running

    rules = {r["alert"]: r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}

    # An engine running more than the configured max in-flight (4): the drift alert's expression
    # turns true (an engine with a larger --max-num-seqs than the gate's limit).
    assert prometheus.query(rules["LLMAdmissionEngineLimitDrift"]) == []
    sim(stack, "/control/pin", {"running": 6, "waiting": 0})
    drift = wait_for(prometheus, rules["LLMAdmissionEngineLimitDrift"], "the limit-drift alert expression")
    assert [(s["metric"]["engine"], s["value"][1]) for s in drift] == [("default", "2")]
    sim(stack, "/control/unpin", {})
    wait_state(stack, lambda s: s["state"] == "fresh" and s["gate_open"], "the gate to open again")

    # Stop Redis: the next decision cannot reach the shared ledger, the replica decides alone
    # (the request is still served) and the ledger-degraded alert's expression turns true.
    assert prometheus.query(rules["LLMAdmissionLedgerDegraded"]) == []
    redis.stop()
    assert chat(stack)[0] == 200
    ledger = wait_for(prometheus, rules["LLMAdmissionLedgerDegraded"], "the ledger-degraded alert expression")
    assert ([(s["metric"]["engine"], s["metric"]["job"], s["value"][1]) for s in ledger]
            == [("default", "llm-admission", "1")])

    # Break the engine's metrics: the degraded alert's expression turns true, and Prometheus
    # evaluates the rule to pending (for: 1m) on its own.
    assert prometheus.query(rules["LLMAdmissionObserverDegraded"]) == []
    sim(stack, "/control/metrics_mode", {"mode": "garbage"})
    degraded = wait_for(prometheus, rules["LLMAdmissionObserverDegraded"], "the observer-degraded alert expression")
    assert ([(s["metric"]["engine"], s["metric"]["job"], s["value"][1]) for s in degraded]
            == [("default", "llm-admission", "1")])
    wait_until(lambda: any(a["labels"]["alertname"] == "LLMAdmissionObserverDegraded"
                           and a["state"] in ("pending", "firing")
                           for a in prometheus.api("alerts")["alerts"]), 20.0, "the degraded alert to be pending")
    wait_for(prometheus, rules["LLMAdmissionEngineStateStale"], "the stale alert expression")

    # Stop the service: its scrape fails and the service-down expression turns true.
    assert prometheus.query(rules["LLMAdmissionServiceDown"]) == []
    assert stack.extproc is not None
    stack.extproc.stop()
    down = wait_for(prometheus, rules["LLMAdmissionServiceDown"], "the service-down alert expression")
    assert [s["metric"]["job"] for s in down] == ["llm-admission"]
