"""Poll each engine's /metrics and feed the gates.

One shared aiohttp session; one task per engine, polling on a fixed schedule. A poll that does
not answer within the poll timeout (`ENGINE_POLL_TIMEOUT_SECONDS`, by default two poll intervals:
a busy API server may answer after the interval) counts as failed, so a hung engine goes stale
after `stale_after_polls` such polls just like an unreachable one. Plain text is requested (no
OpenMetrics Accept header), as vLLM serves it.

`observer_degraded` follows parsability: the first poll must yield all three gauges or the
service logs ERROR and sets it to 1; afterwards it is 1 exactly while fetched documents do not
parse. A fetch failure (engine down) leaves it as it was after the first poll: that is staleness,
not a format problem.

A document is used only if it parses completely (`parse_engine_metrics`): a truncated body, a
missing family, a value out of range is a failed poll (`engine_poll_failures_total{reason=
"unparsable"}`) and the gate keeps the last good state until `stale_after_polls` failures in a
row make it fail open. Once an engine has shown its KV capacity, a document without it
is such a failure too (a body cut in half), not a reason to switch the KV budget off; a
different capacity (the engine restarted with another cache size) is taken and logged. The
expectation lasts for the life of this process: restart the service if an engine is downgraded
to a version that does not expose the family at all.

Each engine's metrics are read through its dialect (extproc/dialects.py). With `dialect: auto`
the first document that carries a known dialect's running-requests family decides it, for the
life of this process: it is logged once and shown as `admission_engine_dialect{engine,dialect}`
= 1 (and on /debug/engines); until then a document counts as unparsable.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .admission import Admission
from .config import EngineConfig, Settings
from .dialects import AUTO, DIALECTS, Dialect, detect
from .enginemetrics import EngineGauges, MetricsFormatError, parse_engine_metrics
from .gate import EngineSnapshot
from .metrics import Metrics

log = logging.getLogger("extproc.observer")


class EngineObserver:
    def __init__(self, settings: Settings, admission: Admission, metrics: Metrics) -> None:
        self._settings = settings
        self._admission = admission
        self._metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._first_done: dict[str, asyncio.Event] = {}
        self._polls: dict[str, int] = {}
        self._degraded: dict[str, bool] = {}
        self._capacity_source: dict[str, str] = {}
        self._capacity_seen: dict[str, bool] = {}  # the engine has shown its KV capacity
        self._prompt_tokens: dict[str, float] = {}  # the engine's prompt-token counter at the last poll
        self._dialects: dict[str, Dialect] = {}  # configured, or detected from the first exposition
        self._drifting: dict[str, bool] = {}  # the last good poll showed running > max in-flight
        self._engines = [e for e in settings.engines if e.models]
        for engine in self._engines:
            if engine.dialect != AUTO:
                self._set_dialect(engine, DIALECTS[engine.dialect], "configured")

    async def start(self) -> None:
        """Start polling; returns once every engine's first poll has finished (either way)."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._settings.poll_timeout),
            headers={"Accept": "text/plain"},
        )
        for engine in self._engines:
            self._first_done[engine.name] = asyncio.Event()
            self._polls[engine.name] = 0
            self._tasks.append(asyncio.create_task(self._run(engine), name=f"observer:{engine.name}"))
        if self._first_done:
            await asyncio.gather(*(e.wait() for e in self._first_done.values()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def poll_count(self, engine: str) -> int:
        return self._polls.get(engine, 0)

    def dialect(self, engine: str) -> str | None:
        """The metrics dialect the engine is read with (None: auto, not detected yet)."""
        d = self._dialects.get(engine)
        return d.name if d else None

    def _set_dialect(self, engine: EngineConfig, dialect: Dialect, how: str) -> None:
        self._dialects[engine.name] = dialect
        self._metrics.engine_dialect.labels(engine.name, dialect.name).set(1)
        log.info("engine metrics dialect", extra={"engine": engine.name, "dialect": dialect.name, "how": how})

    def _dialect_for(self, engine: EngineConfig, text: str) -> Dialect:
        """The engine's dialect; with auto, detected from this document (MetricsFormatError if none)."""
        known = self._dialects.get(engine.name)
        if known is not None:
            return known
        found = detect(text)
        if found is None:
            raise MetricsFormatError("no known metrics dialect: none of "
                                     f"{', '.join(d.running for d in DIALECTS.values())} is present")
        return found

    async def _run(self, engine: EngineConfig) -> None:
        loop = asyncio.get_running_loop()
        interval = self._settings.poll_interval
        next_at = loop.time()
        while True:
            await self.poll_once(engine)
            self._first_done[engine.name].set()
            next_at += interval
            now = loop.time()
            if next_at < now:  # fell behind (slow poll): keep the cadence, skip the missed ticks
                next_at = now + interval - ((now - next_at) % interval)
            await asyncio.sleep(next_at - now)

    async def poll_once(self, engine: EngineConfig) -> None:
        """Fetch and parse the engine's metrics once, and time it whatever the outcome."""
        t0 = time.perf_counter()
        try:
            await self._poll(engine)
        finally:
            self._metrics.poll_duration.labels(engine.name).observe(time.perf_counter() - t0)

    async def _poll(self, engine: EngineConfig) -> None:
        assert self._session is not None
        first = self._polls[engine.name] == 0
        self._polls[engine.name] += 1
        started = self._admission.now()
        try:
            async with self._session.get(engine.metrics_url) as response:
                if response.status != 200:
                    raise _PollError("http_status", f"HTTP {response.status}")
                text = await response.text(errors="replace")
        except _PollError as exc:
            return await self._failed(engine, exc.reason, exc.detail, first)
        except TimeoutError:
            return await self._failed(engine, "timeout", f"no answer within {self._settings.poll_timeout:g}s", first)
        except aiohttp.ClientError as exc:
            return await self._failed(engine, "unreachable", str(exc) or type(exc).__name__, first)
        try:
            dialect = self._dialect_for(engine, text)
            gauges = parse_engine_metrics(text, dialect=dialect,
                                          expect_capacity=self._capacity_seen.get(engine.name, False))
        except MetricsFormatError as exc:
            self._set_degraded(engine, True, str(exc), first)
            return await self._failed(engine, "unparsable", str(exc), first, degraded_logged=True)
        self._set_degraded(engine, False, "", first)
        if engine.name not in self._dialects:
            self._set_dialect(engine, dialect, "detected")
        if gauges.capacity_tokens:
            self._capacity_seen[engine.name] = True
        await self._succeeded(engine, gauges, started)

    async def _succeeded(self, engine: EngineConfig, gauges: EngineGauges, started: float) -> None:
        m = self._metrics
        m.running.labels(engine.name).set(gauges.running)
        m.waiting.labels(engine.name).set(gauges.waiting)
        m.kv_usage.labels(engine.name).set(gauges.kv_usage)
        m.kv_capacity.labels(engine.name).set(gauges.capacity_tokens or 0)
        snapshot = EngineSnapshot(
            running=gauges.running,
            waiting=gauges.waiting,
            kv_usage=gauges.kv_usage,
            scrape_started=started,
            capacity_tokens=gauges.capacity_tokens,
            block_size=gauges.block_size,
            prompt_tokens_total=gauges.prompt_tokens_total,
            generation_tokens_total=gauges.generation_tokens_total,
            generated_sum=gauges.generated_sum,
            generated_count=gauges.generated_count,
            generated_buckets=gauges.generated_buckets,
            prefix_hits=gauges.prefix_hits,
            prefix_queries=gauges.prefix_queries,
            preemptions=gauges.preemptions,
            prompt_sum=gauges.prompt_sum,
            prefill_time_sum=gauges.prefill_time_sum,
            decode_time_sum=gauges.decode_time_sum,
        )
        self._log_capacity_source(engine, gauges)
        self._check_limit_drift(engine, gauges.running)
        self._count_prompt_tokens(engine, gauges.prompt_tokens_total)
        await self._admission.observe(engine.name, snapshot)

    def _check_limit_drift(self, engine: EngineConfig, running: float) -> None:
        """Max in-flight must be the engine's --max-num-seqs, which no gauge shows; vLLM never runs more
        than --max-num-seqs, so running above the limit proves the two differ. Logged once per
        transition, counted (admission_engine_limit_drift_total), shown (..._running_over_limit)."""
        limit = engine.limits.max_inflight
        over = max(0.0, running - limit)
        self._metrics.running_over_limit.labels(engine.name).set(over)
        drifting = over > 0
        if drifting == self._drifting.get(engine.name, False):
            return
        self._drifting[engine.name] = drifting
        if drifting:
            self._metrics.limit_drift.labels(engine.name).inc()
            log.warning("the engine runs more requests than max_inflight: its --max-num-seqs is larger than the "
                        "configured limit (set max_inflight / ADMISSION_MAX_INFLIGHT to the engine's --max-num-seqs)",
                        extra={"engine": engine.name, "running": running, "max_inflight": limit})
        else:
            log.info("the engine runs no more requests than max_inflight again",
                     extra={"engine": engine.name, "running": running, "max_inflight": limit})

    def _count_prompt_tokens(self, engine: EngineConfig, total: float | None) -> None:
        """Mirror the engine's prompt-token counter's growth (the estimate ratio's denominator)."""
        if total is None:
            return
        last = self._prompt_tokens.get(engine.name)
        self._prompt_tokens[engine.name] = total
        if last is not None and total > last:  # a first reading or a restarted engine adds nothing
            self._metrics.engine_prompt_tokens.labels(engine.name).inc(total - last)

    def _log_capacity_source(self, engine: EngineConfig, gauges: EngineGauges) -> None:
        """Say once (and on every change) where the KV capacity for the budget comes from."""
        if gauges.capacity_tokens:
            source, tokens = DIALECTS[gauges.dialect].capacity_source(), gauges.capacity_tokens
        elif engine.limits.kv_capacity_tokens:
            source = "configured (ADMISSION_KV_CAPACITY_TOKENS / kv_capacity_tokens)"
            tokens = engine.limits.kv_capacity_tokens
        else:
            source, tokens = "unknown", None
        key = f"{source}:{tokens}"
        if self._capacity_source.get(engine.name) == key:
            return
        self._capacity_source[engine.name] = key
        if tokens is None:
            log.warning("KV capacity unknown: the engine's metrics show none and none is configured; "
                        "the KV-token budget is inactive, only the reference gates apply",
                        extra={"engine": engine.name, "dialect": gauges.dialect,
                               "capacity_from": DIALECTS[gauges.dialect].capacity_source()})
        else:
            log.info("KV capacity for the token budget", extra={"engine": engine.name, "capacity_tokens": tokens,
                                                                "source": source})

    async def _failed(self, engine: EngineConfig, reason: str, detail: str, first: bool,
                      degraded_logged: bool = False) -> None:
        self._metrics.poll_failures.labels(engine.name, reason).inc()
        if first and not degraded_logged:
            self._set_degraded(engine, True, f"{reason}: {detail}", first)
        log.debug("poll failed", extra={"engine": engine.name, "reason": reason, "detail": detail})
        await self._admission.poll_failed(engine.name, reason, detail)

    def _set_degraded(self, engine: EngineConfig, degraded: bool, detail: str, first: bool) -> None:
        before = self._degraded.get(engine.name)
        self._degraded[engine.name] = degraded
        self._metrics.degraded.labels(engine.name).set(1 if degraded else 0)
        if degraded and first:
            log.error(
                "first poll of the engine's metrics did not yield running, waiting and KV usage; "
                "observer is degraded and admission fails open until it does",
                extra={"engine": engine.name, "metrics_url": engine.metrics_url, "detail": detail},
            )
        elif degraded and before is False:
            log.error("engine metrics became unparsable; observer degraded",
                      extra={"engine": engine.name, "detail": detail})
        elif not degraded and before:
            log.info("engine metrics parse again; observer no longer degraded", extra={"engine": engine.name})


class _PollError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
