"""The asyncio side of admission: futures for parked requests, a timer, metrics; the gates' state
lives in a ledger (`extproc/ledger.py`): this process's memory, or Redis shared by replicas.

Every event (arrival, finish, scrape, expiry, shutdown) is one ledger transaction running one
pure gate method; this class turns the decisions about its own requests into resolved futures,
keeps one timer for the earliest park deadline, and updates the metrics.

The park cap never depends on the ledger: each parked request's deadline is also kept here, and
if the expiry the timer runs through the ledger has not decided one of this replica's overdue
requests within `LOCAL_EXPIRY_GRACE_SECONDS` (a shared state that lost it, a ledger that does not
answer), this replica answers it `park_timeout` itself and drops its ticket from the ledger. So a
parked client always gets the service's answer before Envoy's own deadline (the cap plus
`PARK_TIMEOUT_MARGIN_SECONDS`) fails it open. All methods run on the
event loop thread. With the local ledger no transaction waits, so every event takes effect
before its caller resumes, as if the gate were called directly.

A decision about one of this replica's parked requests can come from its own transaction or,
with a shared ledger, from another replica's (a completion there released it): both arrive in
`_apply`, which resolves the request's future exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import Gauge

from .config import EngineConfig, Settings
from .gate import Decision, EngineGate, EngineSnapshot, EngineState, GateLimits, Ticket
from .ledger import Ledger, LocalLedger
from .metrics import Metrics
from .outcomes import Outcome

log = logging.getLogger("extproc.admission")


#: Decisions kept per engine for the status page and /debug/engines.
RECENT_DECISIONS = 50
#: How long past a parked request's cap the ledger's expiry may take before this replica answers
#: the request itself; well inside PARK_TIMEOUT_MARGIN_SECONDS, after which Envoy fails it open.
LOCAL_EXPIRY_GRACE_SECONDS = 1.0


@dataclass(frozen=True)
class RecentDecision:
    """One decision as an operator sees it: no prompt content, only its size and fate."""

    at: float  # the admission clock
    model: str
    outcome: str
    tokens: int  # the request's estimated KV need
    waited: float  # seconds from arrival to this decision
    retry_after: int | None


@dataclass(frozen=True)
class PollHealth:
    """How this replica's polls of one engine's metrics have gone lately, for the status page."""

    failed_in_row: int = 0  # polls failed since the last good one (the gate's count, seen here)
    reason: str | None = None  # the last failure's reason: unreachable, timeout, http_status, unparsable
    detail: str = ""  # the last failure's detail (the error, the parse problem)


@dataclass
class _Engine:
    config: EngineConfig
    timer: asyncio.TimerHandle | None = None
    timer_for: float | None = None  # the park deadline the timer is armed for
    recent: deque[RecentDecision] = field(default_factory=lambda: deque(maxlen=RECENT_DECISIONS))
    parked: set[int] = field(default_factory=set)  # ids of our parked tickets not yet decided
    # Our parked tickets, for their park_deadline; in arrival order, which with one park cap per
    # engine is deadline order (the gate's queue relies on the same), so the first is the earliest.
    deadlines: dict[int, Ticket] = field(default_factory=dict)
    waiters: dict[int, asyncio.Future[Decision]] = field(default_factory=dict)  # until `wait` collects them
    open: dict[int, Ticket] = field(default_factory=dict)  # ours admitted (counted), stream open, by id
    polls: PollHealth = field(default_factory=PollHealth)


def gate_limits(settings: Settings, engine: EngineConfig) -> GateLimits:
    """The gate's limits for one engine, from the validated settings."""
    return GateLimits(
        max_inflight=engine.limits.max_inflight,
        kv_threshold=engine.limits.kv_threshold,
        max_queue_depth=engine.limits.max_queue_depth,
        max_park_seconds=engine.limits.max_park_seconds,
        stale_after_polls=settings.stale_after_polls,
        local_accounting=settings.local_accounting,
        scrape_grace_seconds=settings.scrape_grace_seconds,
        engine_done_after_seconds=settings.engine_done_after_seconds,
        kv_budget=settings.kv_budget,
        kv_capacity_override=engine.limits.kv_capacity_tokens,
        backfill=settings.backfill,
        retry_after_seconds=settings.retry_after_seconds,
        engine_queue_slots=settings.engine_queue_slots,
        wait_estimates=settings.wait_estimates,
        generation_reservation=settings.generation_reservation,
        generation_factor=settings.generation_factor,
        wait_prediction=settings.wait_prediction,
        policy=settings.policy,
        projection_quantile=settings.projection_quantile,
        preemption_max_cost_seconds=settings.preemption_max_cost_seconds,
    )


class Admission:
    def __init__(self, settings: Settings, metrics: Metrics, clock: Callable[[], float] | None = None,
                 ledger: Ledger | None = None) -> None:
        self._metrics = metrics
        self._clock = clock
        self._prediction = settings.wait_prediction  # the metrics' `kind` label
        self._budgeted = settings.kv_budget and settings.local_accounting  # admissions a policy decides
        self._ledger: Ledger = ledger or LocalLedger({e.name: gate_limits(settings, e) for e in settings.engines})
        self._engines: dict[str, _Engine] = {}
        self._closing = False
        self._idle: asyncio.Event | None = None  # set when the last admitted request ends (wait_idle)
        self._retry_after = settings.retry_after_seconds
        self._pending: set[asyncio.Task[None]] = set()  # ledger events started by sync callers
        for engine in settings.engines:
            self._engines[engine.name] = _Engine(engine)
            self._bind_gauges(metrics, engine.name)

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    async def start(self) -> None:
        """Connect the ledger (a shared one reads the current state and follows it)."""
        await self._ledger.start(self._apply, self._changed)

    async def stop(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        await self._ledger.stop()

    def now(self) -> float:
        return self._clock() if self._clock else asyncio.get_running_loop().time()

    def gate(self, engine: str) -> EngineGate:
        """The engine's gate as this replica last saw it (a view: decide through the ledger)."""
        return self._ledger.gate(engine)

    def poll_health(self, engine: str) -> PollHealth:
        """How this replica's polls of the engine's metrics have gone lately."""
        return self._engines[engine].polls

    def recent(self, engine: str) -> tuple[RecentDecision, ...]:
        """The engine's last decisions, oldest first (PARKED included)."""
        return tuple(self._engines[engine].recent)

    # --- request side ---------------------------------------------------------------------

    async def arrive(self, engine: str, model: str, tokens: int = 0, generation: int = 0,
                     requests: int = 1) -> Decision:
        """Register a gated request (`tokens` its KV estimate, `generation` the part of it that is its
        generation limit, `requests` the engine requests it becomes); PARKED decisions are followed
        up through `wait`."""
        now = self.now()
        ticket = Ticket(model=model, arrived=now, tokens=tokens, generation=generation, requests=requests,
                        owner=self._ledger.replica, lease_until=self._ledger.lease_until(now))
        entry = self._engines[engine]
        if self._closing:
            decision = Decision(ticket, Outcome.SHUTTING_DOWN, self._retry_after)
            self._record(engine, decision, parked=False)
            return decision
        if not self._ledger.shared:  # the event runs at once: nothing can decide the ticket meanwhile
            decisions = await self._ledger.transact(engine, lambda g: [g.arrive(ticket, now)])
            decision = decisions[0]
        else:
            # Registered before the decision: another replica may release the ticket before this
            # coroutine resumes. The event may run more than once (conflicts): each on a copy.
            self._register(entry, ticket.id)
            try:
                decisions = await self._ledger.transact(engine, lambda g: [g.arrive(replace(ticket), now)])
            except BaseException:
                entry.parked.discard(ticket.id)
                entry.waiters.pop(ticket.id, None)
                entry.deadlines.pop(ticket.id, None)
                raise
            decision = next(d for d in decisions if d.ticket.id == ticket.id)
        if decision.outcome is Outcome.PARKED:
            if ticket.id not in entry.waiters:
                self._register(entry, ticket.id)
            if ticket.id in entry.parked:  # not already decided by another replica meanwhile
                entry.deadlines[ticket.id] = decision.ticket
            self._metrics.parked.labels(engine, model).inc()
            if decision.predicted_wait is not None:  # finite: a parked request's prediction is within the cap
                self._metrics.child(self._metrics.predicted_wait, engine, self._prediction).observe(
                    decision.predicted_wait)
            entry.recent.append(RecentDecision(now, model, Outcome.PARKED.value, tokens, 0.0, None))
        else:
            entry.parked.discard(ticket.id)
            entry.waiters.pop(ticket.id, None)
            self._record(engine, decision, parked=False)
            if decision.outcome.admits and decision.ticket.counted:
                entry.open[ticket.id] = decision.ticket
        self._apply(engine, [d for d in decisions if d is not decision])
        return decision

    @staticmethod
    def _register(entry: _Engine, ticket_id: int) -> None:
        entry.waiters[ticket_id] = asyncio.get_running_loop().create_future()
        entry.parked.add(ticket_id)

    async def wait(self, engine: str, ticket: Ticket) -> Decision:
        """Wait for a parked ticket's outcome. Cancellation means the client went away.

        The ticket's future stays registered from `arrive` until it is decided, so a decision
        made before `wait` is called, e.g. a completion that admits the ticket while the park
        response is still being written, is returned, not lost.
        """
        waiters = self._engines[engine].waiters
        future = waiters.get(ticket.id)
        if future is None:
            raise KeyError(f"ticket {ticket.id} was not parked")
        try:
            decision = await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                await self._end(engine, ticket)
            # If it was admitted in the same instant, the caller's `finish` frees the slot.
            raise
        waiters.pop(ticket.id, None)
        return decision

    async def finish(self, engine: str, ticket: Ticket) -> None:
        """The request's ext_proc stream ended, in whatever state its ticket is.

        Admitted: the HTTP stream is over (completed, failed or client gone), so its slot and KV
        are freed. Still parked (the stream failed before or while parking, e.g. the client left
        while the park response was written): it leaves the queue as `client_gone`. Runs to the
        end even if the caller is cancelled meanwhile.
        """
        if self._ledger.shared:
            await asyncio.shield(self._spawn(self._end(engine, ticket)))
        else:
            await self._end(engine, ticket)

    async def _end(self, engine: str, ticket: Ticket) -> None:
        entry = self._engines[engine]
        entry.waiters.pop(ticket.id, None)
        was_parked = ticket.id in entry.parked
        entry.parked.discard(ticket.id)
        entry.deadlines.pop(ticket.id, None)
        was_open = entry.open.pop(ticket.id, None) is not None
        if not was_parked and not was_open:
            return  # never entered the gate, or already ended
        now = self.now()
        decisions = await self._ledger.transact(engine, lambda g: g.end(ticket.id, now))
        for d in decisions:
            if d.ticket.id == ticket.id and d.outcome is Outcome.CLIENT_GONE:
                self._record(engine, d, parked=True)
        self._apply(engine, [d for d in decisions if d.ticket.id != ticket.id])
        if self._idle is not None and self.inflight == 0:
            self._idle.set()

    # --- engine side ----------------------------------------------------------------------

    async def observe(self, engine: str, snapshot: EngineSnapshot) -> None:
        was_stale = self.gate(engine).state is EngineState.STALE
        now = self.now()
        done_before = self.gate(engine).engine_done()
        self._apply(engine, await self._ledger.transact(engine, lambda g: g.observe(snapshot, now)))
        done = self.gate(engine).engine_done()
        if done > done_before:
            log.info("the engine finished requests whose streams are still open: their slots are free",
                     extra={"engine": engine, "engine_requests": done})
        self._engines[engine].polls = PollHealth()
        if was_stale and self.gate(engine).state is not EngineState.STALE:
            log.info("engine state is fresh again", extra={"engine": engine})

    async def poll_failed(self, engine: str, reason: str = "unknown", detail: str = "") -> None:
        was_stale = self.gate(engine).state is EngineState.STALE
        now = self.now()
        polls = self._engines[engine].polls
        self._engines[engine].polls = replace(polls, failed_in_row=polls.failed_in_row + 1, reason=reason,
                                              detail=detail)
        self._apply(engine, await self._ledger.transact(engine, lambda g: g.poll_failed(now)))
        gate = self.gate(engine)
        if gate.state is EngineState.STALE and not was_stale:
            self._metrics.stale_total.labels(engine).inc()
            log.warning("engine state is stale; admission fails open",
                        extra={"engine": engine, "failed_polls": gate.limits.stale_after_polls})

    async def shutdown(self) -> None:
        """Answer this replica's parked requests (503 + Retry-After) so none waits for a dying service."""
        self._closing = True
        owner = self._ledger.replica if self._ledger.shared else None
        for name in self._engines:
            self._apply(name, await self._ledger.transact(name, lambda g: g.drain(Outcome.SHUTTING_DOWN, owner)))

    @property
    def inflight(self) -> int:
        """Requests this service admitted whose stream is still open, over every engine."""
        return sum(len(entry.open) for entry in self._engines.values())

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no admitted request is open, or `timeout` seconds; whether it got there."""
        if self.inflight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        finally:
            self._idle = None
        return True

    # --- internals ------------------------------------------------------------------------

    def _apply(self, engine: str, decisions: list[Decision]) -> None:
        """Decisions about this replica's parked tickets: record them and resolve their futures."""
        entry = self._engines[engine]
        for decision in decisions:
            if decision.ticket.id not in entry.parked:
                continue  # not ours, or already decided
            entry.parked.discard(decision.ticket.id)
            entry.deadlines.pop(decision.ticket.id, None)
            future = entry.waiters.get(decision.ticket.id)
            if decision.outcome.admits and decision.ticket.counted:
                entry.open[decision.ticket.id] = decision.ticket
            self._record(engine, decision, parked=True)
            if future is not None and not future.done():
                future.set_result(decision)
        self._changed(engine)

    def _changed(self, engine: str) -> None:
        """The engine's state changed (here or, with a shared ledger, on another replica)."""
        self._arm_timer(engine)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    def _on_timer(self, engine: str) -> None:
        self._engines[engine].timer = self._engines[engine].timer_for = None
        self._spawn(self._expire(engine, self.now()))

    async def _expire(self, engine: str, now: float) -> None:
        """Run the gate's expiry through the ledger; then answer whatever of ours it left overdue."""
        async def through_ledger() -> None:
            self._apply(engine, await self._ledger.transact(engine, lambda g: g.expire(now)))

        expiry = self._spawn(through_ledger())
        done, _ = await asyncio.wait({expiry}, timeout=LOCAL_EXPIRY_GRACE_SECONDS)
        if expiry in done and not expiry.cancelled() and expiry.exception() is not None:
            # The deadline below must hold whatever the ledger did.
            log.error("park expiry through the ledger failed", exc_info=expiry.exception(), extra={"engine": engine})
        self._expire_locally(engine, now)

    def _expire_locally(self, engine: str, now: float) -> None:
        """Answer `park_timeout` to our parked requests past their cap that the ledger did not decide,
        and drop their tickets from it."""
        entry = self._engines[engine]
        overdue = []
        for i, t in entry.deadlines.items():
            if t.park_deadline is None or t.park_deadline > now:
                break
            if i in entry.parked:
                overdue.append(t)
        if not overdue:
            return
        self._metrics.child(self._metrics.park_deadline_local, engine).inc(len(overdue))
        log.warning("parked requests answered at their cap by this replica: the ledger did not decide them",
                    extra={"engine": engine, "tickets": len(overdue), "shared": self._ledger.shared})
        self._apply(engine, [Decision(t, Outcome.PARK_TIMEOUT, self._retry_after) for t in overdue])
        ids = [t.id for t in overdue]

        async def drop() -> None:
            decisions = await self._ledger.transact(engine, lambda g: [d for i in ids for d in g.end(i, now)])
            self._apply(engine, decisions)

        self._spawn(drop())

    def _arm_timer(self, engine: str) -> None:
        entry = self._engines[engine]
        deadline = self.gate(engine).next_deadline()
        mine = next(iter(entry.deadlines.values())).park_deadline if entry.deadlines else None
        if mine is not None and (deadline is None or mine < deadline):
            deadline = mine  # ours, even if the ledger's view no longer holds it
        if entry.timer is not None:
            if deadline is not None and entry.timer_for is not None and entry.timer_for <= deadline:
                return
            entry.timer.cancel()
            entry.timer = entry.timer_for = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            # Timers run on the loop clock; translate from the admission clock.
            delay = max(0.0, deadline - self.now())
            entry.timer = loop.call_at(loop.time() + delay, self._on_timer, engine)
            entry.timer_for = deadline

    def _record(self, engine: str, decision: Decision, parked: bool) -> None:
        outcome, ticket = decision.outcome, decision.ticket
        now = self.now()
        self._engines[engine].recent.append(RecentDecision(
            now, ticket.model, outcome.value, ticket.tokens, max(0.0, now - ticket.arrived), decision.retry_after))
        m = self._metrics
        if outcome.admits:
            m.child(m.admitted, engine, ticket.model, outcome.value).inc()
            if outcome is not Outcome.ADMITTED_FAIL_OPEN and self._budgeted:
                m.child(m.policy_admitted, engine, ticket.policy or "strict").inc()
            if ticket.backfilled:
                m.child(m.backfilled, engine, ticket.model).inc()
        else:
            m.child(m.rejected, engine, ticket.model, outcome.value).inc()
        kind = self._prediction
        if (outcome is Outcome.EXPECTED_WAIT_TOO_LONG and decision.predicted_wait is not None
                and math.isfinite(decision.predicted_wait)):  # infinite: the cache shrank below its cost
            m.child(m.predicted_wait, engine, kind).observe(decision.predicted_wait)
        if outcome is Outcome.EXPECTED_WAIT_TOO_LONG and decision.predicted_wait is not None:
            m.child(m.wait_bound_answers, engine, kind).inc()
            log.info("wait prediction", extra={"engine": engine, "ticket": ticket.id, "kind": kind,
                                               "outcome": outcome.value, "tokens": ticket.tokens,
                                               "waited": round(max(0.0, now - ticket.arrived), 3),
                                               "predicted_from_now": round(decision.predicted_wait, 3)})
        if parked:
            waited = max(0.0, now - ticket.arrived)
            m.child(m.park_duration, engine, outcome.value).observe(waited)
            if outcome is Outcome.ADMITTED_AFTER_PARK and ticket.predicted_wait is not None:
                error = waited - ticket.predicted_wait
                m.child(m.wait_prediction_error, engine, kind).observe(error)
                if error < 0 and kind == "bound":
                    m.child(m.wait_bound_violations, engine).inc()
                log.info("wait prediction", extra={"engine": engine, "ticket": ticket.id, "kind": kind,
                                                   "outcome": outcome.value, "tokens": ticket.tokens,
                                                   "waited": round(waited, 3),
                                                   "predicted": round(ticket.predicted_wait, 3)})

    def _bind_gauges(self, metrics: Metrics, engine: str) -> None:
        """The engine-labelled gauges read the gate when scraped, not on every event: an event costs
        nothing here, and a scrape always sees the state as it is (prometheus_client calls each
        function while collecting, on the event loop thread that serves /metrics)."""
        entry = self._engines[engine]

        def gate() -> EngineGate:  # looked up on each read: a shared ledger replaces the gate object
            return self.gate(engine)

        reads: list[tuple[Gauge, Callable[[], float]]] = [
            (metrics.queue_depth, lambda: len(entry.parked)),
            (metrics.inflight, lambda: len(entry.open)),
            (metrics.effective_load, lambda: _nan_if_none(gate().effective_load())),
            (metrics.stale, lambda: 1 if gate().state is EngineState.STALE else 0),
            (metrics.kv_reserved, lambda: sum(t.reserved for t in entry.open.values())),
            (metrics.engine_done, lambda: gate().engine_done()),
            (metrics.kv_available, lambda: _nan_if_none(gate().available_tokens())),
            (metrics.throughput_bound, lambda: _nan_if_none(gate().throughput_bound())),
            (metrics.projected_peak, lambda: _nan_if_none(gate().projected_load(self.now()))),
            (metrics.engine_preemptions, lambda: gate().preempted),
        ]
        for gauge, read in reads:
            gauge.labels(engine).set_function(read)


def _nan_if_none(value: float | None) -> float:
    return float("nan") if value is None else value
