"""The pure admission core: every rule of DESIGN.md "Admission semantics", without sockets."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from extproc.gate import EngineGate, EngineSnapshot, EngineState, GateLimits, Ticket, TicketState
from extproc.outcomes import Outcome

from .limits import COUNT_ONLY, limits

LIMITS = limits(max_inflight=4, kv_threshold=0.9, max_queue_depth=3, max_park_seconds=10.0,
                stale_after_polls=3, local_accounting=True, scrape_grace_seconds=0.5, **COUNT_ONLY)


def snap(running: int = 0, waiting: int = 0, kv: float = 0.0, at: float = 0.0) -> EngineSnapshot:
    return EngineSnapshot(running=running, waiting=waiting, kv_usage=kv, scrape_started=at)


def gate_with(limits: GateLimits = LIMITS, **snapshot: float) -> EngineGate:
    gate = EngineGate(limits)
    gate.observe(snap(**snapshot), now=snapshot.get("at", 0.0))  # type: ignore[arg-type]
    return gate


def arrive(gate: EngineGate, now: float, model: str = "m") -> tuple[Ticket, Outcome]:
    decision = gate.arrive(Ticket(model=model, arrived=now), now)
    return decision.ticket, decision.outcome


def test_admits_while_below_both_limits() -> None:
    gate = gate_with(running=2, waiting=1, kv=0.5)
    assert arrive(gate, 1.0)[1] is Outcome.ADMITTED


@pytest.mark.parametrize("running,waiting", [(4, 0), (2, 2), (0, 4), (5, 3)])
def test_parks_while_running_plus_waiting_reaches_max_inflight(running: int, waiting: int) -> None:
    gate = gate_with(running=running, waiting=waiting)
    assert arrive(gate, 1.0)[1] is Outcome.PARKED


@pytest.mark.parametrize("kv", [0.9, 0.95, 1.0])
def test_parks_while_kv_usage_at_or_above_threshold(kv: float) -> None:
    gate = gate_with(kv=kv)
    assert arrive(gate, 1.0)[1] is Outcome.PARKED


def test_releases_parked_requests_in_arrival_order_when_a_poll_shows_room() -> None:
    gate = gate_with(running=4)
    tickets = [arrive(gate, 1.0 + i)[0] for i in range(3)]
    released = gate.observe(snap(running=2, at=5.0), now=5.0)
    assert [d.ticket for d in released] == tickets[:2]
    assert all(d.outcome is Outcome.ADMITTED_AFTER_PARK for d in released)
    assert gate.queued() == (tickets[2],)


def test_new_arrival_never_overtakes_the_queue() -> None:
    gate = gate_with(kv=0.95)
    first, _ = arrive(gate, 1.0)
    gate.observe(snap(kv=0.95, at=2.0), now=2.0)
    second, outcome = arrive(gate, 2.5)
    assert outcome is Outcome.PARKED
    assert gate.queued() == (first, second)


def test_queue_overflow_is_rejected_at_once() -> None:
    gate = gate_with(running=4)
    for i in range(LIMITS.max_queue_depth):
        assert arrive(gate, 1.0 + i)[1] is Outcome.PARKED
    ticket, outcome = arrive(gate, 5.0)
    assert outcome is Outcome.QUEUE_FULL
    assert ticket.state is TicketState.DONE
    assert gate.queue_depth == LIMITS.max_queue_depth


def test_zero_queue_depth_rejects_instead_of_parking() -> None:
    gate = gate_with(replace(LIMITS, max_queue_depth=0), running=4)
    assert arrive(gate, 1.0)[1] is Outcome.QUEUE_FULL


def test_park_cap_rejects_exactly_at_the_deadline_and_not_before() -> None:
    gate = gate_with(running=4)
    ticket, _ = arrive(gate, 1.0)
    assert gate.next_deadline() == 11.0
    assert gate.expire(10.999) == []
    expired = gate.expire(11.0)
    assert [(d.ticket, d.outcome) for d in expired] == [(ticket, Outcome.PARK_TIMEOUT)]
    assert gate.queue_depth == 0


def test_client_gone_leaves_the_queue_and_is_never_admitted_later() -> None:
    gate = gate_with(running=4)
    gone, _ = arrive(gate, 1.0)
    stays, _ = arrive(gate, 1.1)
    decision = gate.abandon(gone, 2.0)
    assert decision is not None and decision.outcome is Outcome.CLIENT_GONE
    released = gate.observe(snap(at=3.0), now=3.0)
    assert [d.ticket for d in released] == [stays]
    assert gone.state is TicketState.DONE
    assert gate.abandon(gone, 4.0) is None


def test_between_poll_accounting_counts_own_admissions_until_a_scrape_can_see_them() -> None:
    gate = gate_with(running=2, at=0.0)
    assert arrive(gate, 1.0)[1] is Outcome.ADMITTED
    assert arrive(gate, 1.1)[1] is Outcome.ADMITTED
    assert arrive(gate, 1.2)[1] is Outcome.PARKED  # 2 seen + 2 of ours = 4
    assert gate.effective_load() == 4


def test_reference_mode_admits_everything_between_polls_from_the_last_snapshot() -> None:
    gate = gate_with(replace(LIMITS, max_queue_depth=8, local_accounting=False), running=2)
    assert [arrive(gate, 1.0 + i / 10)[1] for i in range(5)] == [Outcome.ADMITTED] * 5


def test_scrape_started_within_grace_of_an_admission_does_not_count_it_as_seen() -> None:
    gate = gate_with(running=3, at=0.0)
    mine, _ = arrive(gate, 1.0)
    # The next scrape began 0.2 s after our admission: maybe too early to see it.
    gate.observe(snap(running=3, at=1.2), now=1.3)
    assert gate.effective_load() == 4
    # A scrape that began well after the grace sees the request itself.
    gate.observe(snap(running=4, at=2.0), now=2.1)
    assert gate.effective_load() == 4
    assert mine.state is TicketState.ADMITTED


def test_local_completion_wakes_the_queue_head_at_once() -> None:
    gate = gate_with(running=0, at=0.0)
    mine = [arrive(gate, 1.0)[0] for _ in range(4)]
    gate.observe(snap(running=4, at=3.0), now=3.1)  # the scrape saw all four
    parked, outcome = arrive(gate, 4.0)
    assert outcome is Outcome.PARKED
    released = gate.finish(mine[0], now=5.0)
    assert [(d.ticket, d.outcome) for d in released] == [(parked, Outcome.ADMITTED_AFTER_PARK)]


def test_reference_mode_waits_for_the_next_poll_after_a_local_completion() -> None:
    gate = gate_with(replace(LIMITS, max_queue_depth=8, local_accounting=False), running=0)
    mine = arrive(gate, 1.0)[0]
    gate.observe(snap(running=4, at=3.0), now=3.1)
    arrive(gate, 4.0)
    assert gate.finish(mine, now=5.0) == []
    assert len(gate.observe(snap(running=3, at=6.0), now=6.0)) == 1


def test_completion_does_not_free_a_slot_the_scrape_never_counted() -> None:
    gate = gate_with(running=3, at=0.0)
    mine, _ = arrive(gate, 1.0)  # unseen: counted locally
    parked, _ = arrive(gate, 1.1)
    assert parked.state is TicketState.PARKED
    released = gate.finish(mine, now=1.5)  # freed: back to 3 seen
    assert [d.ticket for d in released] == [parked]
    assert gate.effective_load() == 4


def test_finished_requests_stop_counting_once_a_later_scrape_began() -> None:
    gate = gate_with(running=0, at=0.0)
    mine, _ = arrive(gate, 1.0)
    gate.observe(snap(running=1, at=3.0), now=3.0)
    gate.finish(mine, now=4.0)
    assert gate.effective_load() == 0
    gate.observe(snap(running=0, at=5.0), now=5.0)
    assert gate.effective_load() == 0


def test_unknown_engine_state_fails_open() -> None:
    gate = EngineGate(LIMITS)
    assert gate.state is EngineState.UNKNOWN
    ticket, outcome = arrive(gate, 0.0)
    assert outcome is Outcome.ADMITTED_FAIL_OPEN
    assert gate.inflight == 0 and ticket.state is TicketState.ADMITTED


def test_stale_after_consecutive_failed_polls_releases_the_park_and_fails_open() -> None:
    gate = gate_with(running=4)
    parked = [arrive(gate, 1.0)[0] for _ in range(2)]
    assert gate.poll_failed(2.0) == [] and gate.poll_failed(3.0) == []
    released = gate.poll_failed(4.0)
    assert gate.state is EngineState.STALE
    assert [(d.ticket, d.outcome) for d in released] == [(t, Outcome.ADMITTED_FAIL_OPEN) for t in parked]
    assert arrive(gate, 5.0)[1] is Outcome.ADMITTED_FAIL_OPEN


def test_a_good_poll_after_staleness_restores_gating() -> None:
    gate = gate_with(running=4)
    for i in range(3):
        gate.poll_failed(1.0 + i)
    gate.observe(snap(running=4, at=5.0), now=5.0)
    assert gate.state is EngineState.FRESH
    assert arrive(gate, 6.0)[1] is Outcome.PARKED


def test_drain_answers_every_parked_request() -> None:
    gate = gate_with(running=4)
    parked = [arrive(gate, 1.0)[0] for _ in range(3)]
    drained = gate.drain(Outcome.SHUTTING_DOWN)
    assert [d.ticket for d in drained] == parked
    assert gate.queue_depth == 0


# --- properties ---------------------------------------------------------------------------

_arrive = st.tuples(st.just("arrive"), st.floats(0, 2))
ops = st.lists(
    st.one_of(
        _arrive, _arrive, _arrive,  # arrivals dominate, so bursts between polls are common
        st.tuples(st.just("observe"),
                  st.tuples(st.integers(0, 3), st.integers(0, 1), st.sampled_from([0.0, 0.5, 0.95]))),
        st.tuples(st.just("fail"), st.none()),
        st.tuples(st.just("finish"), st.integers(0, 50)),
        st.tuples(st.just("abandon"), st.integers(0, 50)),
        st.tuples(st.just("tick"), st.floats(0, 6)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, local=st.booleans(), depth=st.integers(0, 4), grace=st.sampled_from([0.0, 0.5]))
def test_gate_invariants_hold_under_any_interleaving(ops: list, local: bool, depth: int, grace: float) -> None:
    gate = EngineGate(limits(max_inflight=3, kv_threshold=0.9, max_queue_depth=depth, max_park_seconds=5.0,
                             stale_after_polls=2, local_accounting=local, scrape_grace_seconds=grace, **COUNT_ONLY))
    now = 0.0
    tickets: list[Ticket] = []
    final: dict[int, list[Outcome]] = {}
    park_order: list[Ticket] = []
    release_order: list[Ticket] = []
    snap_load = 0  # running + waiting of the last observed snapshot
    admits_since_snap = 0  # gated admissions since that snapshot
    finishes_since_snap = 0  # local completions since that snapshot

    def record(decisions: list) -> None:  # noqa: ANN001
        for d in decisions:
            final.setdefault(d.ticket.id, []).append(d.outcome)
            if d.outcome in (Outcome.ADMITTED_AFTER_PARK, Outcome.ADMITTED_FAIL_OPEN, Outcome.PARK_TIMEOUT,
                             Outcome.CLIENT_GONE, Outcome.SHUTTING_DOWN) and d.ticket in park_order:
                release_order.append(d.ticket)

    for op, arg in ops:
        admitted_before = sum(1 for outs in final.values() for o in outs if o.admits)
        gated_before = sum(1 for outs in final.values() for o in outs
                           if o in (Outcome.ADMITTED, Outcome.ADMITTED_AFTER_PARK))
        if op == "arrive":
            now += arg
            d = gate.arrive(Ticket(model="m", arrived=now), now)
            tickets.append(d.ticket)
            if d.outcome is Outcome.PARKED:
                park_order.append(d.ticket)
            else:
                record([d])
        elif op == "observe":
            running, waiting, kv = arg
            snap_load, admits_since_snap, finishes_since_snap = running + waiting, 0, 0
            record(gate.observe(snap(running, waiting, kv, at=now), now))
        elif op == "fail":
            record(gate.poll_failed(now))
        elif op == "finish" and tickets:
            ticket = tickets[arg % len(tickets)]
            finishes_since_snap += ticket.state is TicketState.ADMITTED and ticket.counted
            record(gate.finish(ticket, now))
        elif op == "abandon" and tickets:
            d = gate.abandon(tickets[arg % len(tickets)], now)
            record([d] if d else [])
        elif op == "tick":
            now += arg
            record(gate.expire(now))
        admitted_now = sum(1 for outs in final.values() for o in outs if o.admits) - admitted_before
        admits_since_snap += sum(
            1 for outs in final.values() for o in outs if o in (Outcome.ADMITTED, Outcome.ADMITTED_AFTER_PARK)
        ) - gated_before
        # Counted independently of the gate's own arithmetic: between two polls, the gate admits
        # no more than the snapshot's free slots plus the slots its own completions freed.
        if local:
            assert admits_since_snap <= max(0, gate.limits.max_inflight - snap_load) + finishes_since_snap

        # The park is bounded in length and in time.
        assert gate.queue_depth <= depth
        assert all(t.park_deadline is not None and t.park_deadline > now or op != "tick" for t in gate.queued())
        # Nobody waits while the gate could take them.
        if gate.queue_depth:
            assert not gate.is_open()
        # Admissions under a fresh snapshot never push the believed load past the limit (local accounting).
        if local and admitted_now and gate.state is EngineState.FRESH:
            load = gate.effective_load()
            assert load is not None and load <= gate.limits.max_inflight
        # The local ledger holds exactly the counted admissions whose stream is open.
        assert gate.inflight == sum(1 for t in tickets if t.counted and t.state is TicketState.ADMITTED)

    # Every request got at most one final outcome, and parked ones left the park in FIFO order.
    assert all(len(outs) == 1 for outs in final.values())
    fifo = [t for t in release_order if final[t.id][0] is not Outcome.CLIENT_GONE]
    assert fifo == [t for t in park_order if t in fifo]


def test_own_requests_count_even_when_the_gauge_shows_them_late() -> None:
    gate = gate_with(running=0, at=0.0)
    mine = [arrive(gate, 1.0)[0] for _ in range(4)]
    # vLLM publishes a request at the end of the step after it arrived: a scrape long after the
    # admissions can still show an idle engine.
    gate.observe(snap(running=0, at=6.0), now=6.1)
    assert gate.effective_load() == 4
    assert arrive(gate, 6.2)[1] is Outcome.PARKED
    gate.finish(mine[0], now=7.0)
    assert gate.effective_load() == 4  # the parked one took the freed slot
    assert gate.queue_depth == 0


def test_load_our_requests_cannot_explain_is_still_counted() -> None:
    gate = gate_with(running=0, at=0.0)
    arrive(gate, 1.0)
    gate.observe(snap(running=3, at=6.0), now=6.1)  # ours + two that bypass this gate
    assert gate.effective_load() == 3
    assert arrive(gate, 6.2)[1] is Outcome.ADMITTED
    assert arrive(gate, 6.3)[1] is Outcome.PARKED


# --- the counts kept as tickets come and go ------------------------------------------------------

_OPS = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.integers(1, 3000)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("observe"), st.integers(0, 6), st.integers(0, 3), st.floats(0.0, 1.0),
              st.floats(0.0, 1.5)),
    st.tuples(st.just("poll_failed")),
    st.tuples(st.just("lease"), st.floats(-0.5, 1.0)),
    st.tuples(st.just("keep_only")),
    st.tuples(st.just("wait"), st.floats(0.0, 0.7)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_the_kept_counts_match_a_recount_after_any_sequence_of_events(ops: list[tuple]) -> None:
    """What the gate keeps per ticket (reserved KV; ours the scrape saw surely, maybe, and their KV)
    is what a gate rebuilt from its state, which counts everything afresh, computes."""
    budget = limits(max_inflight=6, max_queue_depth=4, scrape_grace_seconds=0.5, stale_after_polls=2)
    gate, now = EngineGate(budget), 0.0
    gate.observe(EngineSnapshot(0, 0, 0.0, 0.0, capacity_tokens=16_384, block_size=16), now)
    open_tickets: list[Ticket] = []
    for op in ops:
        kind = op[0]
        if kind == "arrive":
            decision = gate.arrive(Ticket(model="m", arrived=now, tokens=op[1], generation=op[1] // 4), now)
            released = [decision]
        elif kind == "finish" and open_tickets:
            released = gate.finish(open_tickets.pop(op[1] % len(open_tickets)), now)
        elif kind == "observe":
            _, running, waiting, kv, lag = op
            released = gate.observe(EngineSnapshot(running, waiting, kv, max(0.0, now - lag), capacity_tokens=16_384,
                                                   block_size=16), now)
        elif kind == "poll_failed":
            released = gate.poll_failed(now)
        elif kind == "lease":
            gate.renew("", now + op[1])
            dead, released = gate.purge_expired(now)
            open_tickets = [t for t in open_tickets if t not in dead]
        elif kind == "keep_only":
            gate.keep_only("")
            released = []
        else:
            now += op[1] if kind == "wait" else 0.0
            released = []
        open_tickets += [d.ticket for d in released if d.outcome in (Outcome.ADMITTED, Outcome.ADMITTED_AFTER_PARK)]
        recounted = EngineGate.from_state(budget, gate.to_state())
        assert gate.reserved_tokens == recounted.reserved_tokens == sum(t.reserved for t in gate.admitted())
        assert gate.effective_load() == recounted.effective_load()
        assert gate.available_tokens() == recounted.available_tokens()
        assert gate.is_open() == recounted.is_open()
        now += 0.05
