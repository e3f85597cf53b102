"""The model list follows each engine's /v1/models: a name loaded at runtime is gated, not refused.

The engine here is a minimal HTTP server answering /v1/models the way vLLM does, with a list the
test changes (as loading a LoRA adapter does); the registry under test is the real one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from devstack import free_port
from extproc.config import load_settings
from extproc.models import MISS_REFRESH_INTERVAL_SECONDS, ModelRegistry


async def _engine(served: list[str], reads: list[float]) -> tuple[web.AppRunner, int]:
    async def models(_: web.Request) -> web.Response:
        reads.append(time.monotonic())
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in served]})

    return await _serve_models(models)


async def _serve_models(models: Callable[[web.Request], Awaitable[web.Response]]) -> tuple[web.AppRunner, int]:
    """A minimal engine answering /v1/models with `models`, on a free loopback port."""
    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def _until(check, timeout: float = 5.0):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met before the deadline")


def test_a_name_the_engine_starts_serving_is_gated_on_it_and_unknown_names_are_read_sparingly() -> None:
    async def scenario() -> None:
        served, reads = ["base"], []
        runner, port = await _engine(served, reads)
        settings = load_settings({"ENGINE_URL": f"http://127.0.0.1:{port}", "ADMISSION_OBSERVE_MODELS": "configured",
                                  "ADMISSION_MODELS_REFRESH_SECONDS": "3600"})
        registry = ModelRegistry(settings)
        try:
            await registry.start()
            assert registry.engine_for("base") is settings.engines[0]  # served, not configured: gated
            assert registry.engine_for("configured") is settings.engines[0]  # configured, not served: gated
            assert await registry.lookup("lora-1") is None

            started, before = time.monotonic(), len(reads)
            for i in range(50):  # a client spraying unknown names
                assert await registry.lookup(f"nope-{i}") is None
            elapsed = time.monotonic() - started
            assert len(reads) - before <= 1 + elapsed / MISS_REFRESH_INTERVAL_SECONDS

            served.append("lora-1")  # loaded at runtime, long before the periodic refresh
            engine = await _until(lambda: registry.lookup("lora-1"))
            assert engine is settings.engines[0]
            assert registry.served() == {"default": ["base", "lora-1"]}

            served.remove("base")  # unloaded: no longer known (the configured name stays)
            await _until(lambda: _not_known(registry, "base"))
            assert registry.engine_for("configured") is settings.engines[0]
        finally:
            await registry.stop()
            await runner.cleanup()

    asyncio.run(scenario())


async def _not_known(registry: ModelRegistry, model: str) -> bool:
    await registry.lookup("trigger-a-read")
    return registry.engine_for(model) is None


def test_an_engine_that_cannot_list_its_models_keeps_the_previous_list() -> None:
    async def scenario() -> None:
        settings = load_settings({"ENGINE_URL": f"http://127.0.0.1:{free_port()}", "ADMISSION_OBSERVE_MODELS": "m",
                                  "ENGINE_POLL_INTERVAL_SECONDS": "0.5"})
        registry = ModelRegistry(settings)
        try:
            await registry.start()  # nothing listens: the read fails, the configured list stands
            assert registry.known() == ["m"]
            assert await registry.lookup("other") is None
        finally:
            await registry.stop()

    asyncio.run(scenario())


def test_each_models_max_model_len_is_read_from_the_engines_list() -> None:
    async def scenario() -> None:
        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [
                {"id": "base", "object": "model", "max_model_len": 16384},
                {"id": "lora-1", "object": "model", "max_model_len": 4096},
                {"id": "no-limit", "object": "model"},  # an engine that does not say
                {"id": "odd", "object": "model", "max_model_len": "big"},  # nor this one, usably
            ]})

        runner, port = await _serve_models(models)
        settings = load_settings({"ENGINE_URL": f"http://127.0.0.1:{port}", "ADMISSION_OBSERVE_MODELS": "base"})
        registry = ModelRegistry(settings)
        try:
            await registry.start()
            assert [registry.max_model_len(m) for m in ("base", "lora-1", "no-limit", "odd", "unknown")] == [
                16384, 4096, None, None, None]
        finally:
            await registry.stop()
            await runner.cleanup()

    asyncio.run(scenario())
