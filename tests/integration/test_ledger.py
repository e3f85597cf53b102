"""The shared ledger on a real redis-server: N replicas decide as one gate would.

- Property: random interleavings of arrivals (on any of three replicas), finishes, scrapes,
  clock ticks and expiries, run once on a single in-memory gate and once through three
  `RedisLedger`s sharing one Redis: every ticket gets the same decisions, and the shared state
  never reserves more KV than the engine has nor holds more than max in-flight (+ queue slots).
- A completion on replica A releases a request parked on replica B through pub/sub, not a poll.
- A replica that dies without finishing: its lease expires and its capacity returns.
- Redis stopped and restarted: the replica decides alone (degraded), then puts its open
  requests back into the shared state.
- Redis flushed (or restored to an older state) on a live connection: every replica finds the
  state it knew gone, counts and logs it, and puts its own requests back, so the gate decides
  the parked ones again.
- A ledger that lost a parked request without a trace: the replica still answers it park_timeout
  at its cap, by its own deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client import CollectorRegistry

from devstack import RedisServer
from extproc.admission import Admission, gate_limits
from extproc.config import load_settings
from extproc.gate import Decision, EngineGate, EngineSnapshot, GateLimits, Ticket, TicketState
from extproc.ledger import LedgerMetrics, RedisLedger
from extproc.metrics import Metrics
from extproc.outcomes import Outcome

from ..unit.limits import limits

CAPACITY = 4_096
LIMITS = limits(max_inflight=3, kv_threshold=0.95, max_queue_depth=4, max_park_seconds=10.0,
                    kv_budget=True, engine_queue_slots=1, backfill=True)
REPLICAS = 3


def _require_redis() -> None:
    if shutil.which("redis-server"):
        return
    message = "redis-server not found (Debian: apt-get install redis-server; make test installs it)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {message}")
    pytest.skip(message)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    _require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


_prefixes = itertools.count()


def _ledger(url: str, prefix: str, replica: str, clock, lease: float = 1_000.0,  # noqa: ANN001
            registry: CollectorRegistry | None = None, limits: GateLimits = LIMITS) -> RedisLedger:
    return RedisLedger({"e": limits}, url, LedgerMetrics(registry or CollectorRegistry()), lease_seconds=lease,
                       timeout=2.0, prefix=prefix, replica=replica, clock=clock)


# --- property: N replicas decide as one gate -------------------------------------------------

EVENT = st.one_of(
    st.tuples(st.just("arrive"), st.tuples(st.integers(0, REPLICAS - 1), st.integers(1, 2_000))),
    st.tuples(st.just("arrive"), st.tuples(st.integers(0, REPLICAS - 1), st.integers(1, 600))),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("scrape"), st.integers(0, REPLICAS - 1)),
    st.tuples(st.just("tick"), st.sampled_from([0.1, 0.6, 3.0, 11.0])),
)


@settings(max_examples=int(os.environ.get("LEDGER_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(EVENT, min_size=5, max_size=40))
def test_replicas_sharing_redis_decide_exactly_as_one_gate(redis_server: RedisServer, events: list) -> None:
    asyncio.run(_replay(redis_server.url, f"prop{next(_prefixes)}", events))


async def _replay(url: str, prefix: str, events: list) -> None:
    now = [1_000.0]
    clock = lambda: now[0]  # noqa: E731
    one = EngineGate(LIMITS)
    seen_one: dict[int, list[str]] = {}
    seen_shared: dict[int, list[str]] = {}

    def note(target: dict[int, list[str]], decisions: list[Decision]) -> None:
        for d in decisions:
            target.setdefault(d.ticket.id, []).append(d.outcome.value)

    ledgers = [_ledger(url, prefix, f"r{i}", clock) for i in range(REPLICAS)]
    for ledger in ledgers:
        await ledger.start(lambda engine, decisions: note(seen_shared, decisions), lambda engine: None)
    ids = itertools.count(1)
    owner: dict[int, int] = {}
    try:
        # Both start from the same scrape.
        first = EngineSnapshot(0, 0, 0.0, now[0], CAPACITY, 16)
        note(seen_one, one.observe(first, now[0]))
        note(seen_shared, await ledgers[0].transact("e", lambda g: g.observe(first, now[0])))
        for kind, arg in events:
            if kind == "arrive":
                replica, tokens = arg
                ticket = Ticket(model="m", arrived=now[0], tokens=tokens, id=next(ids), owner=f"r{replica}",
                                lease_until=now[0] + 1_000)
                owner[ticket.id] = replica
                note(seen_one, [one.arrive(replace(ticket), now[0])])
                note(seen_shared,
                     await ledgers[replica].transact("e", lambda g, t=ticket: [g.arrive(replace(t), now[0])]))
            elif kind == "finish":
                live = [t.id for t in (*one.admitted(), *one.queued())]
                if not live:
                    continue
                tid = live[arg % len(live)]
                note(seen_one, one.end(tid, now[0]))
                note(seen_shared, await ledgers[owner[tid]].transact("e", lambda g, tid=tid: g.end(tid, now[0])))
            elif kind == "scrape":
                running = len(one.admitted())
                used = sum(t.reserved for t in one.admitted()) * 0.5 / CAPACITY
                snap = EngineSnapshot(min(running, LIMITS.max_inflight), max(0, running - LIMITS.max_inflight),
                                      used, now[0] - 0.05, CAPACITY, 16)
                note(seen_one, one.observe(snap, now[0]))
                note(seen_shared, await ledgers[arg].transact("e", lambda g, s=snap: g.observe(s, now[0])))
            else:
                now[0] += arg
                note(seen_one, one.expire(now[0]))
                note(seen_shared, await ledgers[0].transact("e", lambda g: g.expire(now[0])))
            assert not ledgers[0].degraded
            note(seen_shared, await ledgers[0].transact("e", lambda g: []))  # the latest committed state
            view = ledgers[0].gate("e")
            assert sum(t.reserved for t in view.admitted()) <= CAPACITY
            assert len(view.admitted()) <= LIMITS.max_inflight + LIMITS.engine_queue_slots
            assert {t.id for t in view.admitted()} == {t.id for t in one.admitted()}
            assert [t.id for t in view.queued()] == [t.id for t in one.queued()]
        for ledger in ledgers:  # collect the verdicts each replica has not yet seen
            note(seen_shared, await ledger.transact("e", lambda g: []))
        assert seen_shared == seen_one
        assert not any(ledger.degraded for ledger in ledgers)
    finally:
        for ledger in ledgers:
            await ledger.stop()


# --- the service's Admission on a shared ledger -----------------------------------------------


def _admission(url: str, prefix: str, lease: float = 60.0, inflight: int = 1,
               park: float = 300.0) -> tuple[Admission, CollectorRegistry]:
    settings = load_settings({"ADMISSION_OBSERVE_MODELS": "m", "ADMISSION_MAX_INFLIGHT": str(inflight),
                              "ADMISSION_KV_BUDGET": "false", "ADMISSION_MAX_PARK_SECONDS": str(park)})
    registry = CollectorRegistry()
    ledger = RedisLedger({"default": gate_limits(settings, settings.engines[0])}, url, LedgerMetrics(registry),
                         lease_seconds=lease, timeout=0.5, prefix=prefix)
    import time
    return Admission(settings, Metrics(registry), clock=time.time, ledger=ledger), registry


async def _started(*admissions: Admission) -> None:
    for a in admissions:
        await a.start()
    await admissions[0].observe("default", EngineSnapshot(0, 0, 0.0, admissions[0].now()))


async def test_a_completion_on_one_replica_releases_a_request_parked_on_another(redis_server: RedisServer) -> None:
    prefix = f"wake{next(_prefixes)}"
    a, _ = _admission(redis_server.url, prefix)
    b, _ = _admission(redis_server.url, prefix)
    await _started(a, b)
    try:
        holder = await a.arrive("default", "m")
        assert holder.outcome is Outcome.ADMITTED
        parked = await b.arrive("default", "m")
        assert parked.outcome is Outcome.PARKED
        waiting = asyncio.ensure_future(b.wait("default", parked.ticket))
        await asyncio.sleep(0)
        assert not waiting.done()
        loop = asyncio.get_running_loop()
        finished_at = loop.time()
        await a.finish("default", holder.ticket)
        # B makes no call of its own here (its lease renewal is 20 s away): only A's published
        # commit can wake it.
        decision = await asyncio.wait_for(waiting, 5)
        assert decision.outcome is Outcome.ADMITTED_AFTER_PARK
        print(f"cross-replica wake-up: {(loop.time() - finished_at) * 1000:.1f} ms")
        assert b.inflight == 1 and a.inflight == 0
        await b.finish("default", parked.ticket)
        await a.ledger.transact("default", lambda g: [])  # type: ignore[attr-defined]
        assert a.gate("default").inflight == 0 and a.gate("default").queue_depth == 0
    finally:
        for x in (a, b):
            await x.stop()


async def test_a_dead_replicas_leases_expire_and_its_capacity_returns(redis_server: RedisServer) -> None:
    prefix = f"lease{next(_prefixes)}"
    a, _ = _admission(redis_server.url, prefix, lease=0.6)
    b, registry = _admission(redis_server.url, prefix, lease=0.6)
    await _started(a, b)
    try:
        holder = await a.arrive("default", "m")
        assert holder.outcome is Outcome.ADMITTED
        await a.ledger.stop()  # A dies: no finish, no more renewals
        parked = await b.arrive("default", "m")
        assert parked.outcome is Outcome.PARKED
        decision = await asyncio.wait_for(b.wait("default", parked.ticket), 5)
        assert decision.outcome is Outcome.ADMITTED_AFTER_PARK
        assert registry.get_sample_value("admission_ledger_lease_expiries_total", {"engine": "default"}) == 1
        await b.finish("default", parked.ticket)
    finally:
        await b.stop()


async def test_redis_down_the_replica_decides_alone_then_puts_its_requests_back(tmp_path: Path) -> None:
    _require_redis()
    server = RedisServer(tmp_path / "redis").start()
    prefix = f"down{next(_prefixes)}"
    a, registry = _admission(server.url, prefix, inflight=2)
    b, _ = _admission(server.url, prefix, inflight=2)
    try:
        await _started(a, b)
        first = await a.arrive("default", "m")
        assert first.outcome is Outcome.ADMITTED
        server.stop()
        # Redis is gone: A still answers, from its own ledger, and never fails closed.
        second = await asyncio.wait_for(a.arrive("default", "m"), 5)
        assert second.outcome is Outcome.ADMITTED
        assert registry.get_sample_value("admission_ledger_degraded", {"engine": "default"}) == 1
        assert registry.get_sample_value("admission_ledger_degraded_transitions_total") == 1
        third = await a.arrive("default", "m")
        assert third.outcome is Outcome.PARKED  # its own two requests fill the (soft) limit
        await a.finish("default", second.ticket)
        assert (await asyncio.wait_for(a.wait("default", third.ticket), 5)).outcome is Outcome.ADMITTED_AFTER_PARK
        # Redis comes back empty (no persistence): A registers its two open requests again.
        server.start()

        async def recovered() -> None:
            while registry.get_sample_value("admission_ledger_degraded", {"engine": "default"}) != 0:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(recovered(), 10)
        await b.ledger.transact("default", lambda g: [])  # type: ignore[attr-defined]
        view = b.gate("default")
        assert {t.id for t in view.admitted()} == {first.ticket.id, third.ticket.id}
        assert all(t.state is TicketState.ADMITTED for t in view.admitted())
        # ...so B, which shares the limit of 2, parks.
        assert (await b.arrive("default", "m")).outcome is Outcome.PARKED
    finally:
        for x in (a, b):
            await x.stop()
        server.stop()


# --- a shared state that vanished, went back, or lost a ticket --------------------------------


async def _until(condition, what: str, timeout: float = 10.0) -> None:  # noqa: ANN001
    """Poll `condition()` until it holds; fail naming `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _lost(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("admission_ledger_state_lost_total",
                                     {"engine": "default", "reason": reason}) or 0.0


async def _raw(url: str):  # noqa: ANN202
    import redis.asyncio as redis
    return redis.Redis.from_url(url, decode_responses=True)


@contextlib.asynccontextmanager
async def _two_replicas_on_a_fresh_redis(tmp_path: Path, name: str):  # noqa: ANN202
    """Replicas A and B (and their registries) on a Redis of their own, started with one idle
    scrape, and a raw client to break the store with; all stopped after."""
    _require_redis()
    server = RedisServer(tmp_path / "redis").start()
    prefix = f"{name}{next(_prefixes)}"
    a, reg_a = _admission(server.url, prefix)
    b, reg_b = _admission(server.url, prefix)
    raw = await _raw(server.url)
    try:
        await _started(a, b)
        yield a, reg_a, b, reg_b, raw
    finally:
        await raw.aclose()
        for x in (a, b):
            await x.stop()
        server.stop()


async def test_a_flushed_ledger_is_found_and_rebuilt_from_each_replicas_own_tickets(tmp_path: Path) -> None:
    async with _two_replicas_on_a_fresh_redis(tmp_path, "flush") as (a, reg_a, b, reg_b, raw):
        holder = await a.arrive("default", "m")
        assert holder.outcome is Outcome.ADMITTED
        parked = []
        for x in (a, b, a, b):
            decision = await x.arrive("default", "m")
            assert decision.outcome is Outcome.PARKED
            parked.append((x, decision.ticket))
        waits = [asyncio.ensure_future(x.wait("default", t)) for x, t in parked]
        assert await raw.flushall()
        # A's next decision (any event; here a no-op) finds the state gone and puts its tickets
        # back; B learns of the new state from A's published commit and puts back its own.
        await a.ledger.transact("default", lambda g: [])  # type: ignore[attr-defined]
        await _until(lambda: len(b.gate("default").queued()) == 4, "B's view to hold every parked request")
        await _until(lambda: sum(_lost(reg_b, r) for r in ("vanished", "recreated", "regressed")) == 1,
                     "B to count the state it knew lost")
        assert _lost(reg_a, "vanished") == 1
        for x in (a, b):
            await x.ledger.transact("default", lambda g: [])  # type: ignore[attr-defined]
            view = x.gate("default")
            assert [t.id for t in view.admitted()] == [holder.ticket.id]
            assert [t.id for t in view.queued()] == [t.id for _, t in parked]  # FIFO kept across replicas
            assert view.snapshot is not None  # the lost scrape came back with the tickets
        assert not any(w.done() for w in waits)
        # The gate decides them again: the holder's completion admits the head, nothing else.
        await a.finish("default", holder.ticket)
        first = await asyncio.wait_for(waits[0], 5)
        assert first.outcome is Outcome.ADMITTED_AFTER_PARK
        assert not any(w.done() for w in waits[1:])
        await a.finish("default", parked[0][1])
        for (x, t), w in zip(parked[1:], waits[1:], strict=True):
            assert (await asyncio.wait_for(w, 5)).outcome is Outcome.ADMITTED_AFTER_PARK
            await x.finish("default", t)
        await a.ledger.transact("default", lambda g: [])  # type: ignore[attr-defined]
        assert a.gate("default").inflight == 0 and a.gate("default").queue_depth == 0


async def test_a_ledger_restored_to_an_older_version_is_found_and_rebuilt(redis_server: RedisServer) -> None:
    prefix = f"regress{next(_prefixes)}"
    a, registry = _admission(redis_server.url, prefix)
    raw = await _raw(redis_server.url)
    key = f"{{{prefix}:default}}:state"
    try:
        await _started(a)
        holder = await a.arrive("default", "m")
        older = await raw.hgetall(key)  # a snapshot of the state: the holder admitted, nobody parked
        parked = await a.arrive("default", "m")
        assert parked.outcome is Outcome.PARKED
        await raw.hset(key, mapping=older)  # restored from that snapshot: the parked request is gone
        await a.ledger.transact("default", lambda g: [])  # type: ignore[attr-defined]
        view = a.gate("default")
        assert [t.id for t in view.admitted()] == [holder.ticket.id]
        assert [t.id for t in view.queued()] == [parked.ticket.id]
        assert _lost(registry, "regressed") == 1
        await a.finish("default", holder.ticket)
        assert (await asyncio.wait_for(a.wait("default", parked.ticket), 5)).outcome is Outcome.ADMITTED_AFTER_PARK
        await a.finish("default", parked.ticket)
    finally:
        await raw.aclose()
        await a.stop()


async def test_a_parked_request_the_ledger_lost_without_a_trace_is_answered_at_its_cap(
        redis_server: RedisServer) -> None:
    prefix = f"cap{next(_prefixes)}"
    a, _ = _admission(redis_server.url, prefix, park=1.0)
    b, registry = _admission(redis_server.url, prefix, park=1.0)
    raw = await _raw(redis_server.url)
    key = f"{{{prefix}:default}}:state"
    try:
        await _started(a, b)
        holder = await a.arrive("default", "m")
        assert holder.outcome is Outcome.ADMITTED
        parked = await b.arrive("default", "m")
        assert parked.outcome is Outcome.PARKED
        # The state loses B's ticket in a newer version of the same lifetime: nothing shows it.
        version, state = await raw.hmget(key, "v", "state")
        doc = json.loads(state)
        doc["q"] = []
        await raw.hset(key, mapping={"v": str(int(version) + 1), "state": json.dumps(doc)})
        decision = await asyncio.wait_for(b.wait("default", parked.ticket), 10)
        assert decision.outcome is Outcome.PARK_TIMEOUT
        assert decision.retry_after is not None
        assert registry.get_sample_value("admission_park_deadline_local_total", {"engine": "default"}) == 1
        assert registry.get_sample_value("admission_rejected_total",
                                         {"engine": "default", "model": "m", "reason": "park_timeout"}) == 1
        await b.ledger.transact("default", lambda g: [])  # type: ignore[attr-defined]
        assert b.gate("default").queue_depth == 0
        await a.finish("default", holder.ticket)
    finally:
        await raw.aclose()
        for x in (a, b):
            await x.stop()


async def test_the_first_replica_to_rebuild_keeps_the_others_requests_in_place(tmp_path: Path) -> None:
    # A admitted the holder after the last scrape; B holds a parked request. After a flush B happens
    # to rebuild first: it must not see an empty engine (the scrape does not show the holder, and A
    # has not put it back yet) and admit into the full one.
    async with _two_replicas_on_a_fresh_redis(tmp_path, "first") as (a, _, b, reg_b, raw):
        holder = await a.arrive("default", "m")
        assert holder.outcome is Outcome.ADMITTED
        parked = await b.arrive("default", "m")
        assert parked.outcome is Outcome.PARKED
        wait = asyncio.ensure_future(b.wait("default", parked.ticket))
        await _until(lambda: len(b.gate("default").admitted()) == 1, "B's view to hold A's holder")
        assert await raw.flushall()
        await b.ledger.transact("default", lambda g: [])  # type: ignore[attr-defined]
        assert _lost(reg_b, "vanished") == 1  # B rebuilt first
        view = b.gate("default")
        assert [t.id for t in view.admitted()] == [holder.ticket.id]  # A's request held its place
        assert [t.id for t in view.queued()] == [parked.ticket.id]
        assert not wait.done()
        await a.ledger.transact("default", lambda g: [])  # type: ignore[attr-defined]  # A puts its own back
        await a.finish("default", holder.ticket)
        assert (await asyncio.wait_for(wait, 5)).outcome is Outcome.ADMITTED_AFTER_PARK
        await b.finish("default", parked.ticket)
