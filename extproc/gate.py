"""The admission decision core for one engine: pure, synchronous, no IO; time is passed in.

Rules (DESIGN.md "Admission semantics"):
- The gate is closed while the engine's KV usage >= the threshold, or while its load
  (running + waiting) >= max in-flight. Closed means park; open means admit.
- Parked requests form one FIFO per engine. A new arrival never overtakes the queue.
- The park is bounded twice: by length (`max_queue_depth`; the next arrival is rejected at
  once) and by time (`max_park_seconds`; then the request is rejected with Retry-After).
- Engine state that is unknown (no successful poll yet) or stale (`stale_after_polls`
  consecutive failed polls) fails OPEN: everything is admitted, parked requests included.

With `local_accounting` (the default; the reference gate ran without it) the load is corrected
for what the last scrape could not know:
- a request this replica admitted after `scrape_started - grace` is added (the scrape could not
  have seen it yet; `grace` covers Envoy-to-engine latency);
- a request this replica admitted before that point and that finished after the scrape began is
  subtracted (the scrape counted it, but its slot is free now). This is what lets a local
  completion wake the head of the queue at once instead of on the next poll.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

from .outcomes import Outcome


@dataclass(frozen=True)
class GateLimits:
    max_inflight: int
    kv_threshold: float
    max_queue_depth: int
    max_park_seconds: float
    stale_after_polls: int = 3
    local_accounting: bool = True
    scrape_grace_seconds: float = 0.5


@dataclass(frozen=True)
class EngineSnapshot:
    """One successful scrape of the engine's gauges, aggregated over its ranks."""

    running: int
    waiting: int
    kv_usage: float  # fraction 0..1
    scrape_started: float  # clock time at which the scrape request was sent
    capacity_tokens: int | None = None


class EngineState(enum.StrEnum):
    UNKNOWN = "unknown"  # no successful poll yet
    FRESH = "fresh"
    STALE = "stale"


class TicketState(enum.StrEnum):
    NEW = "new"
    PARKED = "parked"
    ADMITTED = "admitted"
    DONE = "done"


_ids = itertools.count(1)


@dataclass(eq=False)
class Ticket:
    """One gated request's place in the gate."""

    model: str
    arrived: float
    id: int = field(default_factory=lambda: next(_ids))
    state: TicketState = TicketState.NEW
    park_deadline: float | None = None
    admitted_at: float | None = None
    counted: bool = False  # whether this ticket is in the local ledger (admitted while gated)

    def __repr__(self) -> str:
        return f"<Ticket #{self.id} {self.model} {self.state}>"


@dataclass(frozen=True)
class Decision:
    ticket: Ticket
    outcome: Outcome


class EngineGate:
    """FIFO admission for one engine. Every method returns the decisions it made."""

    def __init__(self, limits: GateLimits) -> None:
        self.limits = limits
        self._snapshot: EngineSnapshot | None = None
        self._failed_polls = 0
        self._queue: deque[Ticket] = deque()
        self._inflight: set[Ticket] = set()  # admitted by this replica, stream still open
        # (admitted_at, finished_at) of local tickets that finished after the last scrape began
        self._finished: list[tuple[float, float]] = []

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

    def queued(self) -> tuple[Ticket, ...]:
        return tuple(self._queue)

    def effective_load(self) -> int | None:
        """running + waiting as the gate believes it now, or None without a usable snapshot."""
        snap = self._snapshot
        if snap is None or self.state is not EngineState.FRESH:
            return None
        load = snap.running + snap.waiting
        if not self.limits.local_accounting:
            return load
        seen_before = snap.scrape_started - self.limits.scrape_grace_seconds
        unseen = sum(1 for t in self._inflight if t.admitted_at is not None and t.admitted_at >= seen_before)
        freed = sum(1 for admitted, _ in self._finished if admitted < seen_before)
        return max(0, load - freed) + unseen

    def is_open(self) -> bool:
        """Whether a request arriving now would be admitted (ignoring the queue)."""
        if self.state is not EngineState.FRESH:
            return True
        snap = self._snapshot
        assert snap is not None
        load = self.effective_load()
        assert load is not None
        return snap.kv_usage < self.limits.kv_threshold and load < self.limits.max_inflight

    def next_deadline(self) -> float | None:
        """The earliest park deadline (the queue is FIFO with one park cap, so it is the head's)."""
        return self._queue[0].park_deadline if self._queue else None

    # --- events ---------------------------------------------------------------------------

    def arrive(self, ticket: Ticket, now: float) -> Decision:
        """A gated request arrives: admit it, park it, or reject it because the park is full."""
        if not self._queue and self.is_open():
            outcome = Outcome.ADMITTED if self.state is EngineState.FRESH else Outcome.ADMITTED_FAIL_OPEN
            return self._admit(ticket, now, outcome)
        if len(self._queue) >= self.limits.max_queue_depth:
            ticket.state = TicketState.DONE
            return Decision(ticket, Outcome.QUEUE_FULL)
        ticket.state = TicketState.PARKED
        ticket.park_deadline = now + self.limits.max_park_seconds
        self._queue.append(ticket)
        return Decision(ticket, Outcome.PARKED)

    def observe(self, snapshot: EngineSnapshot, now: float) -> list[Decision]:
        """A poll succeeded: take the new snapshot and release whoever now fits."""
        self._snapshot = snapshot
        self._failed_polls = 0
        self._finished = [f for f in self._finished if f[1] >= snapshot.scrape_started]
        return self._release(now)

    def poll_failed(self, now: float) -> list[Decision]:
        """A poll failed (unreachable, timed out or unparsable). Stale engines release the park."""
        self._failed_polls += 1
        return self._release(now)

    def finish(self, ticket: Ticket, now: float) -> list[Decision]:
        """An admitted request's stream ended: free its slot at once and re-check the queue head."""
        if ticket.state is not TicketState.ADMITTED:
            return []
        ticket.state = TicketState.DONE
        if ticket in self._inflight:
            self._inflight.discard(ticket)
            assert ticket.admitted_at is not None
            if self.state is EngineState.FRESH:  # otherwise the next good scrape sees the truth
                self._finished.append((ticket.admitted_at, now))
        return self._release(now)

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
            expired.append(Decision(ticket, Outcome.PARK_TIMEOUT))
        return expired

    def drain(self, outcome: Outcome) -> list[Decision]:
        """Answer every parked request with `outcome` (used at shutdown)."""
        drained = [Decision(t, outcome) for t in self._queue]
        for t in self._queue:
            t.state = TicketState.DONE
        self._queue.clear()
        return drained

    # --- internals ------------------------------------------------------------------------

    def _admit(self, ticket: Ticket, now: float, outcome: Outcome) -> Decision:
        ticket.state = TicketState.ADMITTED
        ticket.admitted_at = now
        ticket.park_deadline = None
        if outcome is not Outcome.ADMITTED_FAIL_OPEN:
            ticket.counted = True
            self._inflight.add(ticket)
        return Decision(ticket, outcome)

    def _release(self, now: float) -> list[Decision]:
        released: list[Decision] = []
        while self._queue and self.is_open():
            ticket = self._queue.popleft()
            outcome = Outcome.ADMITTED_AFTER_PARK if self.state is EngineState.FRESH else Outcome.ADMITTED_FAIL_OPEN
            released.append(self._admit(ticket, now, outcome))
        return released
