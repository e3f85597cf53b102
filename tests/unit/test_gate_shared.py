"""The pure gate's side of the shared ledger: its state survives serialisation, and the lease and
ownership operations do what the ledger relies on (no Redis here; tests/integration/test_ledger.py
runs the same against a real redis-server)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace

from hypothesis import given, settings, strategies as st

from extproc.gate import EngineGate, EngineSnapshot, GateLimits, Ticket, TicketState
from extproc.outcomes import Outcome

from .limits import limits

LIMITS = limits(max_inflight=3, kv_threshold=0.95, max_queue_depth=4, max_park_seconds=10.0,
                    kv_budget=True, engine_queue_slots=1)
CAPACITY = 4_096


def _snap(now: float, running: int = 0, kv: float = 0.0) -> EngineSnapshot:
    return EngineSnapshot(running, 0, kv, now, CAPACITY, 16)


def _ticket(now: float, owner: str = "a", tokens: int = 100, lease: float | None = None, requests: int = 1) -> Ticket:
    return Ticket(model="m", arrived=now, tokens=tokens, owner=owner, lease_until=lease, requests=requests)


EVENT = st.one_of(
    st.tuples(st.just("arrive"), st.integers(1, 2_000)),
    st.tuples(st.just("finish"), st.integers(0, 20)),
    st.tuples(st.just("scrape"), st.integers(0, 4)),
    st.tuples(st.just("tick"), st.sampled_from([0.1, 0.7, 4.0, 11.0])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(EVENT, max_size=40))
def test_a_gate_rebuilt_from_its_serialised_state_decides_exactly_like_the_original(events: list) -> None:
    _rebuilt_decides_like_the_original(LIMITS, events)


def _projected_snap(now: float, running: int = 0, kv: float = 0.0) -> EngineSnapshot:
    """A scrape with the counters the projected policy learns from, growing with time."""
    n = float(int(now * 10))
    buckets = ((10.0, n), (100.0, 2 * n), (1000.0, 3 * n), (math.inf, 3 * n))
    return EngineSnapshot(running, 0, kv, now, CAPACITY, 16, n * 100, n * 50, 3 * n * 60, 3 * n, buckets,
                          n * 30, n * 100, n)


@settings(max_examples=200, deadline=None)
@given(st.lists(EVENT, max_size=40))
def test_a_projected_gate_rebuilt_from_its_serialised_state_decides_exactly_like_the_original(events: list) -> None:
    _rebuilt_decides_like_the_original(replace(LIMITS, policy="projected", preemption_max_cost_seconds=3600.0),
                                       events, _projected_snap)


def _rebuilt_decides_like_the_original(limits: GateLimits, events: list,
                                       snap: Callable[..., EngineSnapshot] = _snap) -> None:
    now = 100.0
    kept = EngineGate(limits)
    kept.observe(snap(now), now)
    state = json.dumps(kept.to_state())
    for kind, arg in events:
        rebuilt = EngineGate.from_state(limits, json.loads(state))
        pair = (kept, rebuilt)
        if kind == "arrive":
            ticket = _ticket(now, tokens=arg, requests=1 + arg % 3)  # n > 1 too
            out = [[g.arrive(replace(ticket), now)] for g in pair]
        elif kind == "finish":
            live = [t.id for t in (*kept.admitted(), *kept.queued())]
            if not live:
                continue
            tid = live[arg % len(live)]
            out = [g.end(tid, now) for g in pair]
        elif kind == "scrape":
            out = [g.observe(snap(now - 0.05, running=arg, kv=arg / 10), now) for g in pair]
        else:
            now += arg
            out = [g.expire(now) for g in pair]
        assert [(d.ticket.id, d.outcome, d.retry_after) for d in out[0]] == \
               [(d.ticket.id, d.outcome, d.retry_after) for d in out[1]]
        assert kept.to_state() == rebuilt.to_state()
        state = json.dumps(kept.to_state())


def test_an_expired_lease_drops_the_ticket_without_counting_it_finished_and_releases_the_queue() -> None:
    gate = EngineGate(replace(LIMITS, max_inflight=1, engine_queue_slots=0))
    gate.observe(_snap(0.0), 0.0)
    dead = gate.arrive(_ticket(1.0, owner="dead", lease=5.0), 1.0)
    waiting = gate.arrive(_ticket(2.0, owner="alive", lease=50.0), 2.0)
    assert (dead.outcome, waiting.outcome) == (Outcome.ADMITTED, Outcome.PARKED)
    assert gate.purge_expired(4.0) == ([], [])
    dropped, released = gate.purge_expired(6.0)
    assert [t.id for t in dropped] == [dead.ticket.id]
    assert [(d.ticket.id, d.outcome) for d in released] == [(waiting.ticket.id, Outcome.ADMITTED_AFTER_PARK)]
    assert gate.completion_rate() is None  # not a completion: no wait estimate learns from it


def test_renew_extends_only_the_owners_tickets() -> None:
    gate = EngineGate(LIMITS)
    gate.observe(_snap(0.0), 0.0)
    mine = gate.arrive(_ticket(1.0, owner="a", lease=5.0), 1.0).ticket
    theirs = gate.arrive(_ticket(1.0, owner="b", lease=5.0), 1.0).ticket
    gate.renew("a", 20.0)
    assert (mine.lease_until, theirs.lease_until) == (20.0, 5.0)


def test_a_replica_alone_keeps_only_its_tickets_and_puts_them_back_in_arrival_order() -> None:
    shared = EngineGate(replace(LIMITS, max_inflight=1, engine_queue_slots=0))
    shared.observe(_snap(0.0), 0.0)
    a_running = shared.arrive(_ticket(1.0, owner="a"), 1.0).ticket
    b_parked = shared.arrive(_ticket(2.0, owner="b"), 2.0).ticket
    a_parked = shared.arrive(_ticket(3.0, owner="a"), 3.0).ticket
    alone = EngineGate.from_state(shared.limits, shared.to_state())
    alone.keep_only("a")
    assert [t.id for t in alone.admitted()] == [a_running.id]
    assert [t.id for t in alone.queued()] == [a_parked.id]
    # Alone, A finished its running request and admitted its parked one; then it rejoins.
    alone.end(a_running.id, 4.0)
    assert [t.id for t in alone.admitted()] == [a_parked.id]
    shared.replace_owner("a", [Ticket.from_state(t.to_state()) for t in (*alone.admitted(), *alone.queued())])
    assert [t.id for t in shared.admitted()] == [a_parked.id]
    assert [t.id for t in shared.queued()] == [b_parked.id]


def test_shutdown_drains_only_its_own_parked_requests() -> None:
    gate = EngineGate(replace(LIMITS, max_inflight=1, engine_queue_slots=0))
    gate.observe(_snap(0.0), 0.0)
    gate.arrive(_ticket(1.0, owner="a"), 1.0)
    mine = gate.arrive(_ticket(2.0, owner="a"), 2.0).ticket
    theirs = gate.arrive(_ticket(3.0, owner="b"), 3.0).ticket
    drained = gate.drain(Outcome.SHUTTING_DOWN, owner="a")
    assert [d.ticket.id for d in drained] == [mine.id]
    assert [t.id for t in gate.queued()] == [theirs.id]


def test_a_snapshot_older_than_the_one_held_is_ignored() -> None:
    gate = EngineGate(LIMITS)
    gate.observe(_snap(10.0, running=1), 10.0)
    gate.poll_failed(10.5)
    gate.observe(_snap(9.0, running=3), 11.0)  # another replica's scrape, committed late
    assert gate.snapshot is not None and gate.snapshot.running == 1
    assert gate.to_state()["fp"] == 0  # but it does say the engine answers


def test_end_covers_a_parked_an_admitted_and_an_unknown_ticket() -> None:
    gate = EngineGate(replace(LIMITS, max_inflight=1, engine_queue_slots=0))
    gate.observe(_snap(0.0), 0.0)
    running = gate.arrive(_ticket(1.0), 1.0).ticket
    parked = gate.arrive(_ticket(2.0), 2.0).ticket
    assert [(d.ticket.id, d.outcome) for d in gate.end(parked.id, 3.0)] == [(parked.id, Outcome.CLIENT_GONE)]
    assert gate.end(running.id, 4.0) == [] and gate.inflight == 0
    assert gate.end(12345, 5.0) == []
    assert gate.find(running.id) is None and running.state is TicketState.DONE
