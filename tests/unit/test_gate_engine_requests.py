"""A request costs the engine requests it becomes (n x prompts), and a request the engine has
finished holds no slot while its client does not read (extproc/gate.py, "Engine requests" and
"Engine done, stream open")."""

from __future__ import annotations

import json

from extproc.bodyscan import scan_body
from extproc.estimate import TemplateOverhead, estimate_from_bytes
from extproc.gate import EngineGate, EngineSnapshot, Ticket
from extproc.outcomes import Outcome

from .limits import COUNT_ONLY, limits

LIMITS = limits(max_inflight=20, kv_threshold=0.9, max_queue_depth=8, max_park_seconds=60.0,
                scrape_grace_seconds=0.5, engine_done_after_seconds=5.0, **COUNT_ONLY)
CAPACITY = 100_000


def snap(running: int = 0, waiting: int = 0, at: float = 0.0, kv: float = 0.0) -> EngineSnapshot:
    return EngineSnapshot(running=running, waiting=waiting, kv_usage=kv, scrape_started=at,
                          capacity_tokens=CAPACITY, block_size=16)


def gate_at(limits_: object = LIMITS, **snapshot: float) -> EngineGate:
    gate = EngineGate(limits_)  # type: ignore[arg-type]
    gate.observe(snap(**snapshot), now=snapshot.get("at", 0.0))  # type: ignore[arg-type]
    return gate


def arrive(gate: EngineGate, now: float, requests: int = 1, tokens: int = 0) -> tuple[Ticket, Outcome]:
    decision = gate.arrive(Ticket(model="m", arrived=now, tokens=tokens, requests=requests), now)
    return decision.ticket, decision.outcome


# --- n and prompt lists take one slot per engine request -----------------------------------------

def test_n_16_takes_16_slots() -> None:
    gate = gate_at()
    first, outcome = arrive(gate, 1.0, requests=16)
    assert outcome is Outcome.ADMITTED and gate.effective_load() == 16
    assert arrive(gate, 1.1, requests=16)[1] is Outcome.PARKED  # 32 > 20
    assert arrive(gate, 1.2, requests=4)[1] is Outcome.PARKED  # it would fit, but the queue is FIFO
    released = gate.finish(first, 2.0)
    assert [d.ticket.requests for d in released] == [16, 4] and gate.effective_load() == 20


def test_a_four_prompt_completion_batch_takes_4_slots_and_four_generations_of_kv() -> None:
    body = json.dumps({"model": "m", "prompt": ["a" * 40, "b" * 40, "c" * 40, "d" * 40], "max_tokens": 10}).encode()
    facts = scan_body(body)
    assert (facts.prompts, facts.engine_requests) == (4, 4)
    cost = estimate_from_bytes(facts, 4.0, 1.0, 1024, TemplateOverhead(), "prior")
    assert cost.engine_requests == 4 and cost.tokens == 40 + 4 * 10  # all prompts, each one's generation
    token_lists = scan_body(json.dumps({"model": "m", "prompt": [[1, 2], [3], [4, 5, 6]], "n": 2}).encode())
    assert token_lists.engine_requests == 6  # three prompts of token ids, two choices each
    assert scan_body(json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode()).engine_requests == 1
    gate = gate_at()
    arrive(gate, 1.0, requests=facts.engine_requests)
    assert gate.effective_load() == 4


def test_the_scrape_explains_n_engine_requests_with_one_ticket() -> None:
    gate = gate_at(running=2)  # two callers bypass the gate
    arrive(gate, 1.0, requests=3)
    gate.observe(snap(running=5, at=2.0), 2.0)  # ours (3) + theirs (2)
    assert gate.effective_load() == 5  # not 2 + 5 others


def test_a_request_above_the_whole_limit_goes_in_alone() -> None:
    """Admitted only while nothing else is at the engine, and nothing joins it until it ends."""
    gate = gate_at()
    small, _ = arrive(gate, 1.0, requests=1)
    big, outcome = arrive(gate, 1.1, requests=150)
    assert outcome is Outcome.PARKED
    assert arrive(gate, 1.2)[1] is Outcome.PARKED  # behind it in the FIFO
    released = gate.finish(small, 2.0)
    assert [d.ticket for d in released] == [big] and gate.effective_load() == 150
    assert arrive(gate, 2.1)[1] is Outcome.PARKED
    assert [d.ticket.requests for d in gate.finish(big, 3.0)] == [1, 1]


def test_a_request_above_the_limit_waits_while_callers_that_bypass_the_gate_load_the_engine() -> None:
    gate = gate_at(running=1)
    assert arrive(gate, 1.0, requests=21)[1] is Outcome.PARKED
    assert [d.outcome for d in gate.observe(snap(running=0, at=2.0), 2.0)] == [Outcome.ADMITTED_AFTER_PARK]


def test_engine_requests_survive_serialisation() -> None:
    gate = gate_at()
    ticket, _ = arrive(gate, 1.0, requests=7)
    rebuilt = EngineGate.from_state(LIMITS, json.loads(json.dumps(gate.to_state())))
    assert rebuilt.effective_load() == 7 and rebuilt.admitted()[0].requests == ticket.requests == 7
    gate.finish(ticket, 2.0)
    rebuilt = EngineGate.from_state(LIMITS, json.loads(json.dumps(gate.to_state())))
    gate.observe(snap(running=0, at=1.5), 2.1)  # the scrape began before the finish: it is in `_finished`
    rebuilt.observe(snap(running=0, at=1.5), 2.1)
    assert gate.to_state() == rebuilt.to_state()


# --- a request the engine finished holds no slot while its client does not read -----------------

FIVE = limits(max_inflight=5, kv_threshold=0.9, max_queue_depth=8, max_park_seconds=60.0,
              scrape_grace_seconds=0.5, engine_done_after_seconds=5.0, **COUNT_ONLY)


def test_an_idle_engine_frees_the_slots_of_requests_whose_clients_never_read() -> None:
    gate = gate_at(FIVE)
    unread = [arrive(gate, 1.0)[0] for _ in range(5)]
    gate.observe(snap(running=5, at=3.0), 3.0)
    parked, outcome = arrive(gate, 4.0)
    assert outcome is Outcome.PARKED
    # The engine finished them; their streams stay open. A scrape 5 s after their admission shows it.
    assert gate.observe(snap(running=0, at=5.5), 5.5) == []  # too soon: it may not show them yet
    released = gate.observe(snap(running=0, at=6.5), 6.5)
    assert [d.ticket for d in released] == [parked]
    assert gate.engine_done() == 5 and gate.effective_load() == 1
    for t in unread:  # the clients leave at last: nothing is freed twice
        gate.finish(t, 9.0)
    assert gate.engine_done() == 0 and gate.effective_load() == 1


def test_only_what_the_scrape_cannot_show_is_freed() -> None:
    gate = gate_at(FIVE)
    for _ in range(4):
        arrive(gate, 1.0)
    gate.observe(snap(running=3, at=7.0), 7.0)  # three still run: one finished
    assert gate.engine_done() == 1 and gate.effective_load() == 3
    gate.observe(snap(running=4, at=9.0), 9.0)  # a caller that bypasses the gate, or a lagging gauge
    assert gate.engine_done() == 0 and gate.effective_load() == 4


def test_a_young_request_is_never_taken_as_done() -> None:
    gate = gate_at(FIVE)
    arrive(gate, 1.0)
    gate.observe(snap(running=0, at=5.9), 5.9)  # 4.9 s after its admission: the gauge may lag that much
    assert gate.engine_done() == 0 and gate.effective_load() == 1


def test_an_n_request_is_freed_by_its_engine_requests() -> None:
    gate = gate_at(FIVE)
    arrive(gate, 1.0, requests=4)
    gate.observe(snap(running=1, at=7.0), 7.0)  # three of its four choices are done
    assert gate.engine_done() == 3 and gate.effective_load() == 1


def test_the_freed_kv_is_the_smallest_reservations_that_make_up_the_freed_requests() -> None:
    budget = limits(max_inflight=5, kv_threshold=0.99, max_queue_depth=8, max_park_seconds=60.0,
                    scrape_grace_seconds=0.5, engine_done_after_seconds=5.0, kv_budget=True, engine_queue_slots=0)
    gate = gate_at(budget)
    arrive(gate, 1.0, tokens=8_000)
    arrive(gate, 1.0, tokens=32_000)
    assert gate.available_tokens() == CAPACITY - 40_000
    # One of the two finished (which, the scrape does not say): free the smaller reservation only.
    gate.observe(snap(running=1, at=7.0, kv=0.32), 7.0)
    assert gate.engine_done() == 1 and gate.available_tokens() == CAPACITY - 32_000
