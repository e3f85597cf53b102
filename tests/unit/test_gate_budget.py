"""The KV-token budget, backfill, never-fits and Retry-After rules of the gate."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings, strategies as st

from extproc.gate import EngineGate, EngineSnapshot, EngineState, GateLimits, Ticket, TicketState
from extproc.outcomes import Outcome

from .limits import limits

CAPACITY = 152_432  # 9527 blocks x 16 tokens: the reference engine
BIG, SMALL = 65_536 + 256, 8_192 + 128
LIMITS = limits(max_inflight=4, kv_threshold=0.9, max_queue_depth=8, max_park_seconds=120.0,
                kv_budget=True, engine_queue_slots=0, scrape_grace_seconds=0.5)


def snap(kv: float = 0.0, running: int = 0, waiting: int = 0, at: float = 0.0,
         capacity: int | None = CAPACITY) -> EngineSnapshot:
    return EngineSnapshot(running=running, waiting=waiting, kv_usage=kv, scrape_started=at,
                          capacity_tokens=capacity, block_size=16)


def gate_with(limits: GateLimits = LIMITS, **kwargs: float) -> EngineGate:
    gate = EngineGate(limits)
    gate.observe(snap(**kwargs), now=kwargs.get("at", 0.0))  # type: ignore[arg-type]
    return gate


def arrive(gate: EngineGate, now: float, tokens: int) -> tuple[Ticket, Outcome]:
    d = gate.arrive(Ticket(model="m", arrived=now, tokens=tokens), now)
    return d.ticket, d.outcome


def test_reservations_are_rounded_up_to_blocks() -> None:
    gate = gate_with()
    ticket, _ = arrive(gate, 1.0, 17)
    assert ticket.reserved == 32 and gate.reserved_tokens == 32


def test_a_request_that_does_not_fit_the_free_budget_parks_even_at_zero_kv_usage() -> None:
    gate = gate_with()
    assert arrive(gate, 1.0, BIG)[1] is Outcome.ADMITTED
    assert arrive(gate, 1.1, BIG)[1] is Outcome.ADMITTED
    # The gauge still says 0% (prefill has barely started), but a third 65k prompt cannot fit.
    assert arrive(gate, 1.2, BIG)[1] is Outcome.PARKED


def test_completion_returns_the_reservation_and_admits_the_head() -> None:
    gate = gate_with()
    first, _ = arrive(gate, 1.0, BIG)
    arrive(gate, 1.1, BIG)
    third, _ = arrive(gate, 1.2, BIG)
    released = gate.finish(first, now=50.0)
    assert [(d.ticket, d.outcome) for d in released] == [(third, Outcome.ADMITTED_AFTER_PARK)]


def test_usage_our_requests_cannot_explain_is_charged_to_others() -> None:
    gate = gate_with(kv=0.5)  # half the cache is used by callers that bypass this gate
    assert gate.available_tokens() == CAPACITY - CAPACITY // 2
    assert arrive(gate, 1.0, BIG)[1] is Outcome.ADMITTED
    assert arrive(gate, 1.1, BIG)[1] is Outcome.PARKED


def test_our_own_allocation_seen_by_the_gauge_is_not_charged_twice() -> None:
    gate = gate_with(at=0.0)
    arrive(gate, 1.0, BIG)
    # A later scrape sees our request's prefill half done: 32k tokens used, all of them ours.
    gate.observe(snap(kv=32_768 / CAPACITY, at=5.0), now=5.0)
    assert gate.available_tokens() == CAPACITY - BIG


def test_a_request_larger_than_the_whole_cache_is_rejected_at_once() -> None:
    gate = gate_with()
    ticket, outcome = arrive(gate, 1.0, CAPACITY + 1)
    assert outcome is Outcome.EXCEEDS_KV_CAPACITY
    assert gate.queue_depth == 0 and ticket.state is TicketState.DONE


def test_configured_capacity_is_used_when_the_engine_does_not_say() -> None:
    gate = gate_with(replace(LIMITS, kv_capacity_override=100_000), capacity=None)
    assert gate.capacity_tokens == 100_000
    assert arrive(gate, 1.0, BIG)[1] is Outcome.ADMITTED
    assert arrive(gate, 1.1, BIG)[1] is Outcome.PARKED


def test_without_a_known_capacity_only_the_reference_gates_apply() -> None:
    gate = gate_with(capacity=None)
    assert gate.available_tokens() is None
    assert [arrive(gate, 1.0, BIG)[1] for _ in range(3)] == [Outcome.ADMITTED] * 3


def test_reference_mode_has_no_budget() -> None:
    gate = gate_with(replace(LIMITS, local_accounting=False))
    assert [arrive(gate, 1.0, BIG)[1] for _ in range(3)] == [Outcome.ADMITTED] * 3


def test_small_requests_backfill_past_a_big_head_when_it_cannot_delay_it() -> None:
    gate = gate_with()
    arrive(gate, 1.0, BIG)
    arrive(gate, 1.1, BIG)
    head, _ = arrive(gate, 1.2, BIG)
    small, outcome = arrive(gate, 1.3, SMALL)
    # 152,432 - 2 x 65,792 = 20,848 free; once one big request ends, 86,640 minus the small one
    # is still enough for the head.
    assert outcome is Outcome.ADMITTED and small.backfilled
    assert gate.queued() == (head,)


def test_backfill_never_takes_the_kv_the_head_is_waiting_for() -> None:
    gate = gate_with()
    arrive(gate, 1.0, 50_000)
    arrive(gate, 1.0, 50_000)
    head, _ = arrive(gate, 1.1, 60_000)  # needs 60,000; 52,432 free
    small, outcome = arrive(gate, 1.2, 10_000)
    # With it running, one 50k finishing frees 42,432 + 50,000 >= 60,000: the head is not delayed.
    assert outcome is Outcome.ADMITTED
    blocker, outcome = arrive(gate, 1.3, 40_000)
    # This one would leave 2,432 + 50,000 < 60,000 after the next completion: it must wait.
    assert outcome is Outcome.PARKED
    assert gate.queued() == (head, blocker)


def test_no_backfill_once_the_head_has_waited_its_patience() -> None:
    gate = gate_with()
    arrive(gate, 0.0, BIG)
    arrive(gate, 0.0, BIG)
    arrive(gate, 0.0, BIG)
    assert arrive(gate, 59.0, SMALL)[1] is Outcome.ADMITTED
    assert arrive(gate, 60.0, SMALL)[1] is Outcome.PARKED  # 0.5 x 120 s


def test_no_backfill_when_the_head_waits_for_a_slot_not_for_kv() -> None:
    gate = gate_with(running=3)
    arrive(gate, 1.0, SMALL)  # the fourth slot
    head, _ = arrive(gate, 1.1, SMALL)
    assert arrive(gate, 1.2, 16)[1] is Outcome.PARKED
    assert gate.queued()[0] is head


def test_retry_after_uses_the_measured_completion_rate_and_is_clamped() -> None:
    gate = gate_with()
    assert gate.retry_after(3) == LIMITS.retry_after_seconds  # no history yet
    tickets = [arrive(gate, 0.0, 16)[0] for _ in range(4)]
    for i, t in enumerate(tickets):
        gate.finish(t, now=10.0 + 2.0 * i)  # one completion every 2 s
    assert gate.completion_rate() == 0.5
    assert gate.retry_after(3) == 6
    assert gate.retry_after(1000) == 60
    assert gate.expected_wait(1) == 2.0


def test_expected_wait_beyond_twice_the_park_cap_is_rejected_at_once_with_that_retry_after() -> None:
    gate = gate_with(replace(LIMITS, max_queue_depth=100, max_park_seconds=5.0))  # an estimate: 2 caps
    tickets = [arrive(gate, 0.0, 16)[0] for _ in range(4)]
    for i, t in enumerate(tickets):
        gate.finish(t, now=1.0 + i)  # one completion a second
    gate.observe(snap(running=4, at=5.0), now=5.0)
    outcomes = [gate.arrive(Ticket(model="m", arrived=6.0, tokens=16), 6.0) for _ in range(11)]
    assert [d.outcome for d in outcomes[:10]] == [Outcome.PARKED] * 10
    assert outcomes[10].outcome is Outcome.EXPECTED_WAIT_TOO_LONG
    assert outcomes[10].retry_after == 11


def test_stale_state_fails_open_without_reserving() -> None:
    gate = gate_with()
    for i in range(3):
        gate.poll_failed(float(i))
    assert gate.state is EngineState.STALE
    ticket, outcome = arrive(gate, 5.0, CAPACITY * 2)
    assert outcome is Outcome.ADMITTED_FAIL_OPEN and ticket.reserved == 0


# --- the budget's safety property -------------------------------------------------------

budget_ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from([16, 1_000, SMALL, 30_000, BIG, 100_000])),
        st.tuples(st.just("arrive"), st.sampled_from([16, 1_000, SMALL, 30_000, BIG, 100_000])),
        st.tuples(st.just("observe"), st.floats(0, 1)),
        st.tuples(st.just("fail"), st.none()),
        st.tuples(st.just("finish"), st.integers(0, 50)),
        st.tuples(st.just("abandon"), st.integers(0, 50)),
        st.tuples(st.just("tick"), st.floats(0, 40)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=budget_ops, backfill=st.booleans())
def test_budget_never_reserves_more_than_capacity_under_any_interleaving(ops: list, backfill: bool) -> None:
    gate = EngineGate(limits(max_inflight=16, kv_threshold=1.0, max_queue_depth=6, max_park_seconds=60.0,
                             stale_after_polls=2, kv_budget=True, engine_queue_slots=0, backfill=backfill,
                             scrape_grace_seconds=0.5,
                             # its scrapes show KV, not which of ours the engine still runs:
                             engine_done_after_seconds=1e9))
    now = 0.0
    tickets: list[Ticket] = []
    for op, arg in ops:
        now += 0.1
        if op == "arrive":
            tickets.append(gate.arrive(Ticket(model="m", arrived=now, tokens=arg), now).ticket)
        elif op == "observe":
            gate.observe(snap(kv=arg, at=now), now)
        elif op == "fail":
            gate.poll_failed(now)
        elif op == "finish" and tickets:
            gate.finish(tickets[arg % len(tickets)], now)
        elif op == "abandon" and tickets:
            gate.abandon(tickets[arg % len(tickets)], now)
        elif op == "tick":
            now += arg
            gate.expire(now)
        # Counted independently of the gate: what the admitted, still-open requests reserved.
        held = sum(t.reserved for t in tickets if t.state is TicketState.ADMITTED and t.counted)
        assert held <= CAPACITY
        if gate.state is EngineState.FRESH:
            available = gate.available_tokens()
            assert available is not None and available <= CAPACITY - held


def test_engine_queue_slots_let_one_request_wait_inside_the_engine_with_the_budget() -> None:
    gate = gate_with(replace(LIMITS, engine_queue_slots=1), running=4)
    assert arrive(gate, 1.0, SMALL)[1] is Outcome.ADMITTED  # waits in the engine: its KV is reserved
    assert arrive(gate, 1.1, SMALL)[1] is Outcome.PARKED


def test_engine_queue_slots_do_nothing_without_the_budget() -> None:
    gate = gate_with(replace(LIMITS, kv_budget=False, engine_queue_slots=1), running=4)
    assert arrive(gate, 1.0, SMALL)[1] is Outcome.PARKED


def test_without_wait_estimates_retry_after_is_fixed_and_nothing_is_rejected_early() -> None:
    gate = gate_with(replace(LIMITS, max_queue_depth=100, max_park_seconds=10.0, wait_estimates=False,
                             retry_after_seconds=5))
    tickets = [arrive(gate, 0.0, 16)[0] for _ in range(4)]
    for i, t in enumerate(tickets):
        gate.finish(t, now=1.0 + i)
    gate.observe(snap(running=5, at=5.0), now=5.0)
    outcomes = [gate.arrive(Ticket(model="m", arrived=6.0, tokens=16), 6.0).outcome for _ in range(20)]
    assert outcomes == [Outcome.PARKED] * 20
    assert gate.retry_after(20) == 5


# --- generation reservation ------------------------------------------------------------------


def _counters(now: float, generated: float, finished: float, kv: float = 0.0) -> EngineSnapshot:
    return EngineSnapshot(running=0, waiting=0, kv_usage=kv, scrape_started=now, capacity_tokens=100_000,
                          block_size=16, generated_sum=generated, generated_count=finished)


def test_by_default_a_request_reserves_its_whole_generation_limit() -> None:
    from dataclasses import replace as _replace
    gate = EngineGate(_replace(LIMITS, generation_reservation="max_tokens"))
    gate.observe(_counters(0.0, 0, 0), 0.0)
    gate.observe(_counters(1.0, 1_000, 10), 1.0)  # finished requests generated 100 tokens each
    ticket = Ticket(model="m", arrived=1.0, tokens=1_000 + 4_000, generation=4_000)
    assert gate.cost(ticket) == 5_008  # 5,000 rounded up to blocks of 16


def test_learned_reservation_uses_the_engines_mean_generation_once_it_has_finished_requests() -> None:
    from dataclasses import replace as _replace
    gate = EngineGate(_replace(LIMITS, generation_reservation="learned", generation_factor=1.5))
    ticket = Ticket(model="m", arrived=0.0, tokens=1_000 + 4_000, generation=4_000)
    gate.observe(_counters(0.0, 0, 0), 0.0)
    assert gate.generation_mean is None and gate.cost(ticket) == 5_008  # cold start: the limit
    gate.observe(_counters(1.0, 0, 0), 1.0)
    assert gate.generation_mean is None  # nothing finished yet
    gate.observe(_counters(2.0, 32 * 1_000, 32), 2.0)  # a full window: the mean is taken as it is
    assert gate.generation_mean == 1_000
    assert gate.cost(ticket) == 2_512  # 1,000 + 1.5 x 1,000, rounded up to blocks of 16
    small = Ticket(model="m", arrived=2.0, tokens=1_000 + 200, generation=200)
    assert gate.cost(small) == 1_200  # a limit below the expectation is kept
    gate.observe(_counters(3.0, 32 * 1_000 + 16 * 3_000, 48), 3.0)  # half a window at 3,000
    assert gate.generation_mean == 2_000
    gate.observe(_counters(4.0, 5, 1), 4.0)  # the engine restarted: its counters went back
    assert gate.generation_mean == 2_000
    rebuilt = EngineGate.from_state(gate.limits, gate.to_state())
    assert rebuilt.generation_mean == 2_000 and rebuilt.cost(ticket) == gate.cost(ticket)
