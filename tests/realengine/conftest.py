"""The real vLLM (CPU build, tiny local model) behind the real gateway.

One engine serves the whole session (start-up is 40-100 s on 2 cores): every test leaves it
idle, as it found it. Each test gets its own gateway (Envoy + service) in front of it, since a
gateway is cheap. Outside CI a missing vLLM environment skips these tests with the reason
(`bash scripts/install-vllm.sh` installs it); in CI (CI=true) it fails them, so a broken install
cannot pass by skipping. `make test` installs it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import realengine
from devstack import LocalStack, http_get, wait_until

from ..integration.conftest import Stack, stopped_after

pytestmark = [pytest.mark.integration, pytest.mark.realengine]

#: The service's settings in front of the real engine: polls every 0.5 s so a test waits less.
GATEWAY_ENV = {
    "ADMISSION_OBSERVE_MODELS": realengine.SERVED_NAME,
    "ENGINE_POLL_INTERVAL_SECONDS": "0.5",
    "EXTPROC_LOG_LEVEL": "DEBUG",
}


def _require_engine() -> None:
    reason = realengine.missing()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[realengine.VllmEngine]:
    """The session's engine; REALENGINE_PORT=N uses one already serving the tiny model there
    (`python -m realengine N`), so a developer iterating on these tests starts it once."""
    port = os.environ.get("REALENGINE_PORT")
    if port:
        yield realengine.VllmEngine(tmp_path_factory.mktemp("vllm"), port=int(port))
        return
    _require_engine()
    engine = realengine.VllmEngine(tmp_path_factory.mktemp("vllm"))
    try:
        engine.start()
    except BaseException:
        print(engine.log_tail(80))
        raise
    yield engine
    engine.stop()


class Engine:
    """Reads of the real engine's own metrics: the ground truth a test asserts on."""

    def __init__(self, url: str) -> None:
        self.url = url

    def metrics(self) -> dict[str, float]:
        """Every sample of every `vllm:` family, keyed by name (summed over labels)."""
        status, body = http_get(f"{self.url}/metrics", timeout=10.0)
        assert status == 200
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.name.startswith("vllm:"):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def http_requests(self, handler: str) -> float:
        """Requests the engine's API server answered on `handler`, any status (its own
        `http_requests_total`): whether anything reached the engine at all."""
        status, body = http_get(f"{self.url}/metrics", timeout=10.0)
        assert status == 200
        return sum(sample.value for family in text_string_to_metric_families(body.decode())
                   for sample in family.samples
                   if sample.name == "http_requests_total" and sample.labels.get("handler") == handler)

    def value(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def busy(self) -> int:
        m = self.metrics()
        return int(m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0))

    def wait_idle(self, timeout: float = 120.0) -> None:
        wait_until(lambda: self.busy() == 0, timeout, "the real engine idle")


@pytest.fixture
def engine(vllm: realengine.VllmEngine) -> Iterator[Engine]:
    reads = Engine(vllm.url)
    reads.wait_idle()
    yield reads
    reads.wait_idle()  # leave it as it was found for the next test


@pytest.fixture
def gateway(vllm: realengine.VllmEngine, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Callable[..., Stack]]:
    with stopped_after(request) as started:
        def make(env: dict[str, Any] | None = None) -> Stack:
            local = LocalStack(workdir=tmp_path / f"gateway{len(started)}", engine_url=vllm.url,
                               extproc_env={**GATEWAY_ENV, **(env or {})})
            started.append(local)
            local.start()
            stack = Stack(local)
            stack.wait_state(lambda s: (s.get("snapshot") or {}).get("capacity_tokens") is not None,
                             "the first good poll of the engine", 30)
            return stack

        yield make
