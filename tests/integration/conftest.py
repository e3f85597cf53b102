"""Fixtures that run the real stack: enginesim + extproc + the envoy binary, on free loopback ports."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devstack import LocalStack, http_get, wait_until

# Fast clocks so state changes are visible within a fraction of a second.
FAST = {
    "ENGINE_POLL_INTERVAL_SECONDS": "0.2",
    # Polls every 0.2 s so tests wait less, but a poll may take 2 s: on a loaded machine the
    # simulator's /metrics answers after 0.4 s (the default two intervals) now and then, and a
    # timed-out poll is a failure a test did not ask for (the hang tests still see theirs).
    "ENGINE_POLL_TIMEOUT_SECONDS": "2",
    "ENGINE_STALE_AFTER_POLLS": "3",
    "ADMISSION_OBSERVE_MODELS": "sim-model",
    "EXTPROC_LOG_LEVEL": "DEBUG",
    # These tests size requests in the old estimate's tokens (4 bytes each, nothing else counted);
    # the counted estimate (engine /tokenize, template, learned bytes-per-token) has its own:
    # tests/integration/test_estimate.py.
    "ADMISSION_ESTIMATE": "bytes",
    "ADMISSION_BYTES_PER_TOKEN": "4",
}

pytestmark = pytest.mark.integration


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # noqa: ANN201
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


class Stack:
    """A started LocalStack plus helpers to drive the simulator and read the service's state."""

    def __init__(self, local: LocalStack) -> None:
        self.local = local
        self.url = local.url

    # simulator control
    def sim(self, path: str, body: dict[str, Any] | None = None) -> Any:
        url = f"{self.local.engine_base}{path}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as response:
            return json.loads(response.read())

    def pin(self, **gauges: Any) -> None:
        self.sim("/control/pin", gauges)

    def arrivals(self) -> list[str]:
        return [a["id"] for a in self.sim("/control/arrivals")["arrivals"]]

    # service state
    def engine_state(self, engine: str = "default") -> dict[str, Any]:
        status, body = http_get(f"{self.local.admin_url}/debug/engines")
        assert status == 200
        return json.loads(body)[engine]

    def wait_state(self, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float = 10.0,
                   engine: str = "default") -> dict[str, Any]:
        return wait_until(lambda: (s := self.engine_state(engine)) and predicate(s) and s, timeout, what)

    def wait_gate(self, is_open: bool, timeout: float = 10.0) -> None:
        self.wait_state(lambda s: s["gate_open"] is is_open, f"gate_open={is_open}", timeout)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` on the service's /metrics matching `labels`."""
        status, body = http_get(f"{self.local.admin_url}/metrics")
        assert status == 200
        total = 0.0
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def envoy_stat(self, pattern: str) -> int:
        """Sum of Envoy's own counters/gauges whose full name matches the regex `pattern`."""
        status, body = http_get(f"{self.local.envoy_admin_url}/stats?filter={pattern}")
        assert status == 200
        return sum(int(line.split(":")[1]) for line in body.decode().splitlines() if line.strip())

    def service_log(self) -> str:
        child = self.local.extproc
        return child.log_path.read_text() if child and child.log_path else ""


def two_engine_env(tmp_path: Path, port_a: int, port_b: int, model_b: str) -> dict[str, str]:
    """The service's environment for engines `a` (sim-model on port_a) and `b` (model_b on port_b)."""
    config = tmp_path / "engines.yaml"
    config.write_text(
        "engines:\n"
        f"  - {{name: a, url: 'http://127.0.0.1:{port_a}', models: [sim-model]}}\n"
        f"  - {{name: b, url: 'http://127.0.0.1:{port_b}', models: [{model_b}]}}\n"
    )
    return {"ADMISSION_OBSERVE_MODELS": "", "EXTPROC_CONFIG": str(config)}


@contextlib.contextmanager
def stopped_after(request: pytest.FixtureRequest) -> Iterator[list[LocalStack]]:
    """The stacks a test starts (append them), stopped after it, their logs printed if it failed."""
    started: list[LocalStack] = []
    try:
        yield started
    finally:
        failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
        for local in started:
            if failed:
                print(f"\n===== logs of {local.workdir.name} =====\n{local.logs()}")
            local.stop()


@pytest.fixture
def make_stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Stack]]:
    with stopped_after(request) as started:
        def make(env: dict[str, str] | None = None, sim_args: tuple[str, ...] = (), **kwargs: Any) -> Stack:
            local = LocalStack(
                workdir=tmp_path / f"stack{len(started)}",
                sim_args=sim_args,
                extproc_env={**FAST, **(env or {})},
                **kwargs,
            )
            started.append(local)
            local.start()
            return Stack(local)

        yield make


@pytest.fixture
def stack(make_stack: Callable[..., Stack]) -> Stack:
    return make_stack()
