"""The asyncio side of admission: one EngineGate per engine, futures for parked requests.

The gates decide; this class only turns their decisions into resolved futures, keeps one timer
for the earliest park deadline, and updates the metrics. All methods run on the event loop
thread, so the gates need no locks.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Gauge

from .config import EngineConfig, Settings
from .gate import Decision, EngineGate, EngineSnapshot, EngineState, GateLimits, Ticket, TicketState
from .metrics import Metrics
from .outcomes import Outcome

log = logging.getLogger("extproc.admission")

#: Extra time Envoy waits beyond the park cap, so the 503 at the cap always beats Envoy's timeout.
PARK_TIMEOUT_MARGIN_SECONDS = 5.0


#: Decisions kept per engine for the status page and /debug/engines.
RECENT_DECISIONS = 50


@dataclass(frozen=True)
class RecentDecision:
    """One decision as an operator sees it: no prompt content, only its size and fate."""

    at: float  # the admission clock
    model: str
    outcome: str
    tokens: int  # the request's estimated KV need
    waited: float  # seconds from arrival to this decision
    retry_after: int | None


@dataclass
class _Engine:
    config: EngineConfig
    gate: EngineGate
    gauges: list[tuple[Gauge, Callable[[EngineGate], float]]]  # engine-labelled gauges and their source
    timer: asyncio.TimerHandle | None = None
    recent: deque[RecentDecision] = field(default_factory=lambda: deque(maxlen=RECENT_DECISIONS))


class Admission:
    def __init__(self, settings: Settings, metrics: Metrics, clock: Callable[[], float] | None = None) -> None:
        self._metrics = metrics
        self._clock = clock
        self._waiters: dict[Ticket, asyncio.Future[Decision]] = {}
        self._engines: dict[str, _Engine] = {}
        self._closing = False
        self._idle: asyncio.Event | None = None  # set when the last admitted request ends (wait_idle)
        self._retry_after = settings.retry_after_seconds
        for engine in settings.engines:
            limits = GateLimits(
                max_inflight=engine.limits.max_inflight,
                kv_threshold=engine.limits.kv_threshold,
                max_queue_depth=engine.limits.max_queue_depth,
                max_park_seconds=engine.limits.max_park_seconds,
                stale_after_polls=settings.stale_after_polls,
                local_accounting=settings.local_accounting,
                scrape_grace_seconds=settings.scrape_grace_seconds,
                kv_budget=settings.kv_budget,
                kv_capacity_override=engine.limits.kv_capacity_tokens,
                backfill=settings.backfill,
                retry_after_seconds=settings.retry_after_seconds,
                engine_queue_slots=settings.engine_queue_slots,
                wait_estimates=settings.wait_estimates,
            )
            m, name = metrics, engine.name
            gauges = [
                (m.queue_depth.labels(name), lambda g: g.queue_depth),
                (m.inflight.labels(name), lambda g: g.inflight),
                (m.effective_load.labels(name), lambda g: _nan_if_none(g.effective_load())),
                (m.stale.labels(name), lambda g: 1 if g.state is EngineState.STALE else 0),
                (m.kv_reserved.labels(name), lambda g: g.reserved_tokens),
                (m.kv_available.labels(name), lambda g: _nan_if_none(g.available_tokens())),
            ]
            self._engines[name] = _Engine(engine, EngineGate(limits), gauges)
            self._publish(name)

    def now(self) -> float:
        return self._clock() if self._clock else asyncio.get_running_loop().time()

    def gate(self, engine: str) -> EngineGate:
        return self._engines[engine].gate

    def recent(self, engine: str) -> tuple[RecentDecision, ...]:
        """The engine's last decisions, oldest first (PARKED included)."""
        return tuple(self._engines[engine].recent)

    # --- request side ---------------------------------------------------------------------

    def arrive(self, engine: str, model: str, tokens: int = 0) -> Decision:
        """Register a gated request; PARKED decisions are followed up through `wait`."""
        now = self.now()
        ticket = Ticket(model=model, arrived=now, tokens=tokens)
        if self._closing:
            decision = Decision(ticket, Outcome.SHUTTING_DOWN, self._retry_after)
        else:
            decision = self._engines[engine].gate.arrive(ticket, now)
        if decision.outcome is Outcome.PARKED:
            self._waiters[decision.ticket] = asyncio.get_running_loop().create_future()
            self._metrics.parked.labels(engine, model).inc()
            self._engines[engine].recent.append(RecentDecision(now, model, Outcome.PARKED.value, tokens, 0.0, None))
            self._arm_timer(engine)
        else:
            self._record(engine, decision, parked=False)
        self._publish(engine)
        return decision

    async def wait(self, engine: str, ticket: Ticket) -> Decision:
        """Wait for a parked ticket's outcome. Cancellation means the client went away.

        The ticket's future stays registered from `arrive` until `wait` has returned its decision
        (or `finish` ran), so a decision made before `wait` is called, e.g. a completion that
        admits the ticket while the park response is still being written, is returned, not lost.
        """
        future = self._waiters[ticket]
        try:
            decision = await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                self._abandon(engine, ticket)
            # If it was admitted in the same instant, the caller's `finish` frees the slot.
            raise
        self._waiters.pop(ticket, None)
        return decision

    def finish(self, engine: str, ticket: Ticket) -> None:
        """The request's ext_proc stream ended, in whatever state its ticket is.

        Admitted: the HTTP stream is over (completed, failed or client gone), so its slot and KV
        are freed. Still parked (the stream failed before or while parking, e.g. the client left
        while the park response was written): it leaves the queue as `client_gone`.
        """
        self._waiters.pop(ticket, None)
        if ticket.state is TicketState.PARKED:
            self._abandon(engine, ticket)
            return
        self._apply(engine, self._engines[engine].gate.finish(ticket, self.now()))
        if self._idle is not None and self.inflight == 0:
            self._idle.set()

    # --- engine side ----------------------------------------------------------------------

    def observe(self, engine: str, snapshot: EngineSnapshot) -> None:
        gate = self._engines[engine].gate
        was_stale = gate.state is EngineState.STALE
        decisions = gate.observe(snapshot, self.now())
        if was_stale:
            log.info("engine state is fresh again", extra={"engine": engine})
        self._apply(engine, decisions)

    def poll_failed(self, engine: str) -> None:
        gate = self._engines[engine].gate
        was_stale = gate.state is EngineState.STALE
        decisions = gate.poll_failed(self.now())
        if gate.state is EngineState.STALE and not was_stale:
            self._metrics.stale_total.labels(engine).inc()
            log.warning("engine state is stale; admission fails open",
                        extra={"engine": engine, "failed_polls": gate.limits.stale_after_polls})
        self._apply(engine, decisions)

    def shutdown(self) -> None:
        """Answer every parked request (503 + Retry-After) so none waits for a dying service."""
        self._closing = True
        for name, engine in self._engines.items():
            self._apply(name, engine.gate.drain(Outcome.SHUTTING_DOWN))

    @property
    def inflight(self) -> int:
        """Requests this service admitted whose stream is still open, over every engine."""
        return sum(entry.gate.inflight for entry in self._engines.values())

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no admitted request is open, or `timeout` seconds; whether it got there."""
        if self.inflight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        finally:
            self._idle = None
        return True

    # --- internals ------------------------------------------------------------------------

    def _apply(self, engine: str, decisions: list[Decision]) -> None:
        for decision in decisions:
            # The future stays in `_waiters` until `wait` collects it (or `finish` drops it).
            future = self._waiters.get(decision.ticket)
            self._record(engine, decision, parked=True)
            if future is not None and not future.done():
                future.set_result(decision)
        self._arm_timer(engine)
        self._publish(engine)

    def _abandon(self, engine: str, ticket: Ticket) -> None:
        self._waiters.pop(ticket, None)
        decision = self._engines[engine].gate.abandon(ticket, self.now())
        if decision is not None:
            self._record(engine, decision, parked=True)
        self._arm_timer(engine)
        self._publish(engine)

    def _on_timer(self, engine: str) -> None:
        self._engines[engine].timer = None
        self._apply(engine, self._engines[engine].gate.expire(self.now()))

    def _arm_timer(self, engine: str) -> None:
        entry = self._engines[engine]
        deadline = entry.gate.next_deadline()
        if entry.timer is not None:
            if deadline is not None and entry.timer.when() <= deadline:
                return
            entry.timer.cancel()
            entry.timer = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            # Timers run on the loop clock; translate if an injected clock is in use.
            delay = max(0.0, deadline - self.now())
            entry.timer = loop.call_at(loop.time() + delay, self._on_timer, engine)

    def _record(self, engine: str, decision: Decision, parked: bool) -> None:
        outcome, ticket = decision.outcome, decision.ticket
        now = self.now()
        self._engines[engine].recent.append(RecentDecision(
            now, ticket.model, outcome.value, ticket.tokens, max(0.0, now - ticket.arrived), decision.retry_after))
        if outcome.admits:
            self._metrics.admitted.labels(engine, ticket.model, outcome.value).inc()
            if ticket.backfilled:
                self._metrics.backfilled.labels(engine, ticket.model).inc()
        else:
            self._metrics.rejected.labels(engine, ticket.model, outcome.value).inc()
        if parked:
            waited = max(0.0, self.now() - ticket.arrived)
            self._metrics.park_duration.labels(engine, outcome.value).observe(waited)

    def _publish(self, engine: str) -> None:
        entry = self._engines[engine]
        for gauge, read in entry.gauges:
            gauge.set(read(entry.gate))


def _nan_if_none(value: float | None) -> float:
    return float("nan") if value is None else value
