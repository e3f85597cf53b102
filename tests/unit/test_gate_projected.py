"""The projected-KV policy in the gate (`ADMISSION_POLICY=projected`), against the simulator's real
scheduler (enginesim/scheduler.py, stepped here without a clock): a projection that is always right
never preempts, one that under-states lengths does, and the policy admits more than strict."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace

from hypothesis import given, settings, strategies as st

from enginesim.scheduler import CostModel, Scheduler, SchedulerConfig
from extproc.gate import EngineGate, EngineSnapshot, GateLimits, Ticket
from extproc.outcomes import Outcome
from extproc.projection import OracleLength, Progress

from .limits import limits

BLOCK = 4
CONFIG = SchedulerConfig(num_gpu_blocks=81, block_size=BLOCK, max_num_seqs=6, max_num_batched_tokens=256,
                         max_model_len=1024, cost=CostModel(step_overhead_s=0.01, per_prefill_token_s=0.001,
                                                            per_decode_seq_s=0.002))
CAPACITY = CONFIG.usable_blocks * BLOCK  # 320 tokens: what the engine's requests can hold
PROJECTED = limits(max_inflight=CONFIG.max_num_seqs, engine_queue_slots=0, kv_budget=True, kv_threshold=1.0,
                   scrape_grace_seconds=0.0, engine_done_after_seconds=0.0, max_queue_depth=1_000,
                   max_park_seconds=3_600.0, wait_estimates=False, backfill=True, kv_capacity_override=CAPACITY,
                   policy="projected", projection_quantile=0.9, preemption_max_cost_seconds=3_600.0)
STRICT = replace(PROJECTED, policy="strict")


@dataclass
class Run:
    """One workload through one gate in front of one scheduler, scraped after every step."""

    limits: GateLimits
    scale: float = 1.0  # the oracle's lengths x this (< 1: under-stated)
    lengths: dict[int, int] = field(default_factory=dict)
    sched: Scheduler = field(default_factory=lambda: Scheduler(CONFIG, "vllm-0.33"))
    gate: EngineGate = field(init=False)
    tickets: dict[int, Ticket] = field(default_factory=dict)
    generated: tuple[float, float] = (0.0, 0.0)  # finished requests' tokens and count, as vLLM's histogram
    peak_running: int = 0
    makespan: float = 0.0  # engine seconds until the last request finished
    rules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gate = EngineGate(self.limits, lengths=OracleLength(self.lengths, self.scale), progress=self.progress)

    def progress(self, ticket: Ticket, now: float) -> Progress:
        """What the engine itself says: tokens generated so far (prompts fit one chunk: no lag)."""
        request = self.sched.get(str(ticket.id))
        return Progress(request.num_output_tokens if request is not None else 0, 0, True)

    def scrape(self, now: float) -> None:
        stats = self.sched.stats()
        snap = EngineSnapshot(stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage, now,
                              CAPACITY, BLOCK, generated_sum=self.generated[0], generated_count=self.generated[1])
        self.send(self.gate.observe(snap, now), now)

    def send(self, decisions: list, now: float) -> None:
        for d in decisions:
            if d.outcome.admits:
                self.rules.append(d.ticket.policy)
                self.sched.add_request(str(d.ticket.id), self.prompt(d.ticket), d.ticket.generation, now,
                                       eos_at=self.lengths[d.ticket.id])

    @staticmethod
    def prompt(ticket: Ticket) -> int:
        return ticket.tokens - ticket.generation

    def go(self, workload: list[tuple[int, int, int]], max_steps: int = 20_000) -> int:
        """Offer (prompt, max_tokens, true length) requests, all at once; run until done; the preemptions."""
        now = 0.0
        self.scrape(now)
        for prompt, limit, length in workload:
            ticket = Ticket(model="m", arrived=now, tokens=prompt + limit, generation=limit)
            self.lengths[ticket.id] = length
            self.tickets[ticket.id] = ticket
            decision = self.gate.arrive(ticket, now)
            assert decision.outcome in (Outcome.ADMITTED, Outcome.PARKED)
            self.send([decision], now)
        for _ in range(max_steps):
            if not self.sched.has_unfinished and not self.gate.queue_depth:
                self.makespan = now
                return self.sched.num_preemptions
            _, out = self.sched.step(now)
            now = out.end_time
            self.peak_running = max(self.peak_running, len(self.sched.running))
            for f in out.finished:
                self.generated = (self.generated[0] + f.num_generation_tokens, self.generated[1] + 1)
                self.send(self.gate.finish(self.tickets[int(f.request_id)], now), now)
            self.scrape(now)
        raise AssertionError("the workload did not drain")


REQUEST = st.tuples(st.integers(1, 40), st.integers(1, 200), st.floats(0.0, 1.0)).map(
    lambda r: (r[0], r[1], max(1, math.ceil(r[1] * r[2]))))


@settings(max_examples=60, deadline=None)
@given(st.lists(REQUEST, min_size=1, max_size=24))
def test_a_projection_that_is_always_right_never_preempts(workload: list[tuple[int, int, int]]) -> None:
    run = Run(PROJECTED)
    assert run.go(workload) == 0


def _long_tail(seed: int, n: int = 24) -> list[tuple[int, int, int]]:
    """Chat-like requests: max_tokens 200, most end early, a few run to the limit."""
    rng = random.Random(seed)
    return [(rng.randint(8, 40), 200, 200 if rng.random() < 0.25 else rng.randint(5, 60)) for _ in range(n)]


def test_a_projection_that_understates_lengths_does_preempt() -> None:
    """The negative control: the same harness CAN see a preemption, so the test above can fail."""
    preempted = [Run(PROJECTED, scale=0.3).go(_long_tail(seed)) for seed in range(5)]
    assert sum(preempted) > 0


def test_projected_runs_more_requests_at_once_than_strict_with_no_preemption() -> None:
    workload = _long_tail(0)
    strict, projected = Run(STRICT), Run(PROJECTED)
    assert (strict.go(workload), projected.go(list(workload))) == (0, 0)
    assert projected.peak_running > strict.peak_running
    assert "projected" in projected.rules and set(strict.rules) == {""}


def test_without_a_prefill_rate_the_projected_policy_keeps_the_strict_budget() -> None:
    gate = EngineGate(PROJECTED)
    gate.observe(EngineSnapshot(0, 0, 0.0, 0.0, CAPACITY, BLOCK), 0.0)
    admitted = [gate.arrive(Ticket(model="m", arrived=0.0, tokens=100, generation=90), 0.0) for _ in range(4)]
    assert [d.outcome for d in admitted] == [Outcome.ADMITTED] * 3 + [Outcome.PARKED]  # 3 x 100 of 320
    assert {d.ticket.policy for d in admitted[:3]} == {"cold"}


def _measured(gate: EngineGate, rate: float, hits: float = 0.0, queries: float = 0.0) -> None:
    """Scrapes in which the engine's KV grows by `rate` tokens a second with nothing finishing: the
    gate's prefill-rate measurement (gate.py, "Waits from work"); prefix counters as given."""
    for i in range(10):
        gate.observe(EngineSnapshot(1, 0, min(1.0, i * rate / CAPACITY / 100), i / 100, CAPACITY, BLOCK,
                                    generated_count=0.0, generated_sum=0.0,
                                    prefix_hits=hits * i, prefix_queries=queries * i), i / 100)


def test_a_dear_preemption_keeps_the_strict_budget_and_a_cheap_one_is_projected() -> None:
    dear = EngineGate(replace(PROJECTED, preemption_max_cost_seconds=0.5))
    _measured(dear, 100.0)
    ticket = Ticket(model="m", arrived=1.0, tokens=100, generation=90)
    assert dear.preemption_price(ticket) == 1.0  # 100 tokens of context at 100 tokens/s, no prefix hits
    assert dear.arrive(ticket, 1.0).ticket.policy == "price"
    cheap = EngineGate(replace(PROJECTED, preemption_max_cost_seconds=2.0))
    _measured(cheap, 100.0)
    assert cheap.arrive(replace(ticket, id=ticket.id + 1), 1.0).ticket.policy == "projected"


def test_prefix_cache_hits_lower_the_price_and_an_engine_without_them_pays_in_full() -> None:
    cached = EngineGate(PROJECTED)
    _measured(cached, 100.0, hits=750.0, queries=1_000.0)
    legacy = EngineGate(PROJECTED)
    _measured(legacy, 100.0)  # vLLM 0.11 / no prefix cache: no lookups
    ticket = Ticket(model="m", arrived=1.0, tokens=100, generation=90)
    assert cached.prefix_hit_rate == 0.75 and legacy.prefix_hit_rate == 0.0
    assert math.isclose(cached.preemption_price(ticket) or 0.0, 0.25)
    assert legacy.preemption_price(ticket) == 1.0


def test_the_ledger_carries_the_learned_lengths_hit_rate_and_preemptions() -> None:
    gate = EngineGate(PROJECTED)
    buckets = ((10.0, 0.0), (100.0, 0.0), (math.inf, 0.0))
    gate.observe(EngineSnapshot(1, 0, 0.1, 0.0, CAPACITY, BLOCK, generated_buckets=buckets, prefix_hits=0.0,
                                prefix_queries=0.0, preemptions=0.0), 0.0)
    later = ((10.0, 3.0), (100.0, 5.0), (math.inf, 6.0))
    gate.observe(EngineSnapshot(1, 0, 0.1, 1.0, CAPACITY, BLOCK, generated_buckets=later, prefix_hits=30.0,
                                prefix_queries=40.0, preemptions=2.0), 1.0)
    ticket = gate.arrive(Ticket(model="m", arrived=1.0, tokens=60, generation=50), 1.0).ticket
    rebuilt = EngineGate.from_state(PROJECTED, json.loads(json.dumps(gate.to_state())))
    assert rebuilt.to_state() == gate.to_state()
    assert (rebuilt.prefix_hit_rate, rebuilt.preempted) == (0.75, 2.0)
    assert rebuilt.length_model() == gate.length_model() and rebuilt.find(ticket.id).policy == ticket.policy


def test_what_the_progress_estimate_misses_is_not_charged_twice() -> None:
    """Unknown decode rate: the projection takes the open request as having generated nothing (and
    running to its limit); the 150 tokens the scrape shows it has generated must not ALSO count as
    others' use, or a request that fits is parked."""
    gate = EngineGate(PROJECTED)
    _measured(gate, 100.0)  # a prefill rate, no decode rate
    first = gate.arrive(Ticket(model="m", arrived=1.0, tokens=220, generation=200), 1.0)
    assert first.ticket.policy == "projected"
    gate.observe(EngineSnapshot(1, 0, (20 + 150) / CAPACITY, 5.0, CAPACITY, BLOCK, generated_count=0.0,
                                generated_sum=0.0), 5.0)
    second = gate.arrive(Ticket(model="m", arrived=5.0, tokens=80, generation=60), 5.0)
    assert (second.outcome, second.ticket.policy) == (Outcome.ADMITTED, "projected")


def test_the_first_finished_request_gives_the_prefill_and_decode_rates_without_eight_busy_intervals() -> None:
    """One request finishes between two scrapes: the engine's own per-request histograms (its prompt
    tokens, prefill and decode seconds, generated tokens) price the next candidate at once, where the
    KV-growth measurement (eight busy intervals with no finish) has nothing yet."""
    gate = EngineGate(PROJECTED)
    gate.observe(EngineSnapshot(1, 0, 0.1, 0.0, CAPACITY, BLOCK, generated_sum=0.0, generated_count=0.0,
                                prompt_sum=0.0, prefill_time_sum=0.0, decode_time_sum=0.0), 0.0)
    gate.observe(EngineSnapshot(0, 0, 0.0, 1.0, CAPACITY, BLOCK, generated_sum=41.0, generated_count=1.0,
                                prompt_sum=200.0, prefill_time_sum=2.0, decode_time_sum=4.0), 1.0)
    assert gate.throughput_bound() is None  # the KV-growth peak is still unmeasured
    assert gate.prefill_rate() == 100.0  # 200 prompt tokens in 2 s of prefill
    ticket = Ticket(model="m", arrived=1.0, tokens=100, generation=90)
    assert gate.preemption_price(ticket) == 1.0  # 100 tokens of context at 100 tokens/s
    assert gate.arrive(ticket, 1.0).ticket.policy == "projected"  # not "cold"
    rebuilt = EngineGate.from_state(PROJECTED, json.loads(json.dumps(gate.to_state())))
    assert rebuilt.prefill_rate() == 100.0 and rebuilt.to_state() == gate.to_state()


def test_the_direct_rates_start_again_on_an_engine_of_another_capacity() -> None:
    gate = EngineGate(PROJECTED)
    gate.observe(EngineSnapshot(1, 0, 0.1, 0.0, CAPACITY, BLOCK, generated_sum=0.0, generated_count=0.0,
                                prompt_sum=0.0, prefill_time_sum=0.0, decode_time_sum=0.0), 0.0)
    gate.observe(EngineSnapshot(0, 0, 0.0, 1.0, CAPACITY, BLOCK, generated_sum=41.0, generated_count=1.0,
                                prompt_sum=200.0, prefill_time_sum=2.0, decode_time_sum=4.0), 1.0)
    gate.observe(EngineSnapshot(0, 0, 0.0, 2.0, 2 * CAPACITY, BLOCK, generated_sum=0.0, generated_count=0.0,
                                prompt_sum=0.0, prefill_time_sum=0.0, decode_time_sum=0.0), 2.0)
    assert gate.prefill_rate() is None
