"""Work conservation: the gate never holds a request while the engine truly has room for it.

The properties drive the pure gate with random interleavings of arrivals, finishes, scrapes,
clock ticks and load from callers that bypass the gate, against an independent model of the
engine (the ground truth): which requests it holds, and what a scrape of its gauges shows,
given how long after its admission the gauges first show each of our requests (its lag).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import given, settings, strategies as st

from extproc.gate import EngineGate, EngineSnapshot, Ticket, TicketState
from extproc.outcomes import Outcome

from .limits import COUNT_ONLY, limits

CAPACITY = 4_096
BLOCK = 16
GRACE = 0.5
DONE_AFTER = 1.0  # engine_done_after_seconds

_arrive = st.tuples(st.just("arrive"), st.integers(1, 1_500))
_finish = st.tuples(st.just("finish"), st.integers(0, 1_000))
# The engine finishes a request whose client does not read: its stream stays open.
_engine_done = st.tuples(st.just("engine_done"), st.integers(0, 1_000))
_others = st.tuples(st.just("others"), st.tuples(st.integers(-1, 1), st.integers(-200, 200)))
EVENT = st.one_of(
    _arrive, _arrive, _finish, _finish, _engine_done,
    st.tuples(st.just("scrape"), st.none()),
    st.tuples(st.just("tick"), st.sampled_from([0.05, 0.2, 0.45, 0.5, 0.55, 1.0])),
)


@dataclass
class Engine:
    """The ground truth: our open requests, the others' load, and what a scrape shows."""

    gate: EngineGate
    lag: Callable[[Ticket], float]
    ours: dict[int, Ticket] = field(default_factory=dict)  # our requests the engine holds now
    others: int = 0
    others_kv: int = 0

    def shown(self, tickets: list[Ticket], at: float) -> list[Ticket]:
        return [t for t in tickets if t.admitted_at is not None and t.admitted_at < at - self.lag(t)]

    def scrape(self, at: float) -> EngineSnapshot:
        shown = self.shown(list(self.ours.values()), at)
        used = self.others_kv + sum(self.gate.cost(t) for t in shown)  # a shown request holds its whole need
        return EngineSnapshot(running=self.others + len(shown), waiting=0, kv_usage=used / CAPACITY,
                              scrape_started=at, capacity_tokens=CAPACITY, block_size=BLOCK)


@dataclass
class Step:
    """The state after one event, for the assertions."""

    op: str
    believed: int
    before: int | None
    admitted: int  # requests the event itself admitted
    open_: list[Ticket]
    others_at_scrape: int
    others_kv_at_scrape: int
    double: list[Ticket]  # open, admitted within the grace before the scrape, and shown by it
    hidden_finished: list[Ticket]  # finished since the scrape, admitted before it, not shown by it
    unread: list[Ticket]  # finished at the engine, stream still open
    proven: list[Ticket]  # of those, the ones a scrape DONE_AFTER after their admission has shown gone
    masked: int = 0  # ours the last scrape showed that were admitted within DONE_AFTER before it


def drive(ops: list, budget: bool, lag: Callable[[Ticket], float], with_others: bool) -> list[Step]:
    gate = EngineGate(limits(
        max_inflight=3, kv_threshold=1.0, max_queue_depth=1_000, max_park_seconds=1e9,
        scrape_grace_seconds=GRACE, kv_budget=budget, engine_queue_slots=0, wait_estimates=False, backfill=False,
        engine_done_after_seconds=DONE_AFTER))
    engine = Engine(gate, lag)
    now = scraped = 0.0
    gate.observe(engine.scrape(now), now)
    at_scrape = (0, 0)
    tickets: list[Ticket] = []
    finished_since: list[tuple[Ticket, float]] = []  # our requests finished since the last scrape began
    unread: dict[int, float] = {}  # ticket id -> when the engine finished it (stream still open)
    by_id: dict[int, Ticket] = {}
    engine_done_at: dict[int, float] = {}  # every request the engine finished before its client read it
    masked = 0
    steps: list[Step] = []

    admitted = 0

    def took(decisions: list) -> None:  # noqa: ANN001
        nonlocal admitted
        newly = {d.ticket.id: d.ticket for d in decisions if d.outcome.admits}
        engine.ours.update(newly)
        admitted += len(newly)

    for op, arg in ops:
        before = gate.effective_load()
        admitted = 0
        if op == "arrive":
            ticket = Ticket(model="m", arrived=now, tokens=arg)
            tickets.append(ticket)
            took([gate.arrive(ticket, now)])
        elif op == "finish":
            open_ = [t for t in tickets if t.state is TicketState.ADMITTED]
            if not open_:
                continue
            ticket = open_[arg % len(open_)]
            engine.ours.pop(ticket.id, None)
            finished_since.append((ticket, now))
            unread.pop(ticket.id, None)  # the client read it at last (or left)
            took(gate.finish(ticket, now))
        elif op == "engine_done":
            running = list(engine.ours.values())
            if not running:
                continue
            ticket = running[arg % len(running)]
            del engine.ours[ticket.id]
            unread[ticket.id] = engine_done_at[ticket.id] = now
            by_id[ticket.id] = ticket
        elif op == "scrape":
            now += 0.001  # events before the scrape are strictly earlier than its start
            scraped = now
            at_scrape = (engine.others, engine.others_kv)
            masked = len([t for t in engine.shown(list(engine.ours.values()), scraped)
                          if (t.admitted_at or 0.0) >= scraped - DONE_AFTER])
            finished_since = [(t, at) for t, at in finished_since if at >= scraped]
            took(gate.observe(engine.scrape(scraped), now))
        elif op == "tick":
            now += arg
        elif op == "others":
            if not with_others:
                continue
            engine.others = max(0, engine.others + arg[0])
            engine.others_kv = min(CAPACITY // 4, max(0, engine.others_kv + arg[1]))
        believed = gate.effective_load()
        assert believed is not None
        open_ = list(engine.ours.values())
        in_grace = [t for t in open_ if t.admitted_at is not None and scraped - GRACE <= t.admitted_at < scraped]
        steps.append(Step(
            op, believed, before, admitted, open_, *at_scrape,
            double=engine.shown(in_grace, scraped),
            hidden_finished=[t for t, _ in finished_since if t.admitted_at is not None and t.admitted_at < scraped
                             and (not engine.shown([t], scraped) or engine_done_at.get(t.id, scraped) < scraped)],
            unread=[], proven=[],
        ))
        proven = [by_id[i] for i, done in unread.items()
                  if done < scraped and (by_id[i].admitted_at or 0.0) < scraped - DONE_AFTER]
        step = steps[-1]
        step.unread, step.proven, step.masked = [by_id[i] for i in unread], proven, masked
        # Whatever the lag, the gate's view is the documented decomposition of the truth. Slots:
        # `others` lies between the scrape's two readings (ours in the grace all seen / none).
        high = max(0, at_scrape[0] + len(step.double) - len(step.hidden_finished))
        low = max(0, high - len(in_grace))
        if step.unread:  # the engine finished some whose clients do not read: it never frees one it holds
            assert len(open_) <= believed <= len(open_) + len(step.unread) + high if not with_others else \
                len(open_) <= believed
        else:
            assert len(open_) + low <= believed <= len(open_) + high
        if budget:  # KV: ours in the grace count as unseen, finished ones as seen
            cost = gate.cost
            others_kv = max(0, at_scrape[1] + sum(map(cost, step.double)) - sum(map(cost, step.hidden_finished)))
            available = gate.available_tokens()
            assert available is not None
            if step.unread:  # KV still reserved for some, or freed for others' (smallest first): the cautious side
                assert available <= CAPACITY - others_kv - sum(map(cost, open_)) + 1
            else:
                assert abs(available - (CAPACITY - others_kv - sum(map(cost, open_)))) <= 1
        if gate.queue_depth:  # nobody waits while the gate itself sees room
            assert not gate.fits(gate.queued()[0])
    return steps


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(EVENT, max_size=120), budget=st.booleans(),
       lags=st.lists(st.sampled_from([0.0, 0.1, 0.3, GRACE]), min_size=1, max_size=5))
def test_a_parked_request_is_released_by_the_event_that_gives_the_engine_room(
    ops: list, budget: bool, lags: list[float]
) -> None:
    """In front of an engine nobody else calls, whatever the gauges' lag (up to the grace): after
    every event the gate's load is the engine's own plus the requests it finished whose clients have
    not read them and that no scrape DONE_AFTER their admission has shown gone yet, a request waits
    only while the engine truly has no slot or no KV for it, and, when the lag is the grace, its
    free KV is exact too."""
    for step in drive(ops, budget, lag=lambda t: lags[t.id % len(lags)], with_others=False):
        # Ours the scrape shows that are younger than DONE_AFTER may be ones it missed: they hide as
        # many finished ones. With none, every proven one is free.
        assert len(step.open_) <= step.believed <= len(step.open_) + len(step.unread)
        if step.op == "scrape" and step.masked == 0:  # then every proven one is free at once
            assert step.believed == len(step.open_) + len(step.unread) - len(step.proven)
        if all(lag == GRACE for lag in lags):
            assert not step.double  # so the KV decomposition above is the truth itself


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(st.one_of(EVENT, _others), max_size=120),
       budget=st.booleans(), lags=st.lists(st.sampled_from([0.0, 0.1, 0.3, GRACE]), min_size=1, max_size=5))
def test_with_callers_that_bypass_the_gate_a_finish_still_frees_its_slot_at_once(
    ops: list, budget: bool, lags: list[float]
) -> None:
    """Other callers may load the engine: our own requests the engine holds always count, and a
    finished one never keeps a slot (each finish lowers the load by one, less what it released,
    unless a scrape already freed it)."""
    for step in drive(ops, budget, lag=lambda t: lags[t.id % len(lags)], with_others=True):
        assert step.believed >= len(step.open_)
        if step.op == "finish" and step.before is not None:
            assert step.believed - step.admitted <= step.before


def test_a_steady_bypassing_load_is_not_hidden_by_a_request_of_ours_the_scrape_missed() -> None:
    gate = EngineGate(limits(max_inflight=4, kv_threshold=0.9, max_queue_depth=8, max_park_seconds=10.0,
                             scrape_grace_seconds=GRACE, **COUNT_ONLY))
    gate.observe(EngineSnapshot(3, 0, 0.0, scrape_started=0.0), now=0.0)  # three callers bypass the gate
    gate.arrive(Ticket(model="m", arrived=1.0), 1.0)
    gate.observe(EngineSnapshot(3, 0, 0.0, scrape_started=1.2), now=1.3)  # ours not shown yet, or one left
    assert gate.effective_load() == 4
    assert gate.arrive(Ticket(model="m", arrived=1.4), 1.4).outcome is Outcome.PARKED


def test_requests_admitted_within_the_grace_free_their_slots_when_they_finish() -> None:
    """The defect measured with aiperf: short requests admitted just before a scrape kept their
    slots until the next scrape, and the gate stood closed for ~2 s at a time."""
    gate = EngineGate(limits(max_inflight=3, kv_threshold=0.9, max_queue_depth=8, max_park_seconds=10.0,
                             scrape_grace_seconds=GRACE, **COUNT_ONLY))
    gate.observe(EngineSnapshot(0, 0, 0.0, scrape_started=0.0), now=0.0)
    mine = [gate.arrive(Ticket(model="m", arrived=9.8), 9.8).ticket for _ in range(3)]
    # The scrape began 0.2 s after the admissions and saw all three running.
    gate.observe(EngineSnapshot(3, 0, 0.0, scrape_started=10.0), now=10.0)
    parked = gate.arrive(Ticket(model="m", arrived=10.1), 10.1)
    assert parked.outcome is Outcome.PARKED
    released = gate.finish(mine[0], now=10.25)
    assert [d.ticket for d in released] == [parked.ticket]  # the first finish makes room
    for ticket in mine[1:]:
        gate.finish(ticket, now=10.3)
    assert gate.effective_load() == 1  # only the released request is open
