"""The operator-facing HTTP endpoints: /metrics, /healthz, /readyz and /debug/engines.

/readyz is deliberately NOT tied to engine health: an engine metrics outage makes admission
fail open, it must not take the gateway out of the Service (that would turn a metrics outage
into an inference outage). It reports ready once the gRPC server is serving and until shutdown
begins.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .admission import Admission
from .config import Settings
from .metrics import Metrics


def make_app(settings: Settings, metrics: Metrics, admission: Admission, ready: Callable[[], bool]) -> web.Application:
    async def metrics_handler(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")

    async def engines(_: web.Request) -> web.Response:
        doc = {}
        for engine in settings.engines:
            gate = admission.gate(engine.name)
            snap = gate.snapshot
            doc[engine.name] = {
                "state": gate.state.value,
                "models": list(engine.models),
                "queue_depth": gate.queue_depth,
                "inflight": gate.inflight,
                "effective_load": gate.effective_load(),
                "gate_open": gate.is_open(),
                "snapshot": None if snap is None else {
                    "running": snap.running, "waiting": snap.waiting, "kv_usage": snap.kv_usage,
                    "capacity_tokens": snap.capacity_tokens,
                },
                "limits": {
                    "max_inflight": gate.limits.max_inflight, "kv_threshold": gate.limits.kv_threshold,
                    "max_queue_depth": gate.limits.max_queue_depth, "max_park_seconds": gate.limits.max_park_seconds,
                },
            }
        return web.json_response(doc)

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/debug/engines", engines)
    return app
