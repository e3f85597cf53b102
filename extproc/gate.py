"""The admission decision core for one engine: pure, synchronous, no IO; time is passed in.

Rules (DESIGN.md "Admission semantics"):
- The gate is closed while the engine's KV usage >= the threshold, or while its load
  (running + waiting) >= max in-flight. Closed means park; open means admit.
- Parked requests form one FIFO per engine. A new arrival never overtakes the queue, except
  by backfill (below).
- The park is bounded twice: by length (`max_queue_depth`; the next arrival is rejected at
  once) and by time (`max_park_seconds`; then the request is rejected with Retry-After).
- Engine state that is unknown (no successful poll yet) or stale (`stale_after_polls`
  consecutive failed polls) fails OPEN: everything is admitted, parked requests included.

With `local_accounting` (the default; the reference gate ran without it) the load is corrected
for what the last scrape could not know. The engine's gauges lag: vLLM adds an arriving request
to its scheduler at the start of a step and publishes the gauges at the end of the next one, so
with 2048-token prefill chunks at ~525 tok/s a request can be invisible for ~8 s. So:

    load = others + len(ours open)

Every request of ours whose stream is open counts exactly once, however late the gauge shows it.
`others` is what the scrape shows that our requests cannot explain (callers that bypass this
gate, other replicas): the scrape minus our requests it includes. Ours admitted more than `grace`
before the scrape began are in it, and so is every one admitted before the scrape that has
finished since (it no longer loads the engine whether or not the scrape caught it, so it must not
keep a slot). Ours admitted within the grace and still open may or may not be in it, so the
scrape bounds `others` between two readings, all of them in it (low) or none (high), and the
gate takes the value closest to the previous scrape's `others`: callers that bypass the gate
are a steady load or none at all. In front of an engine nobody else calls that is 0, the low
reading, and never counts a request of ours twice; with a steady bypassing load it is the high
reading, and one of ours the scrape missed never hides one of theirs. Only a change of the
bypassing load within the grace can be misread, by at most the requests we admitted in it,
until the next scrape.

KV-token budget (`kv_budget`, needs local accounting). The KV gauge lags: a 65k-token prompt
admitted at 0% fills the cache over its whole prefill. So every admitted request reserves its
estimated cost (prompt + generation allowance, rounded up to blocks) until its stream ends, and a
request is admitted only if its cost fits:

    available = capacity - others - reserved
    others    = max(0, used - reserved_seen)    # usage this replica's requests cannot explain

`used` is the last scrape's KV usage x capacity; `reserved` is what this replica holds now;
`reserved_seen` is what it had reserved for the requests the scrape is taken to include. Here
the rule is cautious, since over-admitting KV costs a preemption: an open request of ours counts
as included only if it was admitted more than `grace` before the scrape began (until then its
allocation, if the scrape shows it, is charged twice, to others and to its reservation); every
finished one counts as included, so its reservation is free at once. Our own requests' allocation
is inside their reservation, so only the rest of the observed usage is charged again. With one
gate in front of an engine this is an exact budget (given the estimates); with several
independent gates each one's unallocated reservations are invisible to the others until they
show in the gauge, so the cap is soft, as the reference design accepted. A request whose cost
exceeds the whole capacity can never fit: it is rejected at once instead of parked.

Invariant (work conservation): a request of ours that finishes frees its slot and its KV
reservation at once in every term, so a parked request is released by the very event that gives
the engine room, never at the next poll. In front of an engine that nobody else calls, the
gate's load equals the engine's after every event whatever the gauge's lag, and so does its free
KV when the gauge shows a request `grace` after its admission; with a shorter lag the only excess
is the KV of our open requests admitted within the grace that the scrape did show, until each of
them ends (`tests/unit/test_gate_work_conservation.py`). The price: a request of ours that
finished before the engine ever showed it is taken as seen, which, where callers bypass the gate,
can hide one of theirs until the next scrape.

Engine requests: a ticket counts the engine requests it becomes (`Ticket.requests`: n, or
best_of, times the prompts of a completion batch; vLLM runs each as a request of its own), in
the load, in what the scrape explains (`others`), and against the limit, so `n: 16` takes 16
slots. A request with more than the whole limit (max in-flight + engine queue slots) goes in
ALONE: it waits in the FIFO until the gate's load is 0 and holds the engine to itself until it
ends, so it never puts more than the limit in the engine beside other work; while callers that
bypass the gate keep the engine busy it waits, up to its park cap. (vLLM serves it in waves of
max-num-seqs; rejecting it would refuse what the engine can serve.)

Engine done, stream open: the ext_proc stream ends when the HTTP stream does, so a client that
reads slowly or never keeps its ticket open long after the engine finished generating. A scrape
that began `engine_done_after` (`ADMISSION_ENGINE_DONE_AFTER_SECONDS`, at least the grace) after
an admission must show that request if the engine still runs it, so

    engine_done = max(0, engine requests of our open tickets admitted before that - (running + waiting))

of them are surely finished (whatever `others` is: it is never negative), and hold no slot:
`load = others + ours - engine_done`. Which ones the scrape does not say: the KV freed with them
is that of the smallest reservations among those tickets (never more than the finished ones
held), and it is taken out of both the reservations and what the scrape is taken to include. It
is a function of the held scrape and the open tickets, recomputed as they change: when one of
those tickets ends, `engine_done` drops with it (it may have been one of the finished ones), so a
finish never frees a slot twice; if it was one the engine still ran, its slot stays taken until
the next scrape (the cautious side). The bound: a slot outlives the engine's work by at most
max(0, admission + engine_done_after - engine finish) + one poll interval + the scrape's own
time, as long as the engine's gauges show a request within `engine_done_after` of its
admission (vLLM: a few seconds in steady state, ~18 s at cold start; raise the setting where
the gauge lags more). Requests of ours admitted later than that which the scrape shows can
mask as many finished ones until they are old enough themselves.

Engine queue slots (`engine_queue_slots`, only with the budget): a request released by the gate
reaches the engine after a gateway round trip, and vLLM adds it at the start of its next step;
by then the step that freed the slot has already begun without it, so the slot idles for one
step (seconds during long prefills). Letting a request wait inside the engine beyond max
in-flight refills a freed slot at the engine's very next step. The budget has already reserved
the waiting request's KV, so this cannot cause a preemption.

Head-of-line policy: when the head is blocked by the KV budget alone (it has a slot, but not
enough free KV), a later request may be admitted ahead of it (backfill) if it fits now AND the
head would still fit once the largest reservation in flight is released, with the backfilled
request still running: so backfill never uses the KV the head is waiting for. The head's own
wait is bounded by the park cap; backfill stops once it has waited `BACKFILL_PATIENCE` of it.

Shared ledger (several replicas in front of one engine, `extproc/ledger.py`): the whole state of
this class serialises (`to_state` / `from_state`), and a store that runs every event as an atomic
read-modify-write of that state makes N replicas decide exactly as one gate would for the same
sequence of events. For that the class also knows which replica owns each ticket (`owner`) and
until when that replica has vouched for it (`lease_until`): `purge_expired` drops the tickets of
a replica that stopped renewing (it died), without counting them as finished, so a request of a
dead replica that is still running at the engine is charged to `others` by the next scrape.

Generation reservation (`generation_reservation`, with the budget). vLLM checks (from 0.19) that
a prompt fits before starting it, not that its generation will: a request that decodes past
the free KV forces a preemption. So by default a request reserves its whole generation limit
(`max_tokens`). With `learned`, it reserves min(its limit, `generation_factor` x the mean
generation of the requests the engine finished recently), the mean read from the engine's own
`vllm:request_generation_tokens` histogram (sum and count between two scrapes, smoothed); until
the engine has finished any request it reserves the limit. This admits more requests at once
when generations end well before their limits, at the risk of a preemption when several run
long together: bench/README.md, "Generation reservation", measures both.

Projected policy (`policy="projected"`, with the budget; "strict" is everything above). A request
fits when a slot is free (as above) AND

    others' + projected_peak(open + candidate) <= capacity

`projected_peak` (extproc/projection.py) is the peak KV the open tickets reach as they decode: each
holds prompt + generated now and grows one token per engine step to its final length, the
`projection_quantile` of the engine's generation-length distribution (the histogram's buckets, what
finished between scrapes, smoothed like the mean) given its progress and capped by its limit, then
frees all. Progress: from the admission time, the prompt at the prefill rate (`prefill_rate`: the
engine's own per-request figure, prompt tokens over prefill seconds of the requests it finished,
from its histograms; the peak KV growth before any finished), then the slowest of the measured
decode rates (`decode_rates`, and the per-request figure from the same histograms); unknown rates
take it as having generated nothing and running to its limit. `others'` is the scrape's KV use that
our open tickets' prompt + generated AT THE SCRAPE cannot explain (those the grace says it surely
shows; finished ones by their reservation, as above). Tickets the engine has finished ("Engine
done, stream open") leave the projection, the smallest reservations first. A candidate whose
preemption would be dear keeps the strict budget: vLLM preempts the most recently scheduled
request, the candidate, and recomputes its context, so the price is (prompt + projected generation)
x (1 - prefix hit rate) / prefill rate; above `preemption_max_cost_seconds`, or with no prefill
rate yet, the candidate must fit `capacity - others - reserved` (the strict rule: `Ticket.policy`
says which rule admitted it). Reservations are still kept (the strict cost) for the strict rule,
backfill, the wait predictions and the shared ledger. Backfill under the projection: the candidate
fits and the head would still fit beside it once the open request with the largest final holding
ends.

Retry-After comes from the measured completion rate of this gate's admitted requests: a request
at queue position p expects to wait p / rate. When that already exceeds `ESTIMATE_MARGIN` (2)
park caps, it is rejected at once with that Retry-After instead of being held for the whole cap
(an estimate: the margin, as for the expected wait below).

Waits from work (`wait_estimates`, with the budget). A rate guess must not turn a request away
that would have been served in time, so the budget also computes a LOWER BOUND on the wait
(`wait_bound`), and a request whose bound already runs past its park deadline is answered at
once (`expected_wait_too_long`, Retry-After = the bound): on arrival, and for every parked
request on each scrape, when the bound or the throughput behind it changes.

- What must happen first. A request is admitted only if its cost fits `capacity - others -
  reserved` and a slot is free (`fits`), so at least `reserved + cost - capacity` tokens of the
  reservations held NOW must be released (`others` >= 0 only adds), and at least `inflight + 1 -
  (max_inflight + engine_queue_slots)` of our open requests must end. Parked requests ahead do
  NOT count: one may leave (its park cap, its client) or be passed by backfill, and then the
  request behind it needs only what is held now; a bound that counted them would be no bound.
- Work. A reservation is released when its request ends, which needs at least the rest of its
  prompt processed (generation may stop after one token: only the prompt is certain). A ticket
  admitted t seconds ago has had at most `rate x t` of its prompt processed, and all of them
  together at most `rate x` (time since the oldest admission). The least prompt work that frees
  the tokens (and ends the requests) needed is bounded below by the fractional knapsack: take
  the cheapest work per released token first (`_WorkAhead`); both per-ticket and total caps give
  a bound, the larger is used.
- Throughput, an UPPER bound. Prompt counters (`prompt_tokens_total`) grow only when a prefill
  completes (a 65k prompt shows nothing for minutes), but KV usage grows chunk by chunk while it
  runs. So the gate measures the KV growth between consecutive scrapes in which the engine was
  busy (running + waiting > 0 at both ends) and nothing finished (the engine's finished-request
  count did not move, else none of ours ended): growth over time across `RATE_INTERVALS` such
  intervals is one measurement, and the highest ever seen (reset when the capacity changes or the
  engine's counters go back) times `RATE_MARGIN` is the bound. Decode and idle moments only lower
  a measurement, so the peak comes from prefill; step quantisation (a step longer than a poll)
  only raises it. Until the first measurement there is no bound and nothing is rejected early
  (cold start, as before). Residual risks, both on the side of a bound too high: a first
  measurement taken while the engine was mostly decoding (the margin covers a 2x shortfall), and
  preemptions (they free KV mid-interval); `admission_wait_bound_violations_total` counts every
  parked request admitted sooner than its bound said.
- The completion-rate estimate above still turns an arrival away when position / rate exceeds
  twice the cap (it is an estimate, not a bound); the bound adds the early answers it can prove, and
  is the only rule that answers a request already parked.

Expected waits (`wait_prediction="expected"`, the default; "bound" keeps the bound alone). The
bound never turns away a request the engine could serve in time, and for that reason answers
almost nothing early: the waits of long-prompt traffic are made of decode and of requests ahead,
which a lower bound may not count. The expected wait counts them, and can be wrong both ways
(bench/README.md, "Expected waits", measures what that costs). It runs the engine forward as a
fluid model, `_FluidEngine`:
- Jobs: our open requests, oldest admission first, each with its prompt (`tokens - generation`)
  and its expected generation (the engine's recent mean per finished request, `generation_mean`,
  at most its `max_tokens`; ONE token until a mean is known: `max_tokens` is a cap, not an
  expectation, and taking it turned away 5 of 10 chats on the real engine at 13-22 s, with 299-357
  s predicted, in a run whose admitted chats had all ended by 111 s). The first `max_inflight` run (the
  engine's max-num-seqs); of those, the first with prompt left prefills at the peak measured KV
  growth (the bound's throughput without its margin; one prefill at a time, in order), and the
  others generate, each at the measured decode rate WITH a prefill beside them (one token per
  long chunked-prefill step) or WITHOUT one.
- The past: the open requests' progress is not reported per request, so the model runs them from
  their admission times to now as if the engine had worked for them alone; one the model says
  has already ended is taken to end now (the side of a shorter wait).
- The future: parked requests join in FIFO order (requests ahead included: they are expected to
  be admitted first) as soon as they `fit` the model's free KV (the budget's `available` now, plus
  what the model's ended jobs release) and a slot (max in-flight + engine queue slots, from the
  effective load now); the time at which a request joins is its expected wait. Backfill and the
  KV threshold are left out (both only shorten waits or are covered by the budget); requests the
  engine serves for others keep their KV and slots throughout.
- Decode rates: in each busy interval the bound measures (no finish in it), the generation
  counter's growth per decoding request-second; an interval whose KV grew by more than its
  generation (beyond block rounding) had a prefill beside the decode (`running - 1` decoding),
  else none did; one in which nothing was generated is not measured (the running requests were
  all prefilling or waiting for a prefill, which says nothing about decode). Each rate is the
  mean of its last `RATE_INTERVALS` intervals; an unmeasured rate without a prefill is taken as
  instant, and one with a prefill as the rate without (both the side of a shorter wait).
- A request whose expected wait (from its arrival) runs past `ESTIMATE_MARGIN` (2) park caps is
  answered `expected_wait_too_long` with Retry-After = the wait, on arrival and at each scrape for
  parked ones (head first; each answer is taken out of the model before the next request is
  judged); one expected between one and two caps parks and meets its cap (`park_timeout`) if the
  prediction was right. The margin is the prediction's measured error: on the real engine
  (real-decode-eos, a loaded 2-core machine) one request predicted 319 s after arrival would have
  been admitted by 242 s (1.32x), and the errors of the admitted ones ranged -113 s to +185 s
  (bench/README.md, "Honest predictions"). Cold start (no prefill rate measured yet): no
  prediction, no early answer.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
import math
import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import astuple, dataclass, field
from typing import Any

from .outcomes import Outcome
from .projection import (
    Buckets,
    HistogramLength,
    Holding,
    LengthModel,
    LimitLength,
    Progress,
    estimate_progress,
    histogram_delta,
    projected_peak,
    smooth_histogram,
)
from .rates import rate_until_now

DEFAULT_BLOCK_SIZE = 16
RETRY_AFTER_MIN_SECONDS = 1
RETRY_AFTER_MAX_SECONDS = 60
RATE_WINDOW = 32  # completions kept to measure the completion rate
GENERATION_WINDOW = 32  # finished requests the generation mean is smoothed over
#: Fraction of the park cap after which a KV-blocked head is no longer bypassed by backfill.
BACKFILL_PATIENCE = 0.5
#: Busy scrape intervals one throughput measurement spans (module docstring, "Waits from work").
RATE_INTERVALS = 8
#: The wait bound divides by the peak measured throughput times this.
RATE_MARGIN = 2.0
#: An estimate of a wait (the expected wait, the completion rate) answers a request early only when
#: it exceeds the park cap this many times (module docstring, "Expected waits": measured errors).
ESTIMATE_MARGIN = 2.0
#: Tokens a request is expected to generate before the engine has finished any (module docstring,
#: "Expected waits"): its limit is a cap, not an expectation, so only the first token is counted.
UNKNOWN_GENERATION = 1


@dataclass(frozen=True)
class GateLimits:
    """One engine's limits, built from the validated settings (`admission.gate_limits`); no defaults
    here, so the settings table is the one place a default lives."""

    max_inflight: int
    kv_threshold: float
    max_queue_depth: int
    max_park_seconds: float
    stale_after_polls: int
    local_accounting: bool
    scrape_grace_seconds: float
    engine_done_after_seconds: float  # a scrape this long after an admission must show the request (module docstring)
    kv_budget: bool
    kv_capacity_override: int | None  # tokens, when the engine does not say
    backfill: bool
    retry_after_seconds: int  # fallback when no completion rate is known yet
    engine_queue_slots: int  # with the budget: requests allowed to wait inside the engine
    wait_estimates: bool  # Retry-After from the completion rate; early rejection
    generation_reservation: str  # "max_tokens", or "learned": factor x the engine's mean generation
    generation_factor: float
    wait_prediction: str  # with wait_estimates: "bound" (a lower bound) or "expected" (module docstring)
    policy: str  # with the budget: "strict" (reservations) or "projected" (module docstring, "Projected policy")
    projection_quantile: float  # with projected: the generation-length quantile
    preemption_max_cost_seconds: float  # with projected: above this recompute price, the strict budget


@dataclass(frozen=True)
class EngineSnapshot:
    """One successful scrape of the engine's gauges, aggregated over its ranks."""

    running: int
    waiting: int
    kv_usage: float  # fraction 0..1
    scrape_started: float  # clock time at which the scrape request was sent
    capacity_tokens: int | None = None
    block_size: int | None = None
    # The engine's counters (what it has done), for throughput and calibration; None if absent.
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    generated_sum: float | None = None  # tokens generated by finished requests
    generated_count: float | None = None  # finished requests
    generated_buckets: Buckets | None = None  # their generation lengths: cumulative (bound, count)
    prefix_hits: float | None = None  # prompt tokens found in the prefix cache
    prefix_queries: float | None = None  # prompt tokens looked up in it
    preemptions: float | None = None  # requests the engine preempted
    prompt_sum: float | None = None  # prompt tokens of finished requests
    prefill_time_sum: float | None = None  # seconds those requests spent prefilling
    decode_time_sum: float | None = None  # ...and decoding


class EngineState(enum.StrEnum):
    UNKNOWN = "unknown"  # no successful poll yet
    FRESH = "fresh"
    STALE = "stale"


class TicketState(enum.StrEnum):
    NEW = "new"
    PARKED = "parked"
    ADMITTED = "admitted"
    DONE = "done"


# Ticket ids are unique across replicas sharing a ledger: a random 48-bit start per process.
_ids = itertools.count(int.from_bytes(os.urandom(6), "big") << 14)


@dataclass(eq=False)
class Ticket:
    """One gated request's place in the gate."""

    model: str
    arrived: float
    tokens: int = 0  # estimated KV need (prompt + generation allowance), before block rounding
    generation: int = 0  # the generation allowance within `tokens` (its max_tokens or the default)
    requests: int = 1  # engine requests it becomes: n (or best_of) x prompts in a batch; each takes a slot
    id: int = field(default_factory=lambda: next(_ids))
    state: TicketState = TicketState.NEW
    park_deadline: float | None = None
    admitted_at: float | None = None
    counted: bool = False  # whether this ticket is in the local ledger (admitted while gated)
    reserved: int = 0  # KV tokens reserved while admitted (block-rounded `tokens`)
    backfilled: bool = False
    owner: str = ""  # the replica that holds the request's stream (shared ledger)
    lease_until: float | None = None  # the owner vouches for the ticket until then (None: forever)
    # While parked: the first wait bound it got, as seconds from arrival (None: none yet).
    predicted_wait: float | None = None
    # Which rule admitted it (projected policy): "strict", "projected", "price" (a dear preemption kept
    # the strict budget) or "cold" (no prefill rate yet: strict); "" when not admitted by the budget.
    policy: str = ""

    def to_state(self) -> dict[str, Any]:
        return {"m": self.model, "a": self.arrived, "t": self.tokens, "g": self.generation, "n": self.requests,
                "i": self.id,
                "s": self.state.value,
                "d": self.park_deadline, "at": self.admitted_at, "c": self.counted, "r": self.reserved,
                "b": self.backfilled, "o": self.owner, "l": self.lease_until, "pw": self.predicted_wait,
                "p": self.policy}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> Ticket:
        return cls(model=d["m"], arrived=d["a"], tokens=d["t"], generation=d.get("g", 0), requests=d.get("n", 1),
                   id=d["i"],
                   state=TicketState(d["s"]),
                   park_deadline=d["d"], admitted_at=d["at"], counted=d["c"], reserved=d["r"],
                   backfilled=d["b"], owner=d["o"], lease_until=d["l"], predicted_wait=d.get("pw"),
                   policy=d.get("p", ""))

    def __repr__(self) -> str:
        return f"<Ticket #{self.id} {self.model} {self.state} {self.tokens}t x{self.requests}>"


@dataclass(frozen=True)
class Decision:
    ticket: Ticket
    outcome: Outcome
    retry_after: int | None = None  # seconds, for rejections the client should retry
    # The wait bound behind a park, or behind an early answer that it proved (None: the completion
    # rate's estimate turned it away, or there was no bound).
    predicted_wait: float | None = None


@dataclass(frozen=True)
class _Finished:
    admitted_at: float
    finished_at: float
    reserved: int
    owner: str = ""
    requests: int = 1


@dataclass
class _Seen:
    """Our tickets as one scrape (`snap`) saw them (`EngineGate._ours_in_scrape`)."""

    snap: EngineSnapshot
    seen_before: float  # the scrape's start minus the grace
    surely: int = 0  # engine requests (a ticket counts its `requests`)
    maybe: int = 0
    reserved: int = 0  # KV of those surely seen

    def add_open(self, admitted_at: float | None, reserved: int, requests: int, sign: int) -> None:
        """Count an open ticket in (sign 1) or out (-1)."""
        if admitted_at is None or admitted_at >= self.snap.scrape_started:
            return
        if admitted_at < self.seen_before:
            self.surely += sign * requests
            self.reserved += sign * reserved
        else:
            self.maybe += sign * requests

    def add_finished(self, admitted_at: float, reserved: int, requests: int) -> None:
        if admitted_at < self.snap.scrape_started:
            self.surely += requests
            self.reserved += reserved


class EngineGate:
    """FIFO admission for one engine. Every method returns the decisions it made."""

    def __init__(self, limits: GateLimits, *, lengths: LengthModel | None = None,
                 progress: Callable[[Ticket, float], Progress] | None = None) -> None:
        """`lengths` and `progress` replace the projected policy's models learned from the engine (tests:
        an oracle that knows each request's length, progress read from the engine itself)."""
        self.limits = limits
        self._budgeting = limits.kv_budget and limits.local_accounting
        self._projecting = self._budgeting and limits.policy == "projected"
        self._lengths = lengths
        self._progress_of = progress
        self._length_hist: HistogramLength | None = None  # the engine's smoothed generation-length distribution
        self._hit_rate: float | None = None  # smoothed prefix-cache hit rate (tokens found / looked up)
        self._preempted = 0.0  # preemptions the engine counted between the last two scrapes
        # Per-request rates from the engine's own histograms of finished requests (`_learn_rates`).
        self._prefill_direct: float | None = None  # prompt tokens per second of prefill time
        self._decode_direct: float | None = None  # tokens per second of decode time, one request
        self._snapshot: EngineSnapshot | None = None
        self._failed_polls = 0
        self._queue: deque[Ticket] = deque()
        self._inflight: dict[int, Ticket] = {}  # by id: admitted by this replica, stream still open
        self._finished: list[_Finished] = []  # local tickets that finished after the last scrape began
        # Kept as tickets come and go, so a decision costs the same with 10 or 1,000 requests open:
        self._reserved = 0  # sum of the open tickets' reservations
        self._requests = 0  # sum of the open tickets' engine requests
        self._old_requests = 0  # of those, the tickets admitted before `_done_cut()` ("Engine done, stream open")
        self._seen: _Seen | None = None  # `_count_seen(snapshot)`, while that snapshot is held
        self._completions: deque[float] = deque(maxlen=RATE_WINDOW)
        self._others_before = 0  # `others` as the previous scrape left it, when the next one came
        self._generation_mean: float | None = None  # smoothed mean generation of finished requests
        self._busy: deque[tuple[float, float]] = deque(maxlen=RATE_INTERVALS)  # (KV growth, seconds)
        self._peak_rate: float | None = None  # highest measured KV growth, tokens per second
        # Generation while a prefill runs beside it, and without one: (tokens, decoding request-seconds).
        self._decode_mixed: deque[tuple[float, float]] = deque(maxlen=RATE_INTERVALS)
        self._decode_alone: deque[tuple[float, float]] = deque(maxlen=RATE_INTERVALS)

    # --- views ----------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        if self._failed_polls >= self.limits.stale_after_polls:
            return EngineState.STALE
        return EngineState.FRESH if self._snapshot is not None else EngineState.UNKNOWN

    @property
    def snapshot(self) -> EngineSnapshot | None:
        return self._snapshot

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def inflight_requests(self) -> int:
        """Engine requests of the open tickets (a ticket with n = 16 counts 16)."""
        return self._requests

    def queued(self) -> tuple[Ticket, ...]:
        return tuple(self._queue)

    def admitted(self) -> tuple[Ticket, ...]:
        """Open admitted tickets, oldest admission first."""
        return tuple(sorted(self._inflight.values(), key=lambda t: (t.admitted_at or 0.0, t.id)))

    def find(self, ticket_id: int) -> Ticket | None:
        """The parked or admitted ticket with this id, if the gate still holds it."""
        ticket = self._inflight.get(ticket_id)
        if ticket is not None:
            return ticket
        for t in self._queue:
            if t.id == ticket_id:
                return t
        return None

    @property
    def capacity_tokens(self) -> int | None:
        """KV capacity in tokens: the engine's own figure, else the configured override."""
        snap = self._snapshot
        if snap is not None and snap.capacity_tokens:
            return snap.capacity_tokens
        return self.limits.kv_capacity_override

    @property
    def block_size(self) -> int:
        snap = self._snapshot
        return snap.block_size if snap is not None and snap.block_size else DEFAULT_BLOCK_SIZE

    @property
    def reserved_tokens(self) -> int:
        return self._reserved

    @property
    def generation_mean(self) -> float | None:
        """The engine's recent mean generation per finished request, or None before any."""
        return self._generation_mean

    def completion_rate_until(self, now: float, window: float) -> float:
        """Completions per second over the `window` seconds ending at `now` (0 once they stop)."""
        return rate_until_now(self._completions, now, window, RATE_WINDOW)

    def cost(self, ticket: Ticket) -> int:
        """The ticket's KV reservation: its estimate (with the learned generation, if so
        configured and known) rounded up to whole blocks."""
        tokens = ticket.tokens
        if self.limits.generation_reservation == "learned" and self._generation_mean is not None:
            expected = math.ceil(self.limits.generation_factor * self._generation_mean)
            tokens -= max(0, ticket.generation - expected)
        block = self.block_size
        return math.ceil(tokens / block) * block

    def _ours_in_scrape(self, snap: EngineSnapshot) -> _Seen:
        """Our requests the scrape surely includes, those it may include, and the KV of the first.

        Surely: open ones admitted more than `grace` before the scrape began, and every one
        admitted before it that has finished since. Maybe: open ones admitted within the grace.
        Counted once per snapshot (`_count_seen`), then kept as tickets come and go (`_admit`,
        `_drop_open`, `finish`).
        """
        seen = self._seen
        if seen is None or seen.snap is not snap:
            seen = self._seen = self._count_seen(snap)
        return seen

    def _count_seen(self, snap: EngineSnapshot) -> _Seen:
        seen = _Seen(snap, snap.scrape_started - self.limits.scrape_grace_seconds)
        for t in self._inflight.values():
            seen.add_open(t.admitted_at, t.reserved, t.requests, 1)
        for f in self._finished:  # finished after the scrape began (older ones are dropped on observe)
            seen.add_finished(f.admitted_at, f.reserved, f.requests)
        return seen

    def _forget_counts(self) -> None:
        """The open or finished tickets changed wholesale: count them again."""
        self._reserved = sum(t.reserved for t in self._inflight.values())
        self._requests = sum(t.requests for t in self._inflight.values())
        self._old_requests = sum(t.requests for t in self._inflight.values() if self._is_old(t.admitted_at))
        self._seen = None

    def _others(self) -> int | None:
        """Requests at the engine that ours cannot explain (module docstring), or None."""
        snap = self._snapshot
        if snap is None or self.state is not EngineState.FRESH:
            return None
        seen = self._ours_in_scrape(snap)
        high = max(0, snap.running + snap.waiting - seen.surely)
        return min(high, max(self._others_before, high - seen.maybe))

    def effective_load(self) -> int | None:
        """running + waiting as the gate believes it now, or None without a usable snapshot."""
        snap = self._snapshot
        if snap is None or self.state is not EngineState.FRESH:
            return None
        if not self.limits.local_accounting:
            return snap.running + snap.waiting
        others = self._others()
        assert others is not None
        return others + self._requests - self.engine_done()

    def _done_cut(self) -> float | None:
        """Ours admitted before this the held scrape must show, unless the engine finished them."""
        snap = self._snapshot
        if snap is None or not self.limits.local_accounting:
            return None
        return snap.scrape_started - max(self.limits.engine_done_after_seconds, self.limits.scrape_grace_seconds)

    def _is_old(self, admitted_at: float | None) -> bool:
        cut = self._done_cut()
        return cut is not None and admitted_at is not None and admitted_at < cut

    def engine_done(self) -> int:
        """Engine requests of our open tickets that the engine has finished, as the held scrape
        proves (module docstring, "Engine done, stream open"): they hold no slot."""
        snap = self._snapshot
        if snap is None or self.state is not EngineState.FRESH or not self._old_requests:
            return 0
        return max(0, self._old_requests - snap.running - snap.waiting)

    def _engine_done_tokens(self) -> int:
        """The KV taken as freed with `engine_done`: the smallest reservations of the old tickets that
        make up that many engine requests (whichever of them finished, never more than theirs)."""
        return sum(t.reserved for t in self._engine_done_tickets())

    def _engine_done_tickets(self) -> list[Ticket]:
        """The old tickets taken as finished at the engine: the smallest reservations that make up
        `engine_done` engine requests."""
        credit = self.engine_done()
        if not credit:
            return []
        done: list[Ticket] = []
        for t in sorted((t for t in self._inflight.values() if self._is_old(t.admitted_at)),
                        key=lambda t: (t.reserved, t.id)):
            if t.requests > credit:
                break
            credit -= t.requests
            done.append(t)
        return done

    def available_tokens(self) -> int | None:
        """Free KV tokens for new admissions, or None when the budget does not apply."""
        capacity = self.capacity_tokens
        snap = self._snapshot
        if not self._budgeting or capacity is None or snap is None or self.state is not EngineState.FRESH:
            return None
        done = self._engine_done_tokens()  # no longer held, by the engine or by the scrape's share of ours
        others = max(0.0, snap.kv_usage * capacity - (self._ours_in_scrape(snap).reserved - done))
        return math.floor(capacity - others - (self.reserved_tokens - done))

    @property
    def slot_limit(self) -> int:
        """Engine requests (running + waiting) the gate lets the engine hold: max in-flight, plus the
        engine queue slots with the budget."""
        return self.limits.max_inflight + (self.limits.engine_queue_slots if self._budgeting else 0)

    def _slot_open(self, ticket: Ticket | None = None) -> bool:
        """The reference gates, KV threshold and running + waiting, for `ticket`'s engine requests
        (one without a ticket). A ticket with more than the whole limit goes in alone: only while
        the gate's load is 0 (module docstring, "Engine requests")."""
        if self.state is not EngineState.FRESH:
            return True
        snap = self._snapshot
        assert snap is not None
        load = self.effective_load()
        assert load is not None
        limit, requests = self.slot_limit, 1 if ticket is None else ticket.requests
        room = load + requests <= limit or (requests > limit and load == 0)
        return snap.kv_usage < self.limits.kv_threshold and room

    def fits(self, ticket: Ticket | None = None, now: float | None = None) -> bool:
        """Whether `ticket` (or a zero-cost request) would be admitted now, ignoring the queue."""
        return self._fit_rule(ticket, now) is not None

    def _fit_rule(self, ticket: Ticket | None, now: float | None) -> str | None:
        """The rule by which `ticket` fits now, or None if it does not:
        "strict", or with the projected policy "projected", "price" or "cold" (`Ticket.policy`)."""
        if not self._slot_open(ticket):
            return None
        available = self.available_tokens()
        if available is None or ticket is None:
            return "strict"
        if self._projecting:
            rule = self._projected_rule(ticket)
            if rule == "projected":
                return rule if self._projected_fits([ticket], now) else None
            return rule if self.cost(ticket) <= available else None
        return "strict" if self.cost(ticket) <= available else None

    def is_open(self) -> bool:
        """Whether a request arriving now would be admitted (ignoring the queue and its size)."""
        return self.fits(None)

    def never_fits(self, ticket: Ticket) -> bool:
        """Whether `ticket` needs more KV than the engine has at all."""
        capacity = self.capacity_tokens
        return self._budgeting and capacity is not None and self.cost(ticket) > capacity

    # --- the projected policy (module docstring, "Projected policy") --------------------------

    @property
    def policy(self) -> str:
        """The policy that decides: "projected" only with the budget on."""
        return "projected" if self._projecting else "strict"

    def length_model(self) -> LengthModel:
        """How long generations run: the injected model, the engine's distribution, or the limit."""
        if self._lengths is not None:
            return self._lengths
        return self._length_hist if self._length_hist is not None else LimitLength()

    @property
    def prefix_hit_rate(self) -> float:
        """The engine's recent prefix-cache hit rate; 0 where it has no prefix cache or says nothing."""
        return self._hit_rate or 0.0

    @property
    def preempted(self) -> float:
        """Preemptions the engine counted between the last two scrapes."""
        return self._preempted

    def preemption_price(self, ticket: Ticket) -> float | None:
        """Seconds of recompute a preemption of `ticket` would cost (vLLM preempts the most recently
        scheduled request: the candidate itself), or None without a measured prefill rate."""
        rate = self.prefill_rate()
        if rate is None or rate <= 0:
            return None
        prompt, limit = self._per_request(ticket)
        final = self.length_model().final_length(0, limit, self.limits.projection_quantile, ticket.id)
        context = ticket.requests * (prompt + final)
        return context * (1.0 - self.prefix_hit_rate) / rate

    def _projected_rule(self, ticket: Ticket) -> str:
        """Which budget judges `ticket`: "projected", or "price" (its preemption would cost more than
        the setting) or "cold" (no prefill rate to price it with): the strict budget."""
        price = self.preemption_price(ticket)
        if price is None:
            return "cold"
        return "price" if price > self.limits.preemption_max_cost_seconds else "projected"

    @staticmethod
    def _per_request(ticket: Ticket) -> tuple[int, int]:
        """One engine request's prompt and generation limit (`tokens` covers all of them)."""
        per = ticket.tokens // max(1, ticket.requests)
        return max(0, per - ticket.generation), max(0, ticket.generation)

    def _progress(self, ticket: Ticket, now: float) -> Progress:
        if self._progress_of is not None:
            return self._progress_of(ticket, now)
        prompt, limit = self._per_request(ticket)
        mixed, alone = self.decode_rates()
        known = [r for r in (mixed, alone, self._decode_direct) if r is not None]
        decode = min(known) if known else None  # the slower: less generated, more still to come
        admitted = ticket.admitted_at if ticket.admitted_at is not None else now
        return estimate_progress(max(0.0, now - admitted), prompt, limit, self.prefill_rate(), decode)

    def _holding(self, ticket: Ticket, now: float) -> Holding:
        prompt, limit = self._per_request(ticket)
        progress = self._progress(ticket, now)
        generated = min(progress.generated, limit)
        final = (self.length_model().final_length(generated, limit, self.limits.projection_quantile, ticket.id)
                 if progress.known else limit)
        return Holding(prompt + generated, max(0, final - generated) + progress.lag, ticket.requests)

    def _projected_open(self) -> list[Ticket]:
        """The open tickets the projection counts: all but those the engine has finished ("Engine
        done, stream open"), taken as the smallest reservations, as the budget takes them."""
        done = {t.id for t in self._engine_done_tickets()}
        return [t for t in self._inflight.values() if t.id not in done]

    def _projected_others(self) -> float | None:
        """The scrape's KV use our requests cannot explain, our requests' use taken as prompt + the
        MOST they can have generated by the scrape (not their reservations): a progress estimate
        that lags the engine would otherwise charge what it missed twice, to others and again to
        the request's growth in the projection."""
        capacity, snap = self.capacity_tokens, self._snapshot
        if capacity is None or snap is None or self.state is not EngineState.FRESH:
            return None
        block = self.block_size
        seen_before = snap.scrape_started - self.limits.scrape_grace_seconds
        ours = 0
        for t in self._projected_open():
            if t.admitted_at is not None and t.admitted_at < seen_before:
                ours += min(t.reserved, self._most_held(t, snap.scrape_started, block))
        ours += sum(f.reserved for f in self._finished if f.admitted_at < snap.scrape_started)
        return max(0.0, snap.kv_usage * capacity - ours)

    def _most_held(self, ticket: Ticket, at: float, block: int) -> int:
        """The most KV `ticket` can hold at `at`: its prompt plus a token per step since admission at
        the fastest measured decode rate (no prefill time); its reservation when no rate is known."""
        if self._progress_of is not None:
            h = self._holding(ticket, at)
            return h.requests * math.ceil(h.held / block) * block
        prompt, limit = self._per_request(ticket)
        known = [r for r in (*self.decode_rates(), self._decode_direct) if r is not None]
        if not known or ticket.admitted_at is None:
            return ticket.reserved
        generated = min(limit, math.ceil(max(known) * max(0.0, at - ticket.admitted_at)))
        return ticket.requests * math.ceil((prompt + generated) / block) * block

    def projected_peak(self, now: float, extra: Iterable[Ticket] = ()) -> int | None:
        """The peak KV our open requests (and `extra`, as if admitted now) are projected to hold, or
        None where the projected policy does not apply."""
        if not self._projecting or self.state is not EngineState.FRESH:
            return None
        holdings = [self._holding(t, now) for t in self._projected_open()]
        holdings += [self._holding(t, now) for t in extra]
        return projected_peak(holdings, self.block_size)

    def projected_load(self, now: float) -> int | None:
        """`others` plus the projected peak of our open requests: what must stay within the capacity."""
        others, peak = self._projected_others(), self.projected_peak(now)
        return None if others is None or peak is None else math.ceil(others) + peak

    def _projected_fits(self, tickets: list[Ticket], now: float | None, without_largest: bool = False) -> bool:
        """Whether `tickets`, admitted now, keep others + the projected peak within the capacity;
        `without_largest`: once the open request with the largest final holding has ended (the
        projected twin of backfill's largest-reservation rule)."""
        capacity, snap = self.capacity_tokens, self._snapshot
        others = self._projected_others()
        if capacity is None or snap is None or others is None:
            return True
        when = snap.scrape_started if now is None else now
        holdings = [self._holding(t, when) for t in self._projected_open()]
        if without_largest and holdings:
            holdings.remove(max(holdings, key=lambda h: h.requests * (h.held + h.remaining)))
        holdings += [self._holding(t, when) for t in tickets]
        return others + projected_peak(holdings, self.block_size) <= capacity

    def next_deadline(self) -> float | None:
        """The earliest park deadline (the queue is FIFO with one park cap, so it is the head's)."""
        return self._queue[0].park_deadline if self._queue else None

    def completion_rate(self) -> float | None:
        """Completions per second of this gate's admitted requests, over the recent window."""
        if len(self._completions) < 2:
            return None
        span = self._completions[-1] - self._completions[0]
        return (len(self._completions) - 1) / span if span > 0 else None

    def expected_wait(self, position: int) -> float | None:
        """Seconds until a request at queue `position` (1 = head) is likely admitted."""
        if not self.limits.wait_estimates:
            return None
        rate = self.completion_rate()
        return position / rate if rate else None

    def retry_after(self, position: int) -> int:
        """An honest Retry-After for a request turned away at queue `position`."""
        wait = self.expected_wait(position)
        if wait is None:
            return self.limits.retry_after_seconds
        return _clamp_retry_after(wait)

    def throughput_bound(self) -> float | None:
        """Tokens per second the engine is taken never to exceed (peak x margin), or None before a
        measurement."""
        return None if self._peak_rate is None else RATE_MARGIN * self._peak_rate

    def decode_rates(self) -> tuple[float | None, float | None]:
        """Tokens per second one request generates while a prefill runs beside it, and while none
        does, as measured (module docstring, "Expected waits"); None where not measured yet."""
        return _rate(self._decode_mixed), _rate(self._decode_alone)

    def expected_waits(self, now: float, extra: Ticket | None = None) -> dict[int, float] | None:
        """Expected seconds from now until each parked ticket (and `extra`, as if parked last) is
        admitted, by ticket id (module docstring, "Expected waits"); a ticket the simulation never
        admits (others hold the KV it needs) is absent. None where there is no prediction."""
        prefill = self._peak_rate
        available = self.available_tokens()
        load = self.effective_load()
        if (not (self.limits.wait_estimates and self._budgeting) or prefill is None or available is None
                or load is None):
            return None
        mixed, alone = self.decode_rates()
        alone = math.inf if alone is None else alone  # unmeasured: the optimistic side, never a longer wait
        mixed = alone if mixed is None else min(mixed, alone)
        engine = _FluidEngine(self.limits.max_inflight, prefill, mixed, alone)
        # The past: the open tickets' progress as if the engine had worked for them alone, in admission order.
        opened = self.admitted()
        overdue = 0  # tokens held by open tickets the model says have ended (taken to end now)
        limit = self.limits.max_inflight + self.limits.engine_queue_slots
        slots = limit - load
        t = min((tk.admitted_at for tk in opened if tk.admitted_at is not None), default=now)
        for i, tk in enumerate(opened):
            engine.jobs.append(_Job(float(max(0, tk.tokens - tk.generation)), self._expected_generation(tk),
                                    tk.reserved, tk.requests))
            nxt = opened[i + 1].admitted_at if i + 1 < len(opened) else now
            until = min(now, nxt if nxt is not None else now)
            while t < until and engine.jobs:
                t, ended = engine.run(t, until)
                overdue += sum(j.reserved for j in ended)
                slots += sum(j.requests for j in ended)
            t = max(t, until)
        # The future: parked tickets join in FIFO order as soon as they fit (`fits`: KV and slots).
        free, t = available + overdue, now
        waits: dict[int, float] = {}
        queue = deque(self._queue)
        if extra is not None:
            queue.append(extra)
        for _ in range(4 * (len(queue) + len(engine.jobs)) + 8):  # each turn admits or ends a job
            while (queue and (slots >= queue[0].requests or (queue[0].requests > limit and slots >= limit))
                   and self.cost(queue[0]) <= free):
                tk = queue.popleft()
                waits[tk.id] = t - now
                free -= self.cost(tk)
                slots -= tk.requests
                engine.jobs.append(_Job(float(max(0, tk.tokens - tk.generation)), self._expected_generation(tk),
                                        self.cost(tk), tk.requests))
            if not queue or not engine.jobs:
                break
            t, ended = engine.run(t, math.inf)
            free += sum(j.reserved for j in ended)
            slots += sum(j.requests for j in ended)
        return waits

    def _expected_generation(self, ticket: Ticket) -> float:
        """Tokens the ticket is expected to generate: the engine's recent mean, at most its limit;
        one token (the only certain one) until the engine has finished a request."""
        mean = self._generation_mean
        return float(min(ticket.generation, UNKNOWN_GENERATION if mean is None else mean))

    def predicted_wait(self, ticket: Ticket, now: float) -> float | None:
        """The configured prediction for a request arriving now: the bound, or its expected wait
        behind the parked ones (None: no prediction, or it would never be admitted)."""
        if self.limits.wait_prediction == "expected":
            waits = self.expected_waits(now, ticket)
            return None if waits is None else waits.get(ticket.id)
        return self.wait_bound(ticket, now)

    def wait_bound(self, ticket: Ticket, now: float) -> float | None:
        """Seconds before which `ticket` surely cannot be admitted (module docstring, "Waits from
        work"), or None where there is no bound (no budget, no measurement yet, estimates off)."""
        ahead = self._work_ahead(now)
        return None if ahead is None else ahead.seconds(self.cost(ticket), ticket.requests)

    # --- events ---------------------------------------------------------------------------

    def arrive(self, ticket: Ticket, now: float) -> Decision:
        """A gated request arrives: admit it, park it, or reject it at once."""
        if self.state is not EngineState.FRESH:
            return self._admit(ticket, now, Outcome.ADMITTED_FAIL_OPEN)
        if self.never_fits(ticket):
            ticket.state = TicketState.DONE
            return Decision(ticket, Outcome.EXCEEDS_KV_CAPACITY)
        rule = None if self._queue else self._fit_rule(ticket, now)
        if rule is not None:
            return self._admit(ticket, now, Outcome.ADMITTED, rule)
        rule = self._may_backfill(ticket, now) if self._queue else None
        if rule is not None:
            ticket.backfilled = True
            return self._admit(ticket, now, Outcome.ADMITTED, rule)
        position = len(self._queue) + 1
        if len(self._queue) >= self.limits.max_queue_depth:
            ticket.state = TicketState.DONE
            return Decision(ticket, Outcome.QUEUE_FULL, self.retry_after(position))
        bound = self.predicted_wait(ticket, now)
        cap = self.limits.max_park_seconds
        if bound is not None and bound > (cap if self.limits.wait_prediction == "bound" else ESTIMATE_MARGIN * cap):
            ticket.state = TicketState.DONE
            return Decision(ticket, Outcome.EXPECTED_WAIT_TOO_LONG, _clamp_retry_after(bound), bound)
        wait = self.expected_wait(position)
        if wait is not None and wait > ESTIMATE_MARGIN * cap:
            ticket.state = TicketState.DONE
            return Decision(ticket, Outcome.EXPECTED_WAIT_TOO_LONG, self.retry_after(position))
        ticket.state = TicketState.PARKED
        ticket.park_deadline = now + self.limits.max_park_seconds
        ticket.predicted_wait = bound
        self._queue.append(ticket)
        return Decision(ticket, Outcome.PARKED, predicted_wait=bound)

    def observe(self, snapshot: EngineSnapshot, now: float) -> list[Decision]:
        """A poll succeeded: take the new snapshot and release whoever now fits.

        A snapshot older than the one held (replicas sharing a ledger scrape at their own times
        and may commit out of order) only says that the engine answers.
        """
        if self._snapshot is not None and snapshot.scrape_started < self._snapshot.scrape_started:
            self._failed_polls = 0
            return self._release(now)
        others = self._others()
        if others is not None:
            self._others_before = others
        self._learn_generation(self._snapshot, snapshot)
        self._learn_lengths(self._snapshot, snapshot)
        self._measure_throughput(self._snapshot, snapshot)
        self._snapshot = snapshot
        self._failed_polls = 0
        self._old_requests = sum(t.requests for t in self._inflight.values() if self._is_old(t.admitted_at))
        self._finished = [f for f in self._finished if f.finished_at > snapshot.scrape_started]
        released = self._release(now)
        return released + self._reject_hopeless(now)

    def _measure_throughput(self, before: EngineSnapshot | None, after: EngineSnapshot) -> None:
        """Fold the KV growth between two good scrapes into the throughput peak (module docstring)."""
        capacity = after.capacity_tokens
        if before is None or not capacity:
            return
        ended_before, ended_after = before.generated_count, after.generated_count
        counted = ended_before is not None and ended_after is not None
        if before.capacity_tokens != capacity or (
                ended_before is not None and ended_after is not None and ended_after < ended_before):
            self._busy.clear()  # another engine, or the engine restarted: measure again
            self._peak_rate = None
            self._decode_mixed.clear()
            self._decode_alone.clear()
            return
        span = after.scrape_started - before.scrape_started
        if self._failed_polls or span <= 0:
            return  # polls were lost in between: the interval is not known to be busy
        if before.running + before.waiting == 0 or after.running + after.waiting == 0:
            return  # idle at one end
        if counted:
            if ended_after != ended_before:
                return  # a request ended: its released KV hides growth
        elif any(before.scrape_started < f.finished_at <= after.scrape_started for f in self._finished):
            return
        growth = (after.kv_usage - before.kv_usage) * capacity
        if growth < 0:
            return  # KV released without a finish (a preemption, an abort)
        self._busy.append((growth, span))
        self._measure_decode(before, after, growth, span)
        if len(self._busy) == RATE_INTERVALS:
            rate = sum(g for g, _ in self._busy) / sum(d for _, d in self._busy)
            if rate > 0 and (self._peak_rate is None or rate > self._peak_rate):
                self._peak_rate = rate

    def _measure_decode(self, before: EngineSnapshot, after: EngineSnapshot, growth: float, span: float) -> None:
        """Fold a busy interval's generation into the decode rates (module docstring, "Expected waits")."""
        gen_before, gen_after = before.generation_tokens_total, after.generation_tokens_total
        if gen_before is None or gen_after is None or gen_after < gen_before:
            return
        generated = gen_after - gen_before
        if generated <= 0:
            return  # nothing decoded: the running requests were all prefilling or waiting for it
        running = (before.running + after.running) / 2
        mixed = growth - generated > self.block_size * max(1.0, running)  # more KV than the generation: a prefill
        decoding = running - 1 if mixed else running
        if decoding <= 0:
            return
        (self._decode_mixed if mixed else self._decode_alone).append((generated, decoding * span))

    def _reject_hopeless(self, now: float) -> list[Decision]:
        if self.limits.wait_prediction == "expected":
            return self._reject_expected(now)
        return self._reject_by_bound(now)

    def _reject_expected(self, now: float) -> list[Decision]:
        """Answer, head first, every parked request expected to be admitted later than
        `ESTIMATE_MARGIN` park caps after its arrival; each answer is taken out before the next is
        judged (those behind it move up). The others keep their first prediction (a wait from
        arrival, for the error metric)."""
        rejected: list[Decision] = []
        beyond = (ESTIMATE_MARGIN - 1) * self.limits.max_park_seconds  # past the deadline: the margin
        while self._queue:
            waits = self.expected_waits(now)
            if waits is None:
                break
            hopeless = None
            for ticket in self._queue:
                wait, deadline = waits.get(ticket.id), ticket.park_deadline
                if wait is None or deadline is None or now >= deadline:
                    continue  # no prediction, or its cap is over: the timer answers it
                if now + wait > deadline + beyond:
                    hopeless = ticket, wait
                    break
                if ticket.predicted_wait is None:
                    ticket.predicted_wait = max(0.0, now - ticket.arrived) + wait
            if hopeless is None:
                break
            ticket, wait = hopeless
            self._queue.remove(ticket)
            ticket.state = TicketState.DONE
            rejected.append(Decision(ticket, Outcome.EXPECTED_WAIT_TOO_LONG, _clamp_retry_after(wait), wait))
        return rejected

    def _reject_by_bound(self, now: float) -> list[Decision]:
        """Answer every parked request whose wait bound runs past its park deadline; the others keep
        the first bound they get as their prediction (a wait from arrival, for the error metric)."""
        if not self._queue:
            return []
        ahead = self._work_ahead(now)
        if ahead is None:
            return []
        rejected: list[Decision] = []
        for ticket in list(self._queue):
            bound = ahead.seconds(self.cost(ticket), ticket.requests)
            deadline = ticket.park_deadline
            if deadline is not None and now >= deadline:
                continue  # its cap is over: the timer answers it (park_timeout), the bound proves nothing
            if deadline is not None and now + bound > deadline:
                self._queue.remove(ticket)
                ticket.state = TicketState.DONE
                rejected.append(Decision(ticket, Outcome.EXPECTED_WAIT_TOO_LONG, _clamp_retry_after(bound), bound))
            elif ticket.predicted_wait is None:
                ticket.predicted_wait = max(0.0, now - ticket.arrived) + bound
        return rejected

    def _work_ahead(self, now: float) -> _WorkAhead | None:
        """What must be released before anything more is admitted, as work; None without a bound."""
        rate = self.throughput_bound()
        capacity = self.capacity_tokens
        if (not (self.limits.wait_estimates and self._budgeting) or rate is None or capacity is None
                or self.state is not EngineState.FRESH):
            return None
        limit = self.limits.max_inflight + self.limits.engine_queue_slots
        return _WorkAhead.of(self._inflight.values(), rate, now, self.reserved_tokens - capacity,
                             self._requests - self.engine_done() - limit, limit)

    def _learn_generation(self, before: EngineSnapshot | None, after: EngineSnapshot) -> None:
        """Fold the requests the engine finished between two scrapes into the generation mean."""
        if before is None:
            return
        sum_before, count_before = before.generated_sum, before.generated_count
        sum_after, count_after = after.generated_sum, after.generated_count
        if sum_before is None or count_before is None or sum_after is None or count_after is None:
            return
        count = count_after - count_before
        total = sum_after - sum_before
        if count <= 0 or total < 0:
            return  # nothing finished, or the engine restarted (its counters went back)
        mean = total / count
        weight = min(1.0, count / GENERATION_WINDOW)
        self._generation_mean = _smooth(self._generation_mean, mean, weight)

    def _learn_lengths(self, before: EngineSnapshot | None, after: EngineSnapshot) -> None:
        """Fold what the engine did between two scrapes into the projected policy's models: the
        generation lengths of the requests it finished (histogram buckets, smoothed like the mean),
        its prefix-cache hit rate, and its preemptions."""
        if before is None:
            return
        delta, finished = histogram_delta(before.generated_buckets, after.generated_buckets)
        if delta is not None:
            self._length_hist = smooth_histogram(self._length_hist, delta, finished, GENERATION_WINDOW)
        hits = _delta(before.prefix_hits, after.prefix_hits)
        queries = _delta(before.prefix_queries, after.prefix_queries)
        if hits is not None and queries:
            rate = min(1.0, hits / queries)
            weight = min(1.0, queries / (GENERATION_WINDOW * 1024))  # about a window of 1k-token prompts
            self._hit_rate = _smooth(self._hit_rate, rate, weight)
        preempted = _delta(before.preemptions, after.preemptions)
        self._preempted = preempted or 0.0
        self._learn_rates(before, after)

    def _learn_rates(self, before: EngineSnapshot, after: EngineSnapshot) -> None:
        """The prefill and decode rates of the requests the engine finished between two scrapes, from
        its own per-request histograms (vLLM observes a request's prompt tokens, prefill seconds
        (scheduled to first token), decode seconds (first to last token) and generated tokens
        together when it finishes): prompt / prefill time and (generated - 1) / decode time, summed
        over those requests and smoothed like the length model. Measured on the first finish, where
        the KV-growth peak (`_peak_rate`) needs eight busy intervals without one. A prefill that
        shares its steps with decodes is slower than the engine's peak, so this rate is the lower
        one: the side of a dearer preemption and of less progress."""
        if before.capacity_tokens != after.capacity_tokens:
            self._prefill_direct = self._decode_direct = None  # another engine: measure again
        count = _delta(before.generated_count, after.generated_count)
        if not count:
            return
        weight = min(1.0, count / GENERATION_WINDOW)
        prompt = _delta(before.prompt_sum, after.prompt_sum)
        prefill = _delta(before.prefill_time_sum, after.prefill_time_sum)
        if prompt and prefill:
            self._prefill_direct = _smooth(self._prefill_direct, prompt / prefill, weight)
        generated = _delta(before.generated_sum, after.generated_sum)
        decode = _delta(before.decode_time_sum, after.decode_time_sum)
        if generated is not None and decode and generated > count:
            self._decode_direct = _smooth(self._decode_direct, (generated - count) / decode, weight)

    def prefill_rate(self) -> float | None:
        """Prompt tokens per second one request is prefilled at: the engine's own per-request figure
        where it has finished a request, else the peak KV growth measured; None before either."""
        return self._prefill_direct if self._prefill_direct is not None else self._peak_rate

    def poll_failed(self, now: float) -> list[Decision]:
        """A poll failed (unreachable, timed out or unparsable). Stale engines release the park."""
        self._failed_polls += 1
        return self._release(now)

    def finish(self, ticket: Ticket, now: float) -> list[Decision]:
        """An admitted request's stream ended: free its slot and KV at once, re-check the queue."""
        if ticket.state is not TicketState.ADMITTED:
            return []
        ticket.state = TicketState.DONE
        if self._inflight.get(ticket.id) is ticket:
            self._drop_open(ticket)
            self._completions.append(now)
            assert ticket.admitted_at is not None
            if self.state is EngineState.FRESH:  # otherwise the next good scrape sees the truth
                self._finished.append(_Finished(ticket.admitted_at, now, ticket.reserved, ticket.owner,
                                                ticket.requests))
                if self._seen is not None:
                    self._seen.add_finished(ticket.admitted_at, ticket.reserved, ticket.requests)
        return self._release(now)

    def end(self, ticket_id: int, now: float) -> list[Decision]:
        """A request's stream ended in whatever state the gate holds its ticket: parked (the
        client left: `client_gone`), admitted (finished: frees its slot and KV), or gone."""
        ticket = self.find(ticket_id)
        if ticket is None:
            return []
        if ticket.state is TicketState.PARKED:
            decision = self.abandon(ticket, now)
            return [decision] if decision is not None else []
        return self.finish(ticket, now)

    def abandon(self, ticket: Ticket, now: float) -> Decision | None:
        """A parked request's client went away: drop it from the queue, never admit it."""
        if ticket.state is not TicketState.PARKED:
            return None
        self._queue.remove(ticket)
        ticket.state = TicketState.DONE
        return Decision(ticket, Outcome.CLIENT_GONE)

    def expire(self, now: float) -> list[Decision]:
        """Reject every parked request whose park deadline has passed."""
        expired: list[Decision] = []
        while self._queue and self._queue[0].park_deadline is not None and self._queue[0].park_deadline <= now:
            ticket = self._queue.popleft()
            ticket.state = TicketState.DONE
            expired.append(Decision(ticket, Outcome.PARK_TIMEOUT, self.retry_after(len(self._queue) + 1)))
        return expired

    def drain(self, outcome: Outcome, owner: str | None = None) -> list[Decision]:
        """Answer every parked request (of `owner`, or all) with `outcome` (used at shutdown)."""
        mine = [t for t in self._queue if owner is None or t.owner == owner]
        for t in mine:
            self._queue.remove(t)
            t.state = TicketState.DONE
        return [Decision(t, outcome, self.limits.retry_after_seconds) for t in mine]

    # --- leases (shared ledger) -----------------------------------------------------------

    def renew(self, owner: str, until: float) -> None:
        """`owner` vouches for all its tickets until `until`."""
        for t in itertools.chain(self._queue, self._inflight.values()):
            if t.owner == owner:
                t.lease_until = until

    def purge_expired(self, now: float) -> tuple[list[Ticket], list[Decision]]:
        """Drop the tickets whose lease ran out (their replica died), parked or admitted, and
        release whoever the freed capacity now lets in.

        An admitted one is not counted as finished: if its request still runs at the engine, the
        next scrape charges it to `others`. Returns the dropped tickets and the decisions."""
        dead = [t for t in itertools.chain(self._queue, self._inflight.values())
                if t.lease_until is not None and t.lease_until < now]
        if not dead:
            return [], []
        for t in dead:
            if t.state is TicketState.PARKED:
                self._queue.remove(t)
            else:
                self._drop_open(t)
            t.state = TicketState.DONE
        return dead, self._release(now)

    def keep_only(self, owner: str) -> None:
        """Forget every other replica's tickets: this gate becomes `owner`'s own soft view."""
        self._queue = deque(t for t in self._queue if t.owner == owner)
        self._inflight = {i: t for i, t in self._inflight.items() if t.owner == owner}
        self._finished = [f for f in self._finished if f.owner == owner]
        self._forget_counts()

    def replace_owner(self, owner: str, tickets: list[Ticket]) -> None:
        """Put `owner`'s current tickets in place of whatever this gate held for it (a replica
        re-registers after running on its own): parked ones join the FIFO by arrival time."""
        self._queue = deque(t for t in self._queue if t.owner != owner)
        self._inflight = {i: t for i, t in self._inflight.items() if t.owner != owner}
        for t in tickets:
            if t.state is TicketState.ADMITTED and t.counted:
                self._inflight[t.id] = t
            elif t.state is TicketState.PARKED:
                self._queue.append(t)
        self._forget_counts()
        self._queue = deque(sorted(self._queue, key=lambda t: (t.arrived, t.id)))

    # --- serialisation (shared ledger) ----------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        snap = self._snapshot
        return {
            "snap": None if snap is None else list(astuple(snap)),
            "fp": self._failed_polls,
            "q": [t.to_state() for t in self._queue],
            "in": [t.to_state() for _, t in sorted(self._inflight.items())],
            "fin": [[f.admitted_at, f.finished_at, f.reserved, f.owner, f.requests] for f in self._finished],
            "done": list(self._completions),
            "ob": self._others_before,
            "gm": self._generation_mean,
            "bi": [list(b) for b in self._busy],
            "pk": self._peak_rate,
            "dm": [list(d) for d in self._decode_mixed],
            "da": [list(d) for d in self._decode_alone],
            "lh": None if self._length_hist is None else [list(self._length_hist.edges),
                                                           list(self._length_hist.counts)],
            "hr": self._hit_rate,
            "pe": self._preempted,
            "pfd": self._prefill_direct,
            "dcd": self._decode_direct,
        }

    @classmethod
    def from_state(cls, limits: GateLimits, state: dict[str, Any] | None) -> EngineGate:
        gate = cls(limits)
        if not state:
            return gate
        snap = state["snap"]
        gate._snapshot = None if snap is None else _snapshot_from_state(snap)
        gate._failed_polls = state["fp"]
        gate._queue = deque(Ticket.from_state(t) for t in state["q"])
        gate._inflight = {t.id: t for t in map(Ticket.from_state, state["in"])}
        gate._finished = [_Finished(*f) for f in state["fin"]]
        gate._forget_counts()
        gate._completions = deque(state["done"], maxlen=RATE_WINDOW)
        gate._others_before = state["ob"]
        gate._generation_mean = state.get("gm")
        gate._busy = deque(((float(g), float(d)) for g, d in state.get("bi", ())), maxlen=RATE_INTERVALS)
        gate._peak_rate = state.get("pk")
        gate._decode_mixed = deque(((float(g), float(d)) for g, d in state.get("dm", ())), maxlen=RATE_INTERVALS)
        gate._decode_alone = deque(((float(g), float(d)) for g, d in state.get("da", ())), maxlen=RATE_INTERVALS)
        lengths = state.get("lh")
        gate._length_hist = None if lengths is None else HistogramLength(
            tuple(float(e) for e in lengths[0]), tuple(float(c) for c in lengths[1]))
        gate._hit_rate = state.get("hr")
        gate._preempted = state.get("pe", 0.0)
        gate._prefill_direct = state.get("pfd")
        gate._decode_direct = state.get("dcd")
        return gate

    # --- internals ------------------------------------------------------------------------

    def _admit(self, ticket: Ticket, now: float, outcome: Outcome, rule: str = "") -> Decision:
        ticket.state = TicketState.ADMITTED
        ticket.policy = rule if self._projecting and outcome is not Outcome.ADMITTED_FAIL_OPEN else ""
        ticket.admitted_at = now
        ticket.park_deadline = None
        if outcome is not Outcome.ADMITTED_FAIL_OPEN:
            ticket.counted = True
            ticket.reserved = self.cost(ticket) if self._budgeting else 0
            self._inflight[ticket.id] = ticket
            self._reserved += ticket.reserved
            self._requests += ticket.requests
            if self._is_old(now):
                self._old_requests += ticket.requests
            if self._seen is not None:
                self._seen.add_open(now, ticket.reserved, ticket.requests, 1)
        return Decision(ticket, outcome)

    def _drop_open(self, ticket: Ticket) -> None:
        """`ticket` is no longer open (finished, or its lease ran out)."""
        del self._inflight[ticket.id]
        self._reserved -= ticket.reserved
        self._requests -= ticket.requests
        if self._is_old(ticket.admitted_at):
            self._old_requests -= ticket.requests
        if self._seen is not None:
            self._seen.add_open(ticket.admitted_at, ticket.reserved, ticket.requests, -1)

    def _may_backfill(self, ticket: Ticket, now: float) -> str | None:
        """The rule by which `ticket` may pass the queue head without delaying it (see module
        docstring), or None."""
        if not (self.limits.backfill and self._budgeting and self._queue):
            return None
        head = self._queue[0]
        available = self.available_tokens()
        if available is None or not self._slot_open(head) or self._fit_rule(head, now) is not None:
            return None  # the head is not blocked by KV alone: plain FIFO
        if not self._slot_open(ticket):
            return None
        if now - head.arrived >= BACKFILL_PATIENCE * self.limits.max_park_seconds:
            return None
        rule = self._fit_rule(ticket, now)
        if rule is None:
            return None
        if rule == "projected":
            # The head must still fit beside `ticket` once the open request projected to hold the most ends.
            return rule if self._projected_fits([ticket, head], now, without_largest=True) else None
        cost = self.cost(ticket)
        largest = max((t.reserved for t in self._inflight.values()), default=0)
        return rule if cost <= available and available - cost + largest >= self.cost(head) else None

    def _release(self, now: float) -> list[Decision]:
        released: list[Decision] = []
        if self.state is not EngineState.FRESH:
            while self._queue:
                released.append(self._admit(self._queue.popleft(), now, Outcome.ADMITTED_FAIL_OPEN))
            return released
        while self._queue:
            rule = self._fit_rule(self._queue[0], now)
            if rule is None:
                break
            released.append(self._admit(self._queue.popleft(), now, Outcome.ADMITTED_AFTER_PARK, rule))
        for ticket in list(self._queue)[1:]:
            if not self._slot_open():
                break
            rule = self._may_backfill(ticket, now)
            if rule is not None:
                self._queue.remove(ticket)
                ticket.backfilled = True
                released.append(self._admit(ticket, now, Outcome.ADMITTED_AFTER_PARK, rule))
        return released


def _snapshot_from_state(fields: list[Any]) -> EngineSnapshot:
    """An EngineSnapshot from its `astuple` form (JSON turns the buckets' tuples into lists)."""
    snap = EngineSnapshot(*fields)
    if snap.generated_buckets is not None:
        buckets = tuple((float(b), float(c)) for b, c in snap.generated_buckets)
        snap = dataclasses.replace(snap, generated_buckets=buckets)
    return snap


def _smooth(previous: float | None, value: float, weight: float) -> float:
    """An exponentially smoothed figure: `value` at first, then `weight` of the way towards each new one."""
    return value if previous is None else previous + weight * (value - previous)


def _delta(before: float | None, after: float | None) -> float | None:
    """A counter's growth between two scrapes; None when either is missing or it went back (a restart)."""
    if before is None or after is None or after < before:
        return None
    return after - before


def _clamp_retry_after(wait: float) -> int:
    return math.ceil(min(RETRY_AFTER_MAX_SECONDS, max(RETRY_AFTER_MIN_SECONDS, wait)))


@dataclass(frozen=True)
class _WorkAhead:
    """The least prompt work after which a request of a given cost could be admitted.

    Built once per evaluation from the open tickets: each releases `reserved` tokens once its
    prompt is processed. `capped`: the rest of each prompt after the most the engine could have
    processed of it since its admission; `full`: whole prompts, less the most the engine could
    have processed of all of them together (`done`). Both are lower bounds; `seconds` takes the larger.
    """

    rate: float  # tokens per second, an upper bound on the engine's throughput
    excess: int  # reserved - capacity: a request of cost c needs excess + c tokens released
    over: int  # open engine requests - slot limit: a request of r engine requests needs over + r of them to end
    limit: int  # the slot limit (a request above it needs every open one to end)
    held: tuple[int, ...]  # prefix sums of the open tickets' engine requests, most first
    done: float  # the most prompt work the engine can have done on all of them
    capped: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]  # knapsack prefix sums
    full: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]
    capped_smallest: tuple[float, ...]  # prefix sums of the remaining prompts, smallest first
    full_smallest: tuple[float, ...]

    @classmethod
    def of(cls, tickets: Iterable[Ticket], rate: float, now: float, excess: int, over: int,
           limit: int) -> _WorkAhead:
        full: list[tuple[float, int]] = []
        capped: list[tuple[float, int]] = []
        requests: list[int] = []
        oldest = now
        for t in tickets:
            requests.append(t.requests)
            prompt = float(max(0, t.tokens - t.generation))
            admitted = t.admitted_at if t.admitted_at is not None else now
            oldest = min(oldest, admitted)
            full.append((prompt, t.reserved))
            capped.append((max(0.0, prompt - rate * max(0.0, now - admitted)), t.reserved))
        held = tuple(int(x) for x in _prefix([float(r) for r in sorted(requests, reverse=True)]))
        return cls(rate, excess, over, limit, held, rate * max(0.0, now - oldest), _knapsack(capped),
                   _knapsack(full), _prefix(sorted(w for w, _ in capped)), _prefix(sorted(w for w, _ in full)))

    def ends(self, requests: int) -> int:
        """The fewest open tickets that must end before `requests` engine requests get their slots."""
        if requests > self.limit:
            return len(self.held) - 1  # it goes in alone
        need = self.over + requests
        if need <= 0:
            return 0
        return min(bisect.bisect_left(self.held, need), len(self.held) - 1)

    def work(self, cost: int, requests: int = 1) -> float:
        need = self.excess + cost
        work = 0.0
        if need > 0:
            work = max(_cheapest(self.capped, need), _cheapest(self.full, need) - self.done)
        k = self.ends(requests)
        if k > 0:
            k = min(k, len(self.capped_smallest) - 1)
            work = max(work, self.capped_smallest[k], self.full_smallest[k] - self.done)
        return max(0.0, work)

    def seconds(self, cost: int, requests: int = 1) -> float:
        return self.work(cost, requests) / self.rate


def _prefix(values: list[float]) -> tuple[float, ...]:
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return tuple(sums)


def _knapsack(items: list[tuple[float, int]]) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Items (work, released tokens), cheapest work per token first: prefix sums of tokens and work,
    and each item's work per token."""
    ranked = sorted((w / r, w, r) for w, r in items if r > 0)
    return _prefix([r for _, _, r in ranked]), _prefix([w for _, w, _ in ranked]), tuple(x for x, _, _ in ranked)


def _cheapest(sums: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]], need: float) -> float:
    """The least work that releases `need` tokens, taking items fractionally (a lower bound)."""
    released, work, per_token = sums
    i = bisect.bisect_left(released, need)  # released[i - 1] < need <= released[i]
    if i >= len(released):
        return math.inf  # even all of them together do not release enough
    return work[i - 1] + (need - released[i - 1]) * per_token[i - 1]


def _rate(window: deque[tuple[float, float]]) -> float | None:
    """Tokens per request-second over a window of (tokens, request-seconds); None when empty."""
    seconds = sum(d for _, d in window)
    return sum(g for g, _ in window) / seconds if seconds > 0 else None


@dataclass(eq=False)
class _Job:
    """One request in the expected-wait simulation: its prompt and generation still to do."""

    prompt: float
    generation: float
    reserved: int
    requests: int = 1


@dataclass
class _FluidEngine:
    """The engine as the expected wait sees it (module docstring, "Expected waits"): the first
    `seqs` jobs run; the first of them with prompt left prefills at `prefill` tokens/s, one at a
    time; the others generate at `mixed` tokens/s each while a prefill runs, `alone` otherwise."""

    seqs: int
    prefill: float
    mixed: float
    alone: float
    jobs: list[_Job] = field(default_factory=list)

    def run(self, t: float, until: float) -> tuple[float, list[_Job]]:
        """Run from `t` to the next end of a job or `until`, whichever is first: the time reached and
        the jobs that ended."""
        running: list[_Job] = []
        seqs = 0
        for j in self.jobs:  # the first jobs whose sequences fit max-num-seqs (at least one)
            if running and seqs + j.requests > self.seqs:
                break
            running.append(j)
            seqs += j.requests
        prefilling = next((j for j in running if j.prompt > 0), None)
        speed = self.mixed if prefilling is not None else self.alone
        decoding = [j for j in running if j.prompt <= 0] if speed > 0 else []  # 0: no generation moves
        step = until - t
        if prefilling is not None:
            step = min(step, prefilling.prompt / self.prefill)
        for j in decoding:
            step = min(step, j.generation / speed)
        if math.isinf(step):
            return until, []
        if prefilling is not None:
            prefilling.prompt = max(0.0, prefilling.prompt - step * self.prefill)
            if prefilling.prompt <= 1e-6:
                prefilling.prompt = 0.0
        for j in decoding:
            j.generation = 0.0 if math.isinf(speed) else max(0.0, j.generation - step * speed)
        ended = [j for j in running if j.prompt <= 0 and j.generation <= 1e-6]
        self.jobs = [j for j in self.jobs if j not in ended]
        return t + step, ended
