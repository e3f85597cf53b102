"""Where the gates' state lives: in this process (`local`) or shared across replicas (`redis`).

The admission policy is in ONE place, the pure `EngineGate`. A ledger only decides where its
state is kept and runs each event on it atomically: `transact(engine, fn)` applies `fn` (one gate
event, e.g. `lambda g: [g.arrive(ticket, now)]`) to the engine's current state and returns the
decisions it made about this replica's tickets.

`LocalLedger` holds one gate per engine in memory: each event runs at once, nothing is shared.

`RedisLedger` keeps each engine's whole gate state in one Redis hash (`{prefix:engine}:state`,
one hash tag per engine, so it is Redis-Cluster-safe) with a version number. An event is an
optimistic transaction: run `fn` on the last state this replica knows, then commit the new state
with a generic compare-and-set script (`_COMMIT`: write if the version is still the one read,
bump it, publish the new state). On a conflict the script answers the current state in the same
round trip and the event runs again on it. So every decision takes one round trip (two under
contention), Redis holds data and compares versions, and the N replicas' events are linearised:
for the same sequence of events, N replicas decide exactly what one gate would.

Across replicas:
- Each ticket carries its owner (this replica's id) and a lease. The replica renews its leases
  every `lease / 3` seconds while its streams are open; every transaction first drops the
  tickets whose lease has run out (`EngineGate.purge_expired`), so the capacity of a replica
  that was killed returns within one lease.
- A decision one replica makes about another's parked ticket (a completion on A releases a
  request parked on B; an expiry; a backfill) is stored in the state as a verdict for its owner.
  Every commit is published on `{prefix:engine}:events` with the new state, so the owner learns it
  within one pub/sub hop, not at a poll; its own next transaction also delivers and clears it.
- Redis down or slower than `timeout` for any call: the replica carries on alone from its last
  view of the state, keeping only its own tickets (the soft, per-replica budget of a local
  ledger), reports `admission_ledger_degraded` = 1, logs once, and retries in the background. When
  Redis answers again it puts its open tickets back in place of whatever the shared state held
  for it, and goes on shared. A decision never waits on Redis longer than `timeout` per call, and
  Redis trouble never fails a request closed.
- A state lost with no error (FLUSHALL, a restart between two calls, a restore, a failover to a
  lagging replica): every lifetime of the state has an epoch (its first version), compared with
  the version. A reply that shows the known state gone (`state_loss`) is counted, logged once,
  and this replica puts its own tickets back in the current state, as after a restart; another
  epoch on the events channel makes it check at once.

Time is the wall clock (`time.time()`), shared by replicas: park deadlines, leases and the
scrape-grace comparisons between one replica's admissions and another's scrapes all use it, so
replicas' clocks must agree to well within the scrape grace (NTP does; on one host it is exact).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .gate import Decision, EngineGate, GateLimits, Ticket, TicketState
from .outcomes import Outcome

log = logging.getLogger("extproc.ledger")

Event = Callable[[EngineGate], list[Decision]]
#: Called with decisions about this replica's tickets that another replica made.
Deliver = Callable[[str, list[Decision]], None]

#: How often a degraded replica asks Redis whether it answers again.
RECOVERY_INTERVAL_SECONDS = 0.5

_LEDGER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)

# KEYS[1] = state hash. ARGV = expected version, new state, channel, expected epoch. Generic
# compare-and-set: commits only on the version (and epoch) it was computed from, and publishes what
# it committed. A state that does not exist yet (a new, restarted or flushed Redis) starts at the
# server's time in microseconds, so versions keep increasing across a restart that lost the state,
# and that first version is also the state's epoch (`e`): a replica that finds another epoch than
# the one it knew, a missing state or a lower version knows the state it knew was lost.
_COMMIT = """
local cur = redis.call('HGET', KEYS[1], 'v') or '0'
local e = redis.call('HGET', KEYS[1], 'e') or ''
if cur ~= ARGV[1] or (cur ~= '0' and e ~= ARGV[4]) then
  return {0, cur, redis.call('HGET', KEYS[1], 'state') or '', e}
end
local v
if cur == '0' then
  local t = redis.call('TIME')
  v = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
  e = v
  redis.call('HSET', KEYS[1], 'v', v, 'state', ARGV[2], 'e', e)
else
  v = string.format('%.0f', tonumber(cur) + 1)
  redis.call('HSET', KEYS[1], 'v', v, 'state', ARGV[2])
end
redis.call('PUBLISH', ARGV[3], v .. ' ' .. e .. ' ' .. ARGV[2])
return {1, v, '', e}
"""


# The same comparison without a write, for events that changed nothing: the state is sent back
# only when it is not the version the event ran on.
_CHECK = """
local cur = redis.call('HGET', KEYS[1], 'v') or '0'
local e = redis.call('HGET', KEYS[1], 'e') or ''
if cur == ARGV[1] and (cur == '0' or e == ARGV[2]) then
  return {1, cur, '', e}
end
return {0, cur, redis.call('HGET', KEYS[1], 'state') or '', e}
"""


def state_loss(known_version: str, known_epoch: str, version: str, epoch: str) -> str | None:
    """How the committed state Redis answers shows that the one this replica knew was lost:
    `vanished` (no state: flushed, or restarted empty), `recreated` (another epoch: it vanished
    and a replica started a new one), `regressed` (an older version: restored from a snapshot,
    or a failover to a lagging replica); None if it follows from the known one (or none was known)."""
    if known_version == "0":
        return None
    if version == "0":
        return "vanished"
    if epoch != known_epoch:
        return "recreated"
    if int(version) < int(known_version):
        return "regressed"
    return None


def replica_id() -> str:
    """A name for this process unique across replicas: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


class Ledger(Protocol):
    replica: str
    shared: bool

    def gate(self, engine: str) -> EngineGate: ...
    def lease_until(self, now: float) -> float | None: ...
    async def start(self, deliver: Deliver, changed: Callable[[str], None]) -> None: ...
    async def stop(self) -> None: ...
    async def transact(self, engine: str, event: Event) -> list[Decision]: ...


class LocalLedger:
    """One in-memory gate per engine; events run at once (no await inside)."""

    shared = False

    def __init__(self, limits: dict[str, GateLimits], replica: str = "") -> None:
        self.replica = replica
        self._gates = {name: EngineGate(lim) for name, lim in limits.items()}

    def gate(self, engine: str) -> EngineGate:
        return self._gates[engine]

    def lease_until(self, now: float) -> float | None:
        return None

    async def start(self, deliver: Deliver, changed: Callable[[str], None]) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def transact(self, engine: str, event: Event) -> list[Decision]:
        return event(self._gates[engine])


class LedgerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.degraded = Gauge(
            "admission_ledger_degraded",
            "1 while the shared ledger (Redis) is unreachable or too slow and this replica decides alone.",
            ["engine"], registry=r)
        self.degraded_total = Counter(
            "admission_ledger_degraded_transitions", "Transitions into degraded (replica-local) mode.", registry=r)
        self.round_trip = Histogram(
            "admission_ledger_round_trip_seconds", "Time of one Redis call made for a decision or an event.",
            ["op"], buckets=_LEDGER_BUCKETS, registry=r)
        self.conflicts = Counter(
            "admission_ledger_conflicts", "Commits that found another replica's newer state and ran again.",
            ["engine"], registry=r)
        self.lease_expiries = Counter(
            "admission_ledger_lease_expiries",
            "Tickets dropped because their replica stopped renewing its lease (it died or lost Redis).",
            ["engine"], registry=r)
        self.state_lost = Counter(
            "admission_ledger_state_lost",
            "Times this replica found the shared state it knew gone (vanished, recreated or regressed: "
            "a flush, a restart, a restore) and put its own tickets back.",
            ["engine", "reason"], registry=r)


class LedgerUnavailable(Exception):
    """Redis did not answer in time, or failed: this replica decides alone for now."""


@dataclass
class _Shared:
    version: str = "0"
    epoch: str = ""  # the first version of this state's lifetime (`state_loss`)
    state: str = ""  # the committed JSON
    view: EngineGate | None = None  # parsed `state`; mutated only by a transaction under the lock
    verdicts: dict[str, Any] | None = None  # parsed with `view`: decisions left for their owners
    pending: tuple[str, str, str] | None = None  # a newer (version, epoch, state) published while a transaction ran


class RedisLedger:
    """Every engine's gate state in Redis; see the module docstring."""

    shared = True

    def __init__(self, limits: dict[str, GateLimits], url: str, metrics: LedgerMetrics, *,
                 lease_seconds: float = 5.0, timeout: float = 0.05, prefix: str = "llm-admission",
                 replica: str | None = None, clock: Callable[[], float] = time.time) -> None:
        import redis.asyncio as redis  # the service imports Redis only when it is configured
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.replica = replica or replica_id()
        self._limits = limits
        self._metrics = metrics
        self._lease = lease_seconds
        self._timeout = timeout
        self._clock = clock
        self._prefix = prefix
        from redis.maint_notifications import MaintNotificationsConfig

        # No retries inside a call (the decision's time bound is ours), no cloud maintenance
        # handshake (a plain Redis answers it with an error on every connection).
        def connect(socket_timeout: float | None) -> redis.Redis:
            return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=max(timeout, 1.0),
                                        retry=Retry(NoBackoff(), 0), decode_responses=True,
                                        maint_notifications_config=MaintNotificationsConfig(enabled=False))

        self._client = connect(max(timeout, 0.5))
        self._pubsub_client = connect(None)
        self._commit = self._client.register_script(_COMMIT)
        self._check = self._client.register_script(_CHECK)
        self._shared = {name: _Shared() for name in limits}
        self._locks = {name: asyncio.Lock() for name in limits}
        self._local: dict[str, EngineGate] | None = None  # this replica's own gates while degraded
        self._delivered: set[int] = set()  # ids of verdicts handed to `deliver`, not yet cleared
        self._deliver: Deliver = lambda engine, decisions: None
        self._changed: Callable[[str], None] = lambda engine: None
        self._tasks: list[asyncio.Task[None]] = []
        self._side_tasks: set[asyncio.Task[None]] = set()  # `_verify`s in flight
        self._verifying: set[str] = set()
        self._degraded_event = asyncio.Event()
        for name in limits:
            metrics.degraded.labels(name).set(0)
            metrics.conflicts.labels(name)
            metrics.lease_expiries.labels(name)
            for reason in ("vanished", "recreated", "regressed"):
                metrics.state_lost.labels(name, reason)

    # --- keys -------------------------------------------------------------------------------

    def _key(self, engine: str) -> str:
        return f"{{{self._prefix}:{engine}}}:state"

    def _channel(self, engine: str) -> str:
        return f"{{{self._prefix}:{engine}}}:events"

    # --- views ------------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self._local is not None

    def gate(self, engine: str) -> EngineGate:
        """This replica's latest view of the engine's gate (its own gate while degraded)."""
        if self._local is not None:
            return self._local[engine]
        return self._view(engine)[0]

    def _view(self, engine: str) -> tuple[EngineGate, dict[str, Any]]:
        shared = self._shared[engine]
        if shared.view is None or shared.verdicts is None:
            doc = json.loads(shared.state) if shared.state else {}
            shared.view = EngineGate.from_state(self._limits[engine], doc)
            shared.verdicts = doc.get("verdicts", {})
        return shared.view, shared.verdicts

    def lease_until(self, now: float) -> float | None:
        return now + self._lease

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self, deliver: Deliver, changed: Callable[[str], None]) -> None:
        self._deliver, self._changed = deliver, changed
        try:
            for engine in self._limits:
                await self._read(engine)
        except LedgerUnavailable as exc:
            self._degrade(str(exc))
        self._tasks = [asyncio.create_task(self._listen(), name="ledger-listen"),
                       asyncio.create_task(self._renew_loop(), name="ledger-renew")]

    async def stop(self) -> None:
        for task in (*self._tasks, *self._side_tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._side_tasks, return_exceptions=True)
        self._tasks = []
        await self._client.aclose()
        await self._pubsub_client.aclose()

    # --- transactions -----------------------------------------------------------------------

    async def transact(self, engine: str, event: Event) -> list[Decision]:
        async with self._locks[engine]:
            if self._local is not None:
                return event(self._local[engine])
            try:
                return await self._transact_shared(engine, event)
            except LedgerUnavailable as exc:
                self._degrade(str(exc))
                assert self._local is not None
                return event(self._local[engine])
            finally:
                self._take_pending(engine)

    async def _transact_shared(self, engine: str, event: Event, stale_verdicts: bool = False) -> list[Decision]:
        """Run `event` on the shared state until a commit lands (call under the engine's lock).
        `stale_verdicts`: this replica's verdicts are cleared without being returned. Decisions
        that putting this replica's tickets back after a lost state made come first."""
        shared = self._shared[engine]
        rebuilt: list[Decision] = []
        while True:
            gate, verdicts = self._view(engine)
            shared.view = shared.verdicts = None  # mutated below: re-parsed unless the commit lands
            decisions, verdicts, cleared, expired = self._run(engine, gate, verdicts, event, stale_verdicts)
            state = _dump(gate, verdicts)
            if state == shared.state:
                # Nothing to write, but the decisions were made on this replica's last view: they
                # stand only if that view is still the committed state.
                ok, version, current, epoch = await self._call("check", self._check(
                    keys=[self._key(engine)], args=[shared.version, shared.epoch]))
                if int(ok) == 1:
                    shared.view, shared.verdicts = gate, verdicts
                    return [*rebuilt, *decisions]
                rebuilt += await self._conflict(engine, str(version), str(epoch), current)
                continue
            ok, version, current, epoch = await self._call("commit", self._commit(
                keys=[self._key(engine)], args=[shared.version, state, self._channel(engine), shared.epoch]))
            if int(ok) == 1:
                if expired:  # counted once the commit lands: an event may run more than once
                    self._metrics.lease_expiries.labels(engine).inc(len(expired))
                    log.warning("dropped tickets whose replica stopped renewing its lease",
                                extra={"engine": engine, "tickets": len(expired),
                                       "replicas": sorted({t.owner for t in expired})})
                self._delivered -= cleared
                shared.version, shared.epoch, shared.state = str(version), str(epoch), state
                shared.view, shared.verdicts = gate, verdicts
                if self._local is not None:  # degraded while this commit was in flight: keep its effect
                    mine = EngineGate.from_state(self._limits[engine], gate.to_state())
                    mine.keep_only(self.replica)
                    self._local[engine] = mine
                self._changed(engine)
                return [*rebuilt, *decisions]
            rebuilt += await self._conflict(engine, str(version), str(epoch), current)

    def _run(self, engine: str, gate: EngineGate, verdicts: dict[str, Any], event: Event,
             stale_verdicts: bool = False) -> tuple[list[Decision], dict[str, Any], set[int], list[Ticket]]:
        """Apply `event` to `gate` with the ledger's bookkeeping. Returns the decisions about this
        replica's tickets (with the verdicts others left for it), the verdicts to store, the ids of
        this replica's verdicts cleared from them, and the tickets dropped for an expired lease."""
        now = self._clock()
        verdicts = dict(verdicts)
        expired, released = gate.purge_expired(now)
        mine: list[Decision] = []
        cleared: set[int] = set()
        for key, v in list(verdicts.items()):
            if v["w"] == self.replica:
                del verdicts[key]
                cleared.add(int(key))
                if int(key) not in self._delivered and not stale_verdicts:
                    mine.append(_verdict_decision(v))
            elif v["x"] < now:
                del verdicts[key]
        for decision in [*released, *event(gate)]:
            if decision.ticket.owner in ("", self.replica):
                mine.append(decision)
            else:
                verdicts[str(decision.ticket.id)] = {
                    "t": decision.ticket.to_state(), "o": decision.outcome.value, "r": decision.retry_after,
                    "w": decision.ticket.owner, "x": now + 2 * self._lease}
        return mine, verdicts, cleared, expired

    async def _conflict(self, engine: str, version: str, epoch: str, state: str) -> list[Decision]:
        """The committed state was not the one an event ran on: take it, and if it shows that the
        state this replica knew was lost, put this replica's tickets back in it first."""
        shared = self._shared[engine]
        loss = state_loss(shared.version, shared.epoch, version, epoch)
        if loss is None:
            self._metrics.conflicts.labels(engine).inc()
            self._take(engine, version, epoch, state)
            return []
        known = (shared.version, shared.epoch, shared.state)
        self._take(engine, version, epoch, state)
        try:
            return await self._rebuild(engine, loss, known)
        except LedgerUnavailable:
            self._take(engine, *known)  # going degraded: from what this replica knew, its tickets included
            raise

    async def _rebuild(self, engine: str, loss: str, known: tuple[str, str, str]) -> list[Decision]:
        """Put this replica's open and parked tickets, as the lost state held them, back into the
        current one (as after a Redis restart), with the lost state's scrape if it has none."""
        known_version, _, known_state = known
        lost = EngineGate.from_state(self._limits[engine], json.loads(known_state) if known_state else {})
        now = self._clock()
        known_tickets = [Ticket.from_state(t.to_state()) for t in (*lost.admitted(), *lost.queued())]
        mine = [t for t in known_tickets if t.owner == self.replica]
        for t in mine:
            t.lease_until = now + self._lease
        # The other replicas' tickets as this one last saw them hold their places until each puts
        # its own back (or their leases run out): else the first replica to rebuild sees the engine
        # emptier than it is (a request another replica admitted after the last scrape) and admits
        # into a full engine.
        theirs: dict[str, list[Ticket]] = {}
        for t in known_tickets:
            if t.owner and t.owner != self.replica:
                theirs.setdefault(t.owner, []).append(t)
        snapshot = lost.snapshot
        self._metrics.state_lost.labels(engine, loss).inc()
        log.warning("shared ledger state lost; putting this replica's requests back",
                    extra={"engine": engine, "reason": loss, "replica": self.replica,
                           "known_version": known_version, "found_version": self._shared[engine].version,
                           "admitted": sum(t.state is TicketState.ADMITTED for t in mine),
                           "parked": sum(t.state is TicketState.PARKED for t in mine)})

        def put_back(gate: EngineGate) -> list[Decision]:
            gate.replace_owner(self.replica, [Ticket.from_state(t.to_state()) for t in mine])
            present = {t.owner for t in (*gate.admitted(), *gate.queued())}
            for owner, tickets in theirs.items():
                if owner not in present:  # that replica has not put its own back yet
                    gate.replace_owner(owner, [Ticket.from_state(t.to_state()) for t in tickets])
            if gate.snapshot is None and snapshot is not None:  # the scrape was lost with it
                return gate.observe(snapshot, self._clock())
            return []

        return await self._transact_shared(engine, put_back)

    async def _read(self, engine: str) -> None:
        version, state, epoch = await self._call("read", self._client.hmget(self._key(engine), "v", "state", "e"))
        self._take(engine, version or "0", epoch or "", state or "")

    def _take(self, engine: str, version: str, epoch: str, state: str) -> None:
        shared = self._shared[engine]
        shared.version, shared.epoch, shared.state, shared.view, shared.verdicts = version, epoch, state, None, None

    async def _call(self, op: str, call: Awaitable[Any]) -> Any:
        started = time.perf_counter()
        try:
            return await asyncio.wait_for(call, self._timeout)
        except (TimeoutError, OSError, ConnectionError) as exc:
            raise LedgerUnavailable(f"{op}: {type(exc).__name__}: {exc}") from None
        except Exception as exc:  # redis.RedisError and friends: never fail a request over Redis
            if type(exc).__module__.startswith("redis"):
                raise LedgerUnavailable(f"{op}: {type(exc).__name__}: {exc}") from None
            raise
        finally:
            self._metrics.round_trip.labels(op).observe(time.perf_counter() - started)

    # --- notifications ----------------------------------------------------------------------

    def _on_published(self, engine: str, data: str) -> None:
        version, _, rest = data.partition(" ")
        epoch, _, state = rest.partition(" ")
        shared = self._shared[engine]
        if self._locks[engine].locked():  # a transaction runs: take it when it is done
            if shared.pending is None or int(version) > int(shared.pending[0]):
                shared.pending = (version, epoch, state)
            return
        self._take_newer(engine, version, epoch, state)

    def _take_pending(self, engine: str) -> None:
        shared = self._shared[engine]
        if shared.pending is not None:
            version, epoch, state = shared.pending
            shared.pending = None
            self._take_newer(engine, version, epoch, state)

    def _take_newer(self, engine: str, version: str, epoch: str, state: str) -> None:
        shared = self._shared[engine]
        if self._local is not None:
            return
        if shared.version != "0" and epoch != shared.epoch:
            # Another lifetime of the state: the one this replica knew was lost. A transaction
            # compares with what Redis holds now and puts this replica's tickets back.
            self._verify(engine)
            return
        if int(version) <= int(shared.version):
            return
        self._take(engine, version, epoch, state)
        self._deliver_verdicts(engine)
        self._changed(engine)

    def _deliver_verdicts(self, engine: str) -> None:
        _, verdicts = self._view(engine)
        mine = [_verdict_decision(v) for v in verdicts.values()
                if v["w"] == self.replica and v["t"]["i"] not in self._delivered]
        if mine:
            self._delivered |= {d.ticket.id for d in mine}
            self._deliver(engine, mine)

    def _verify(self, engine: str) -> None:
        """Soon compare this replica's view with the committed state (a no-op transaction)."""
        if engine in self._verifying:
            return
        self._verifying.add(engine)

        async def verify() -> None:
            try:
                decisions = await self.transact(engine, lambda g: [])
                if decisions:
                    self._deliver(engine, decisions)
            finally:
                self._verifying.discard(engine)
            self._deliver_verdicts(engine)
            self._changed(engine)

        task = asyncio.create_task(verify(), name=f"ledger-verify-{engine}")
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _listen(self) -> None:
        """Follow every engine's commits; after any gap, re-read the state."""
        channels = {self._channel(engine): engine for engine in self._limits}
        while True:
            pubsub = self._pubsub_client.pubsub()
            try:
                await pubsub.subscribe(*channels)
                if self._local is None:
                    for engine in self._limits:
                        # Whatever was committed before we listened; a state lost meanwhile (Redis
                        # restarted while nothing was decided) is found here and rebuilt.
                        decisions = await self.transact(engine, lambda g: [])
                        if decisions:
                            self._deliver(engine, decisions)
                        self._deliver_verdicts(engine)
                        self._changed(engine)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message["type"] == "message":
                        self._on_published(channels[message["channel"]], message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any Redis trouble: subscribe again
                log.debug("ledger subscription lost; subscribing again", extra={"detail": str(exc)})
                await asyncio.sleep(0.5)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001
                    pass

    # --- leases and recovery ----------------------------------------------------------------

    async def _renew_loop(self) -> None:
        while True:
            interval = self._lease / 3 if self._local is None else min(RECOVERY_INTERVAL_SECONDS, self._lease / 3)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._degraded_event.wait(), interval)  # going degraded wakes it
            self._degraded_event.clear()
            try:
                if self._local is not None:
                    await self._recover()
                else:
                    for engine in self._limits:
                        # Renewing also purges others' expired leases, which may release our tickets.
                        decisions = await self.transact(engine, self._renew_event)
                        if decisions:
                            self._deliver(engine, decisions)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep renewing whatever one round did
                log.exception("ledger lease renewal failed")

    def _renew_event(self, gate: EngineGate) -> list[Decision]:
        gate.renew(self.replica, self._clock() + self._lease)
        return []

    def _degrade(self, detail: str) -> None:
        if self._local is not None:
            return
        local = {}
        for engine in self._limits:
            gate, _ = self._view(engine)
            self._shared[engine].view = self._shared[engine].verdicts = None
            gate.keep_only(self.replica)
            local[engine] = gate
            self._metrics.degraded.labels(engine).set(1)
        self._local = local
        self._degraded_event.set()
        self._metrics.degraded_total.inc()
        log.error("shared ledger unavailable; deciding alone (per-replica budget) until it answers",
                  extra={"replica": self.replica, "detail": detail})

    async def _recover(self) -> None:
        """Go back to the shared ledger if Redis answers, putting this replica's tickets in it.

        Every engine's lock is held throughout, so no event runs on the local gates between
        their tickets being copied into the shared state and the switch back to it."""
        assert self._local is not None
        async with contextlib.AsyncExitStack() as held:
            for engine in self._limits:
                await held.enter_async_context(self._locks[engine])
            released: dict[str, list[Decision]] = {}
            try:
                for engine in self._limits:
                    await self._read(engine)
                    local = self._local[engine]
                    now = self._clock()
                    mine = [Ticket.from_state(t.to_state()) for t in (*local.admitted(), *local.queued())]
                    for t in mine:
                        t.lease_until = now + self._lease

                    def put_back(gate: EngineGate, mine: list[Ticket] = mine, local: EngineGate = local,
                                 now: float = now) -> list[Decision]:
                        gate.replace_owner(self.replica, mine)
                        # A Redis that lost its state would otherwise know no scrape until the next poll.
                        return gate.observe(local.snapshot, now) if local.snapshot is not None else []

                    # While alone, this replica's own view of its tickets is the truth: what the
                    # shared state said about them before is dropped.
                    released[engine] = await self._transact_shared(engine, put_back, stale_verdicts=True)
            except LedgerUnavailable:
                return
            self._local = None
            for engine in self._limits:
                self._metrics.degraded.labels(engine).set(0)
        for engine in self._limits:
            self._take_pending(engine)
            if released.get(engine):
                self._deliver(engine, released[engine])
            self._deliver_verdicts(engine)
            self._changed(engine)
        log.info("shared ledger answers again; this replica's open requests are registered in it",
                 extra={"replica": self.replica})


def _verdict_decision(v: dict[str, Any]) -> Decision:
    return Decision(Ticket.from_state(v["t"]), Outcome(v["o"]), v["r"])


def _dump(gate: EngineGate, verdicts: dict[str, Any]) -> str:
    doc = gate.to_state()
    if verdicts:
        doc["verdicts"] = verdicts
    return json.dumps(doc, separators=(",", ":"))
