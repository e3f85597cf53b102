"""Fixtures: an in-process simulator on a loopback port, and polling helpers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from enginesim.config import SimConfig
from enginesim.scheduler import CostModel, SchedulerConfig
from enginesim.server import create_app

FAST = CostModel(step_overhead_s=0.001, per_prefill_token_s=0.00001, per_decode_seq_s=0.001)


def sim_config(**overrides: Any) -> SimConfig:
    sched = overrides.pop("scheduler", None) or SchedulerConfig(
        num_gpu_blocks=512, block_size=16, max_num_seqs=4, max_num_batched_tokens=2048,
        max_model_len=4096, cost=FAST)
    return SimConfig(port=0, scheduler=sched, **overrides)


async def poll(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Wait until ``predicate()`` is true, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(0.005)


class Sim:
    """A running simulator and an HTTP client bound to it."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    @property
    def base_url(self) -> str:
        return str(self.client.make_url("/")).rstrip("/")

    async def state(self) -> dict[str, Any]:
        async with self.client.get("/control/state") as resp:
            assert resp.status == 200
            return await resp.json()

    async def control(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.client.post(f"/control/{path}", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def metrics_text(self) -> str:
        async with self.client.get("/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


@pytest.fixture
async def make_sim() -> AsyncIterator[Callable[..., Awaitable[Sim]]]:
    clients: list[TestClient] = []

    async def start(**overrides: Any) -> Sim:
        app = create_app(sim_config(**overrides))
        client = TestClient(TestServer(app, host="127.0.0.1", handler_cancellation=True))
        await client.start_server()
        clients.append(client)
        return Sim(client)

    yield start
    for client in clients:
        await client.close()


@pytest.fixture
async def sim(make_sim: Callable[..., Awaitable[Sim]]) -> Sim:
    return await make_sim()
