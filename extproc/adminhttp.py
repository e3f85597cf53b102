"""The operator-facing HTTP endpoints: /metrics, /healthz, /readyz, /debug/engines, and the live
status page (`/`, its static files under /static/, and the JSON it polls, /debug/status).

The status page is read-only and shows no prompt content: per engine, the gauges of the last good
poll and their age, capacity and reservations, each parked request's age and estimated size, the
recent decisions, and charts of the last minutes. The charts' history is sampled here once a
second (`StatusHistory`), so a page opened now already shows what happened before. Everything the
page needs is served from the package (`extproc/static/`): no build step, no external CDN.

/readyz is deliberately NOT tied to engine health: an engine metrics outage makes admission
fail open, it must not take the gateway out of the Service (that would turn a metrics outage
into an inference outage). It reports ready once the gRPC server is serving and until shutdown
begins.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from . import __version__
from .admission import Admission, PollHealth
from .config import EngineConfig, Settings, redact_url
from .gate import EngineGate, EngineState
from .metrics import Metrics
from .outcomes import Outcome

#: How often the status page's history is sampled, and how much of it is kept.
HISTORY_INTERVAL_SECONDS = 1.0
HISTORY_SECONDS = 600
#: The static files the status page is made of (extproc/static/), with their content types.
STATIC_FILES = {"index.html": "text/html", "status.js": "text/javascript", "status.css": "text/css"}

#: The completion rate the page shows is measured over this many seconds up to now, so it falls
#: to 0 this long after the last completion (Retry-After keeps its own, event-to-event rate).
COMPLETION_RATE_WINDOW_SECONDS = 10.0

#: What each poll failure reason means, as the status page names it.
POLL_FAILURES: dict[str, str] = {
    "unreachable": "engine unreachable",
    "timeout": "engine metrics not answering within the poll timeout",
    "http_status": "engine metrics endpoint answers an error",
    "unparsable": "engine metrics unparsable (observer degraded)",
}

#: What each outcome means, for the status page's list of recent decisions.
OUTCOME_REASONS: dict[str, str] = {
    Outcome.ADMITTED: "room on arrival",
    Outcome.ADMITTED_AFTER_PARK: "waited, then room freed",
    Outcome.ADMITTED_FAIL_OPEN: "engine state unknown or stale: admitted unchecked",
    Outcome.PARKED: "no room: waiting in the park",
    Outcome.QUEUE_FULL: "the park was full",
    Outcome.PARK_TIMEOUT: "parked for the whole park cap",
    Outcome.EXPECTED_WAIT_TOO_LONG: "expected wait beyond the park cap",
    Outcome.EXCEEDS_KV_CAPACITY: "needs more KV than the engine has",
    Outcome.CONTEXT_LENGTH_EXCEEDED: "longer than the model's max_model_len",
    Outcome.SHUTTING_DOWN: "the service was stopping",
    Outcome.CLIENT_GONE: "the client left while parked",
}


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def _counter_total(counter: Counter, engine: str) -> float:
    """Sum of a counter's `_total` samples for one engine."""
    return sum(s.value for family in counter.collect() for s in family.samples
               if s.name.endswith("_total") and s.labels.get("engine") == engine)


class StatusHistory:
    """The last HISTORY_SECONDS of each engine's load, KV, queue and decision rates, one sample a second."""

    def __init__(self, settings: Settings, metrics: Metrics, admission: Admission) -> None:
        self._engines = [e.name for e in settings.engines]
        self._metrics = metrics
        self._admission = admission
        size = int(HISTORY_SECONDS / HISTORY_INTERVAL_SECONDS)
        self._samples: dict[str, deque[dict[str, Any]]] = {e: deque(maxlen=size) for e in self._engines}
        self._totals: dict[str, tuple[float, float, float]] = {}  # engine: (time, admitted, rejected)
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> None:
        now = time.time()
        for name in self._engines:
            gate = self._admission.gate(name)
            snap = gate.snapshot
            admitted = _counter_total(self._metrics.admitted, name)
            rejected = _counter_total(self._metrics.rejected, name)
            before = self._totals.get(name)
            self._totals[name] = (now, admitted, rejected)
            span = now - before[0] if before else 0.0
            self._samples[name].append({
                "t": round(now, 3),
                "load": gate.effective_load(),
                "kv_usage": None if snap is None else snap.kv_usage,
                "queue": gate.queue_depth,
                "inflight": gate.inflight,
                "admitted_per_s": round((admitted - before[1]) / span, 3) if before and span > 0 else None,
                "rejected_per_s": round((rejected - before[2]) / span, 3) if before and span > 0 else None,
            })

    def samples(self, engine: str) -> list[dict[str, Any]]:
        return list(self._samples[engine])

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(HISTORY_INTERVAL_SECONDS)

    async def start(self, _: web.Application) -> None:
        self._task = asyncio.create_task(self._run(), name="status-history")

    async def stop(self, _: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def _secs(value: float) -> str:
    return f"{value:.1f} s" if value < 120 else f"{int(value // 60)} min {round(value % 60)} s"


def engine_health(gated: bool, state: EngineState, polls: PollHealth, stale_after: int,
                  last_good_age: float | None) -> dict[str, Any]:
    """Whether the engine's metrics can be read, and what the gate does about it, in words.

    `status`: ok, failing (polls fail, the last good state still stands), degraded (the same with
    unparsable documents), never_read (no poll finished yet), unreachable (no good poll ever), stale
    (past the threshold after a good poll). `level`: ok, warn or bad; `fail_open`: the gate admits
    everything unchecked (state unknown or stale), which the page must never show as an open gate.
    """
    fail_open = gated and state is not EngineState.FRESH
    reason, failed = polls.reason, polls.failed_in_row
    why = POLL_FAILURES.get(reason or "", f"engine metrics not read ({reason})")
    detail = polls.detail if len(polls.detail) <= 200 else polls.detail[:199] + "…"
    cause = f"{why}: {detail}" if detail else why
    off = "; admission OFF: failing open" if fail_open else ""
    degraded = reason == "unparsable"
    if not gated:
        status, level, headline = "not_polled", "none", "not gated: its metrics are not polled"
    elif last_good_age is None and failed == 0:
        status, level, headline = "never_read", "bad" if fail_open else "warn", f"engine metrics not read yet{off}"
    elif last_good_age is None:
        status = "degraded" if degraded else "unreachable"
        level, headline = "bad", f"{status.upper()}: never read, {failed} failed polls ({cause}){off}"
    elif fail_open:
        status = "degraded" if degraded else "stale"
        level = "bad"
        headline = (f"{status.upper()}: {failed} polls failed in a row ({cause}), stale after {stale_after}; "
                    f"last good poll {_secs(last_good_age)} ago{off}")
    elif failed:
        status, level = ("degraded" if degraded else "failing"), "warn"
        headline = (f"{status.upper()}: {failed} of {stale_after} polls failed in a row ({cause}); "
                    f"the gate still decides on the last good poll, {_secs(last_good_age)} ago")
    else:
        status, level, headline = "ok", "ok", "engine metrics read"
    return {"status": status, "level": level, "fail_open": fail_open, "headline": headline, "reason": reason,
            "detail": detail, "failed_polls": failed, "stale_after_polls": stale_after,
            "last_good_age_s": None if last_good_age is None else round(last_good_age, 3)}


def engine_status(engine: EngineConfig, gate: EngineGate, admission: Admission, settings: Settings) -> dict[str, Any]:
    """One engine as the status page shows it: views of the gate and its recent decisions only."""
    now = admission.now()
    snap = gate.snapshot
    limits = gate.limits
    budgeting = limits.kv_budget and limits.local_accounting
    queue = []
    for position, ticket in enumerate(gate.queued(), start=1):
        queue.append({
            "position": position, "model": ticket.model, "age_s": round(max(0.0, now - ticket.arrived), 3),
            "tokens": ticket.tokens, "cost_tokens": gate.cost(ticket),
            "expires_in_s": None if ticket.park_deadline is None else round(ticket.park_deadline - now, 3),
        })
    recent = [{
        "age_s": round(max(0.0, now - d.at), 3), "model": d.model, "outcome": d.outcome,
        "reason": OUTCOME_REASONS.get(d.outcome, d.outcome), "tokens": d.tokens,
        "waited_s": round(d.waited, 3), "retry_after": d.retry_after,
    } for d in reversed(admission.recent(engine.name))]
    last_good_age = None if snap is None else max(0.0, now - snap.scrape_started)
    return {
        "name": engine.name,
        "url": redact_url(engine.url),
        "metrics_url": redact_url(engine.metrics_url),
        "models": list(engine.models),
        "gated": bool(engine.models),
        "state": gate.state.value,
        "health": engine_health(bool(engine.models), gate.state, admission.poll_health(engine.name),
                                limits.stale_after_polls, last_good_age),
        "gate_open": gate.is_open(),
        "snapshot": None if snap is None else {
            "running": snap.running, "waiting": snap.waiting, "kv_usage": snap.kv_usage,
            "capacity_tokens": snap.capacity_tokens, "block_size": snap.block_size,
            "age_s": round(max(0.0, now - snap.scrape_started), 3),
        },
        "limits": {
            "max_inflight": limits.max_inflight,
            "engine_queue_slots": limits.engine_queue_slots if budgeting else 0,
            "kv_threshold": limits.kv_threshold, "max_queue_depth": limits.max_queue_depth,
            "max_park_seconds": limits.max_park_seconds, "kv_budget": budgeting,
            "poll_interval_s": settings.poll_interval, "stale_after_polls": limits.stale_after_polls,
        },
        "effective_load": gate.effective_load(),
        "inflight": gate.inflight,
        "queue_depth": gate.queue_depth,
        "capacity_tokens": gate.capacity_tokens,
        "reserved_tokens": gate.reserved_tokens,
        "available_tokens": gate.available_tokens(),
        "policy": gate.policy,
        "projected_load_tokens": gate.projected_load(now),  # others + projected peak (projected policy)
        "prefix_hit_rate": round(gate.prefix_hit_rate, 4),
        "completion_rate_per_s": _finite(gate.completion_rate_until(now, COMPLETION_RATE_WINDOW_SECONDS)),
        "completion_rate_window_s": COMPLETION_RATE_WINDOW_SECONDS,
        "queue": queue,
        "recent": recent,
    }


def make_app(settings: Settings, metrics: Metrics, admission: Admission, ready: Callable[[], bool],
             dialect: Callable[[str], str | None] = lambda _engine: None) -> web.Application:
    """`dialect(engine)`: the metrics dialect it is read with (None: not detected yet)."""

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
                "url": redact_url(engine.url),
                "state": gate.state.value,
                "health": engine_health(bool(engine.models), gate.state, admission.poll_health(engine.name),
                                        gate.limits.stale_after_polls,
                                        None if snap is None else max(0.0, admission.now() - snap.scrape_started)),
                "models": list(engine.models),
                "dialect": dialect(engine.name),
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

    history = StatusHistory(settings, metrics, admission)
    started = time.time()

    async def status(_: web.Request) -> web.Response:
        doc = {
            "version": __version__, "now": time.time(), "uptime_s": round(time.time() - started, 3),
            "ready": ready(), "history_interval_s": HISTORY_INTERVAL_SECONDS,
            "engines": [
                {**engine_status(e, admission.gate(e.name), admission, settings), "dialect": dialect(e.name),
                 "history": history.samples(e.name)}
                for e in settings.engines
            ],
        }
        return web.json_response(doc, headers={"Cache-Control": "no-store"})

    async def page(_: web.Request) -> web.Response:
        return _static("index.html")

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC_FILES:
            raise web.HTTPNotFound()
        return _static(name)

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/debug/engines", engines)
    app.router.add_get("/debug/status", status)
    app.router.add_get("/", page)
    app.router.add_get("/static/{name}", static)
    app.on_startup.append(history.start)
    app.on_cleanup.append(history.stop)
    return app


def _static(name: str) -> web.Response:
    body = resources.files("extproc").joinpath("static", name).read_bytes()
    return web.Response(body=body, content_type=STATIC_FILES[name], charset="utf-8",
                        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                                 "Content-Security-Policy": "default-src 'self'; img-src 'self' data:"})
