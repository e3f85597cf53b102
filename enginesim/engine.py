"""The asyncio side of the simulator: engine clock, one step loop per DP rank, routing.

Engine time vs wall time: ``EngineClock`` runs ``time_scale`` times faster than the
monotonic clock. A busy rank runs its steps back to back in ENGINE time (the next step
starts exactly where the previous one ended) and sleeps until the wall time at which the
step would end. It does not sleep for less than ``MIN_SLEEP_S`` (the event loop's timer
granularity is ~1 ms), so wake-up jitter never stretches engine time; it just lets the
rank run a little ahead or behind the wall clock for a few steps. An arrival stamped
later than the rank's own timeline pulls the timeline forward, so queue times are never
negative. Every reported duration is therefore in unscaled engine seconds.

As in vLLM, new requests wait in an input queue while a step runs and reach the scheduler
between steps, and the published gauges are a snapshot taken after each step. While the
engine is held (``/control/hold``) no new step is scheduled (a step already scheduled runs
to its end); arrivals and aborts then reach the scheduler and the gauges at once, so a held
engine shows its queue.

Two step loops, by profile:

- synchronous (``vllm-0.11``; EngineCore.step): schedule a batch, run it, apply its outputs,
  publish. A request that arrives while batch k runs joins batch k+1, the next one.
- async scheduling (``vllm-0.33``; EngineCore.step_with_batch_queue with a batch queue of
  2, vllm/v1/engine/core.py, and AsyncScheduler): the scheduler runs one batch ahead of the
  GPU. When batch k starts executing, batch k+1 is scheduled at once, from the inputs
  received so far and the outputs of batch k-1 (batch k's are not known yet: its sampled
  tokens are output placeholders). So a request that arrives while batch k-1 runs is
  admitted into batch k+1, and a request that finishes in batch k-1 frees its slot and
  blocks for batch k+1: one batch later than synchronous scheduling. The outputs of batch
  k-1 are applied, and the scheduler stats published, after batch k+1 has been scheduled,
  so the published gauges already include the next batch (its admissions, preemptions and
  blocks). From idle, the first two batches are scheduled back to back (the second decodes
  the token the first will sample), as vLLM does when its batch queue is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .config import SimConfig
from .metrics import EngineMetrics
from .scheduler import ScheduledStep, Scheduler, SchedulerStats, StepOutput, TokenOutput

__all__ = ["Engine", "EngineClock", "EngineRank", "RequestHandle"]

log = logging.getLogger("enginesim.engine")

MIN_SLEEP_S = 0.001


class EngineClock:
    """Engine seconds since start: wall (monotonic) seconds times ``time_scale``."""

    def __init__(self, time_scale: float, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.time_scale = time_scale
        self._monotonic = monotonic
        self._origin = monotonic()

    def now(self) -> float:
        return (self._monotonic() - self._origin) * self.time_scale

    def wall_delay_until(self, engine_time: float) -> float:
        """Wall seconds from now until the clock reads ``engine_time`` (may be negative)."""
        return (engine_time - self.now()) / self.time_scale


@dataclass(eq=False)
class RequestHandle:
    """The HTTP side's view of one request: a queue of tokens, ended by a sentinel."""

    engine_request_id: str
    prompt_tokens: int
    max_tokens: int
    engine_index: int = 0
    eos_at: int | None = None  # the model ends it here (EOS / stop string), before max_tokens
    prefix: tuple[str, int] | None = None  # shared prompt blocks (the n sequences of one request)
    arrival_time: float = 0.0
    state: str = "queued"  # queued, waiting, running, finished, aborted
    preemptions: int = 0
    computed_tokens: int = 0  # tokens the engine computed for it (prefill, recompute, decode)
    recomputed_tokens: int = 0  # of those, context computed again after a preemption
    tokens: asyncio.Queue[TokenOutput | None] = field(default_factory=asyncio.Queue)
    info: dict[str, Any] = field(default_factory=dict)
    arrival: dict[str, Any] = field(default_factory=dict)  # this request's /control/arrivals entry

    @property
    def done(self) -> bool:
        return self.state in ("finished", "aborted")

    def __repr__(self) -> str:
        return (f"RequestHandle({self.engine_request_id!r}, engine={self.engine_index}, "
                f"{self.state}, prompt={self.prompt_tokens}, max_tokens={self.max_tokens})")


class EngineRank:
    """One DP rank: a scheduler, its input queue and its step loop."""

    def __init__(self, index: int, engine: Engine) -> None:
        self.index = index
        self._engine = engine
        self.scheduler = Scheduler(engine.config.scheduler, engine.config.profile)
        self._pending: list[RequestHandle] = []
        self._handles: dict[str, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._step_in_flight = False
        self._timeline: float | None = None  # end of the last step while busy
        self._last_end = 0.0
        self._resume_at: float | None = None
        self.max_running = 0
        self.max_waiting = 0
        self.num_steps = 0
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"rank{self.index}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- requests -------------------------------------------------------------------------

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running) as vLLM's DP load balancer counts them."""
        return len(self.scheduler.waiting) + len(self._pending), len(self.scheduler.running)

    def submit(self, handle: RequestHandle) -> None:
        stamp = self._engine.clock.now()
        handle.arrival_time = stamp
        handle.engine_index = self.index
        self._handles[handle.engine_request_id] = handle
        if self._engine.held:
            self._admit(handle)
            self._publish()
        else:
            self._pending.append(handle)
        self._note_peaks()
        self._wake.set()

    def abort(self, handle: RequestHandle) -> None:
        if handle.done:
            return
        if handle in self._pending:
            self._pending.remove(handle)
        else:
            self.scheduler.abort(handle.engine_request_id)
            if not self._step_in_flight:
                self._publish()
        handle.state = "aborted"
        self._handles.pop(handle.engine_request_id, None)
        self._engine.record_end(handle)

    def fail_all(self) -> None:
        """End every request (engine reset): their streams stop without finishing."""
        for handle in list(self._handles.values()):
            handle.state = "aborted"
            handle.tokens.put_nowait(None)
        self._handles.clear()
        self._pending.clear()

    def resume(self, now: float) -> None:
        """The hold was released at engine time ``now``: continue from there."""
        self._resume_at = now
        self._wake.set()

    def _admit(self, handle: RequestHandle) -> None:
        self.scheduler.add_request(handle.engine_request_id, handle.prompt_tokens,
                                   handle.max_tokens, handle.arrival_time, prefix=handle.prefix,
                                   eos_at=handle.eos_at)
        handle.state = "waiting"

    def _publish(self) -> None:
        self._engine.metrics.publish(self.index, self.scheduler.stats())

    def _note_peaks(self) -> None:
        waiting, running = self.load
        self.max_waiting = max(self.max_waiting, waiting)
        self.max_running = max(self.max_running, running)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # -- the step loop --------------------------------------------------------------------

    async def _run(self) -> None:
        if self.scheduler.profile.async_scheduling:
            await self._run_async()
        else:
            await self._run_sync()

    def _start_time(self, batch: list[RequestHandle]) -> float:
        """Where an idle rank's next step starts: when the request that woke it arrived (or
        the hold was released), never before the end of its last step."""
        base = self._timeline if self._timeline is not None else self._resume_at
        self._resume_at = None
        candidates = [h.arrival_time for h in batch]
        if base is not None:
            candidates.append(base)
        start = max(candidates) if candidates else self._engine.clock.now()
        return max(start, self._last_end)

    def _after_schedule(self, step: ScheduledStep) -> None:
        self._note_peaks()
        for request_id, tokens in step.num_scheduled_tokens.items():
            handle = self._handles.get(request_id)
            if handle is not None:
                handle.computed_tokens += tokens
                handle.recomputed_tokens += step.recomputed_tokens.get(request_id, 0)
        for request in self.scheduler.running:
            handle = self._handles.get(request.request_id)
            if handle is not None:
                handle.state = "running"
        for request_id in step.preempted:
            handle = self._handles.get(request_id)
            if handle is not None:
                handle.state = "waiting"
                handle.preemptions += 1

    async def _execute(self, step: ScheduledStep) -> None:
        """Wait (wall time) until ``step`` ends, then apply its outputs and publish."""
        engine = self._engine
        self._step_in_flight = True
        try:
            delay = engine.clock.wall_delay_until(step.end_time)
            await asyncio.sleep(delay if delay >= MIN_SLEEP_S else 0)
        finally:
            self._step_in_flight = False
        output = self.scheduler.complete(step)
        self._timeline = self._last_end = step.end_time
        self.num_steps += 1
        engine.metrics.record_step(self.index, step, output)
        self._publish()
        self._deliver(output)

    def _deliver(self, output: StepOutput) -> None:
        engine = self._engine
        for token in output.tokens:
            handle = self._handles.get(token.request_id)
            if handle is None:
                continue
            handle.tokens.put_nowait(token)
            if token.finished:
                handle.state = "finished"
                handle.tokens.put_nowait(None)
                del self._handles[token.request_id]
                engine.record_end(handle)

    async def _idle(self) -> None:
        """Nothing to run: drop the timeline and wait for an arrival, a resume or a wake-up."""
        self._timeline = None
        self._wake.clear()
        await self._wake.wait()

    async def _run_async(self) -> None:
        """vLLM 0.33's async scheduling: see the module docstring."""
        engine = self._engine
        in_flight: ScheduledStep | None = None  # scheduled, executing (or next to execute)
        while True:
            if engine.held or not (self._pending or self.scheduler.has_unfinished):
                if in_flight is not None:  # already scheduled: it runs to its end
                    await self._execute(in_flight)
                    in_flight = None
                    continue
                await self._idle()
                continue
            batch, self._pending = self._pending, []
            for handle in batch:
                self._admit(handle)
            start = in_flight.end_time if in_flight is not None else self._start_time(batch)
            step = self.scheduler.schedule(start)
            self._after_schedule(step)
            if in_flight is None:
                if step.is_empty:  # cannot happen with a valid config; never spin
                    await self._idle()
                    continue
                in_flight = step  # the batch queue has room: schedule the next one at once
                continue
            await self._execute(in_flight)
            in_flight = None if step.is_empty else step

    async def _run_sync(self) -> None:
        """vLLM 0.11: schedule a step, run it, apply its outputs, then schedule the next."""
        engine = self._engine
        while True:
            if engine.held or not (self._pending or self.scheduler.has_unfinished):
                await self._idle()
                continue
            batch, self._pending = self._pending, []
            for handle in batch:
                self._admit(handle)
            step = self.scheduler.schedule(self._start_time(batch))
            self._after_schedule(step)
            if step.is_empty:  # cannot happen with a valid config; never spin
                await self._idle()
                continue
            await self._execute(step)


class Engine:
    """All DP ranks, request routing, hold, and the bookkeeping /control reports."""

    def __init__(self, config: SimConfig, clock: EngineClock | None = None) -> None:
        self.config = config
        self.clock = clock or EngineClock(config.time_scale)
        self.held = False
        self._ids = itertools.count()
        self._rr = itertools.count()
        self._new_state()

    def _new_state(self) -> None:
        # where generations end and what they say: one seeded stream, drawn in arrival order
        self.rng = random.Random(self.config.seed)
        self.metrics = EngineMetrics(self.config.model, self.config.scheduler,
                                     range(self.config.data_parallel_size), profile=self.config.profile,
                                     dialect=self.config.dialect)
        self.ranks = [EngineRank(i, self) for i in range(self.config.data_parallel_size)]
        self.arrivals: list[dict[str, Any]] = []
        self.requests: list[RequestHandle] = []
        self.num_finished = 0
        self.num_aborted = 0
        # Ground truth for benchmarks: (monotonic wall time, requests held, KV tokens they will
        # hold at most), appended whenever a request arrives or ends. See ``occupancy``.
        self._held = 0
        self._committed = 0
        self.timeline: list[tuple[float, int, int]] = [(time.monotonic(), 0, 0)]

    def start(self) -> None:
        for rank in self.ranks:
            rank.start()

    async def stop(self) -> None:
        for rank in self.ranks:
            rank.fail_all()
            await rank.stop()

    async def reset(self) -> None:
        """Fresh schedulers and counters; requests in flight end unfinished."""
        await self.stop()
        self.held = False
        self._ids = itertools.count()
        self._rr = itertools.count()
        self._new_state()
        self.start()

    def set_hold(self, hold: bool) -> None:
        was_held, self.held = self.held, hold
        if was_held and not hold:
            now = self.clock.now()
            for rank in self.ranks:
                rank.resume(now)

    def _route(self) -> EngineRank:
        if len(self.ranks) == 1:
            return self.ranks[0]
        if self.config.dp_routing == "least-loaded":
            # vLLM's DPLBAsyncMPClient: lowest waiting * 4 + running, first rank on ties.
            return min(self.ranks, key=lambda r: (r.load[0] * 4 + r.load[1], r.index))
        return self.ranks[next(self._rr) % len(self.ranks)]

    def submit(self, prompt_tokens: int, max_tokens: int, info: dict[str, Any], *,
               eos_at: int | None = None, prefix: tuple[str, int] | None = None,
               tokens: asyncio.Queue[TokenOutput | None] | None = None) -> RequestHandle:
        """Queue a validated sequence on a rank; returns the handle to read tokens from.

        ``tokens``: a queue shared by the sequences of one request (``n`` > 1), which then
        receives one ``None`` per sequence."""
        seq = next(self._ids)
        handle = RequestHandle(f"req-{seq}", prompt_tokens, max_tokens, eos_at=eos_at,
                               prefix=prefix, info=info)
        if tokens is not None:
            handle.tokens = tokens
        rank = self._route()
        rank.submit(handle)
        self.requests.append(handle)
        handle.arrival = {"seq": seq, **info, "engine": rank.index,
                          "engine_request_id": handle.engine_request_id,
                          "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
                          "eos_at": eos_at,
                          "arrival_time": handle.arrival_time, "wall_time": time.monotonic()}
        self.arrivals.append(handle.arrival)
        self._note_occupancy(+1, handle)
        return handle

    def abort(self, handle: RequestHandle) -> None:
        self.ranks[handle.engine_index].abort(handle)

    def record_end(self, handle: RequestHandle) -> None:
        if handle.state == "finished":
            self.num_finished += 1
        elif handle.state == "aborted":
            self.num_aborted += 1
        self._note_occupancy(-1, handle)

    def need_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """The most KV a request can hold (prompt + every token it may generate), in whole blocks."""
        block = self.config.scheduler.block_size
        return -(-(prompt_tokens + max_tokens) // block) * block

    def _note_occupancy(self, sign: int, handle: RequestHandle) -> None:
        self._held += sign
        self._committed += sign * self.need_tokens(handle.prompt_tokens, handle.max_tokens)
        self.timeline.append((time.monotonic(), self._held, self._committed))

    def occupancy(self) -> dict[str, Any]:
        """The /control/timeline document: when the engine had room, for work-conservation figures.

        A request is held from its arrival until it finishes or is aborted (waiting, running or
        preempted). ``committed_tokens`` is the KV those requests will hold at most: what a
        newcomer's whole need must fit beside so that it can never cause a preemption.
        """
        sched = self.config.scheduler
        return {
            "max_num_seqs": sched.max_num_seqs * len(self.ranks),
            "capacity_tokens": sched.usable_blocks * sched.block_size * len(self.ranks),
            "block_size": sched.block_size,
            "timeline": self.timeline,
        }

    def state(self) -> dict[str, Any]:
        """The /control/state document."""
        ranks = []
        for rank in self.ranks:
            stats = rank.stats()
            waiting, running = rank.load
            ranks.append({"engine": rank.index, "running": running, "waiting": waiting,
                          "kv_usage": stats.kv_cache_usage, "used_blocks": stats.used_blocks,
                          "num_preemptions": rank.scheduler.num_preemptions,
                          "recomputed_tokens": rank.scheduler.num_recomputed_tokens,
                          "max_running": rank.max_running, "max_waiting": rank.max_waiting,
                          "steps": rank.num_steps})
        return {
            "running": sum(r["running"] for r in ranks),
            "waiting": sum(r["waiting"] for r in ranks),
            "kv_usage": max(r["kv_usage"] for r in ranks),
            "num_preemptions": sum(r["num_preemptions"] for r in ranks),
            # tokens of context computed again after preemptions (none of them cached on resume)
            "recomputed_tokens": sum(r["recomputed_tokens"] for r in ranks),
            "finished": self.num_finished,
            "aborted": self.num_aborted,
            "max_running": max(r["max_running"] for r in ranks),
            "max_waiting": max(r["max_waiting"] for r in ranks),
            "held": self.held,
            "engine_time": self.clock.now(),
            "engines": ranks,
            "requests": [
                {"engine_request_id": h.engine_request_id,
                 "request_id": h.info.get("request_id"), "engine": h.engine_index,
                 "state": h.state, "prompt_tokens": h.prompt_tokens, "max_tokens": h.max_tokens,
                 "preemptions": h.preemptions, "computed_tokens": h.computed_tokens,
                 "recomputed_tokens": h.recomputed_tokens}
                for h in self.requests
            ],
        }

