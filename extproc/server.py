"""Wiring: one process, one event loop, the gRPC ext_proc server and the admin HTTP server.

Start order: metrics → first engine poll (bounded by the poll interval, so a dead engine only
delays startup by one interval) → first read of the engines' served models (same bound) → gRPC
server → admin server (ready). Stop order on SIGTERM: not ready → gRPC health NOT_SERVING →
parked requests answered 503 + Retry-After → the gRPC server keeps taking streams while the
requests it admitted finish (up to the grace period), and answers every newcomer 503
`shutting_down` itself → it stops taking streams and gives what is left the rest of the grace →
observer and admin server stop. gRPC refuses new streams as soon as its server is told to stop,
and Envoy would forward those ungated (fail-open), which is why the server is stopped last; in a
pod, Envoy drains before the service is even signalled (the chart's preStop hooks), and behind a
service that is gone, the engine cluster's circuit breaker still bounds what reaches the engine.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from .adminhttp import make_app
from .admission import Admission, gate_limits
from .config import Settings, TlsFiles
from .ledger import Ledger, LedgerMetrics, RedisLedger
from .metrics import Metrics
from .models import ModelRegistry
from .observer import EngineObserver
from .servicer import ExternalProcessor
from .wire import pb_grpc

log = logging.getLogger("extproc.server")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class Service:
    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics(registry or CollectorRegistry())
        self.metrics.initialise(settings)  # every configured label set at 0 before the first event
        self.admission = Admission(settings, self.metrics, *_ledger(settings, self.metrics))
        self.observer = EngineObserver(settings, self.admission, self.metrics)
        self.models = ModelRegistry(settings)
        self._grpc: grpc.aio.Server | None = None
        self._servicer: ExternalProcessor | None = None
        self._health = health.aio.HealthServicer()
        self._admin: web.AppRunner | None = None
        self._probe: web.AppRunner | None = None
        self._ready = False
        self._grpc_started = False
        self.grpc_port = settings.grpc_port
        self.admin_port = settings.admin_port

    async def start(self) -> None:
        s = self.settings
        if s.gating:
            await self.admission.start()  # a shared ledger: read the state and follow it
            await self.observer.start()
            await self.models.start()  # first read of each engine's /v1/models, then periodic
        self._grpc = grpc.aio.server(
            maximum_concurrent_rpcs=s.max_streams,
            options=[
                ("grpc.max_receive_message_length", s.max_body_bytes + 64 * 1024),
                ("grpc.max_concurrent_streams", s.max_streams),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ],
        )
        self._servicer = ExternalProcessor(s, self.admission, self.metrics, self.models)
        pb_grpc.add_ExternalProcessorServicer_to_server(self._servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        address = f"{_bracket(s.grpc_host)}:{s.grpc_port}"
        try:
            if s.tls is None:
                self.grpc_port = self._grpc.add_insecure_port(address)
            else:
                self.grpc_port = self._grpc.add_secure_port(address, _server_credentials(s.tls))
        except RuntimeError:  # grpc reports a failed bind as RuntimeError, the reason on stderr
            self.grpc_port = 0
        if self.grpc_port == 0:
            raise OSError(f"cannot listen on {s.grpc_host}:{s.grpc_port} (EXTPROC_LISTEN): "
                          "the address is in use or not available")
        await self._grpc.start()
        self._grpc_started = True
        for name in ("", EXT_PROC_SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

        self._admin = web.AppRunner(make_app(s, self.metrics, self.admission, lambda: self._ready,
                                             self.observer.dialect), access_log=None)
        await self._admin.setup()
        site = web.TCPSite(self._admin, s.admin_host, s.admin_port)
        await site.start()
        self.admin_port = self._admin.addresses[0][1]
        if s.probe_host is not None:
            # Probes and scrapes only: /debug/engines (the ledger, every model) stays on the admin listener.
            self._probe = web.AppRunner(_probe_app(self._admin.app), access_log=None)
            await self._probe.setup()
            await web.TCPSite(self._probe, s.probe_host, s.probe_port).start()
        self._ready = True
        if _tls_mode(s) not in ("mtls", "plaintext"):
            log.warning("the ext_proc gRPC port listens beyond loopback without mTLS: any client that reaches it "
                        "can open streams and hold the engine's slots (set EXTPROC_TLS_CERT, EXTPROC_TLS_KEY, "
                        "EXTPROC_TLS_CLIENT_CA, or restrict it with a network policy)",
                        extra={"grpc": f"{s.grpc_host}:{self.grpc_port}"})
        log.info("serving", extra={"grpc": f"{s.grpc_host}:{self.grpc_port}", "grpc_tls": _tls_mode(s),
                                   "admin": f"{s.admin_host}:{self.admin_port}"})

    async def stop(self, grace: float = 10.0) -> None:
        self._ready = False
        await self._health.enter_graceful_shutdown()
        await self.admission.shutdown()
        if self._grpc is not None and self._grpc_started:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            await self.admission.wait_idle(grace)
            await self._grpc.stop(max(0.0, deadline - loop.time()))
        await self.observer.stop()
        await self.models.stop()
        await self.admission.stop()
        if self._servicer is not None:
            await self._servicer.aclose()
        if self._probe is not None:
            await self._probe.cleanup()
        if self._admin is not None:
            await self._admin.cleanup()
        log.info("stopped")


def _ledger(settings: Settings, metrics: Metrics) -> tuple[Callable[[], float] | None, Ledger | None]:
    """The clock and ledger admission runs on: the loop clock and local memory, or the wall clock
    (shared by replicas) and Redis."""
    if settings.ledger != "redis":
        return None, None
    assert settings.redis_url is not None
    limits = {e.name: gate_limits(settings, e) for e in settings.engines}
    ledger = RedisLedger(limits, settings.redis_url, LedgerMetrics(metrics.registry),
                         lease_seconds=settings.ledger_lease_seconds, timeout=settings.ledger_timeout_seconds,
                         prefix=settings.ledger_key_prefix, replica=settings.replica_id)
    return time.time, ledger


PROBE_PATHS = ("/metrics", "/healthz", "/readyz")


def _probe_app(admin: web.Application) -> web.Application:
    """The admin app's GET routes for probes and scrapes, and nothing else."""
    app = web.Application()
    for route in admin.router.routes():
        if route.method == "GET" and route.resource is not None and route.resource.canonical in PROBE_PATHS:
            app.router.add_get(route.resource.canonical, route.handler)
    return app


def _server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """mTLS: the service's certificate, and a client certificate required of every peer, chained to
    the client CA. A peer without one fails the handshake and never opens a stream."""
    with open(tls.cert, "rb") as cert, open(tls.key, "rb") as key, open(tls.client_ca, "rb") as ca:
        return grpc.ssl_server_credentials([(key.read(), cert.read())], root_certificates=ca.read(),
                                           require_client_auth=True)


def _tls_mode(settings: Settings) -> str:
    """How the gRPC port is protected, for the startup log."""
    if settings.tls is not None:
        return "mtls"
    loopback = settings.grpc_host == "localhost" or settings.grpc_host.startswith("127.") or settings.grpc_host == "::1"
    return "plaintext" if loopback else "plaintext, reachable beyond loopback: any client can open streams"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def serve(settings: Settings, grace: float) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully."""
    service = Service(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
    except BaseException:
        await service.stop(0)  # close what did start (the observer's session, the servers)
        raise
    await stop.wait()
    log.info("signal received; draining", extra={"grace_s": grace})
    await service.stop(grace)
