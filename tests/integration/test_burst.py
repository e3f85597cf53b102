"""A burst far beyond what the service can answer in time never becomes a bypass.

3,000 concurrent requests against an engine that is already full: some ext_proc streams fail
under the burst (a gRPC error; none outlasts Envoy's 15 s message timeout), and Envoy fails those open.
The engine cluster's circuit breaker is the backstop: the engine never holds more requests than
the gate itself admits (max in-flight + engine queue slots), every client gets an answer, and
the ledger and the park are empty afterwards. The simulator's own timeline is the witness.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from .conftest import Stack
from .http import chat_body, get

pytestmark = pytest.mark.integration

BURST = 3_000
BOUND = 5  # ADMISSION_MAX_INFLIGHT 4 + one engine queue slot (the KV budget's default)


async def _one(port: int, body: bytes) -> tuple[int, str]:
    """One raw HTTP/1.1 POST; returns (status, x-admission-outcome or '')."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n"
            b"content-type: application/json\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
    return int(head[0].split()[1]), fields.get("x-admission-outcome", "")


async def _burst(port: int, n: int) -> list[tuple[int, str]]:
    body = chat_body("hi", max_tokens=2)
    return await asyncio.wait_for(asyncio.gather(*(_one(port, body) for _ in range(n))), 240)


def _breaker_refusals(stack: Stack) -> int:
    """Envoy's own count of requests the engine cluster's circuit breaker refused."""
    return stack.envoy_stat("^cluster\\.engine_default\\.upstream_rq_active_overflow$")


def _peak_held(stack: Stack) -> int:
    return max(held for _, held, _ in stack.sim("/control/timeline")["timeline"])


def test_a_burst_against_a_full_engine_never_exceeds_the_gates_bound_at_the_engine(make_stack) -> None:  # noqa: ANN001
    # A short park cap: the parked ones are answered while the engine is still held.
    stack = make_stack({"EXTPROC_LOG_LEVEL": "WARNING", "ADMISSION_MAX_PARK_SECONDS": "3"})
    stack.sim("/control/hold", {"hold": True})  # nothing finishes: the engine stays full

    async def fill_then_burst() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        body = chat_body("fill", max_tokens=2)
        fill = [asyncio.create_task(_one(stack.local.envoy_port, body)) for _ in range(BOUND)]
        while len(stack.arrivals()) < BOUND:  # the gate admitted them and the engine holds them
            await asyncio.sleep(0.02)
        burst = await _burst(stack.local.envoy_port, BURST)
        stack.sim("/control/hold", {"hold": False})
        return await asyncio.gather(*fill), burst

    fill, burst = asyncio.run(fill_then_burst())

    assert [status for status, _ in fill] == [200] * BOUND
    assert _peak_held(stack) <= BOUND  # not one request beyond the gate's bound reached the engine
    answers = Counter(burst)
    assert sum(answers.values()) == BURST  # every client got an answer
    assert {status for status, _ in answers} <= {200, 503}
    refused = {outcome for status, outcome in answers if status == 503}
    assert refused <= {"queue_full", "park_timeout", "expected_wait_too_long", "engine_overloaded"}
    assert _breaker_refusals(stack) == answers[(503, "engine_overloaded")]
    # Nothing leaked: the park and the ledger are empty once the engine drained.
    stack.wait_state(lambda s: s["queue_depth"] == 0 and s["inflight"] == 0, "park and ledger empty", timeout=30)
    assert get(f"{stack.url}/v1/models").status == 200
    print(f"burst of {BURST}: {dict(answers)}; peak held by the engine {_peak_held(stack)}")


def test_ungated_paths_are_not_starved_by_a_full_gated_cluster(make_stack) -> None:  # noqa: ANN001
    stack = make_stack()
    stack.sim("/control/hold", {"hold": True})

    async def fill() -> list[asyncio.Task[tuple[int, str]]]:
        body = chat_body("fill", max_tokens=2)
        tasks = [asyncio.create_task(_one(stack.local.envoy_port, body)) for _ in range(BOUND)]
        while len(stack.arrivals()) < BOUND:
            await asyncio.sleep(0.02)
        # The gated cluster is at its bound: health checks and model listings still go through.
        for _ in range(3):
            assert (await asyncio.to_thread(get, f"{stack.url}/v1/models")).status == 200
            assert (await asyncio.to_thread(get, f"{stack.url}/health")).status == 200
        stack.sim("/control/hold", {"hold": False})
        return tasks

    async def main() -> list[tuple[int, str]]:
        return list(await asyncio.gather(*await fill()))

    assert [status for status, _ in asyncio.run(main())] == [200] * BOUND
