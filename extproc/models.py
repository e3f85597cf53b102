"""Which engine serves a model name: the configured list, kept current from each engine's /v1/models.

vLLM serves more names than it had at startup (LoRA adapters loaded at runtime, several
`--served-model-name` aliases), so the configured list drifts. The rule:

- a configured name (ADMISSION_OBSERVE_MODELS, or `engines[].models`) is always gated on its
  engine, served or not (the engine may still be loading it);
- a name an engine lists on `/v1/models` is gated on that engine; the list is re-read every
  ADMISSION_MODELS_REFRESH_SECONDS, and at once (at most once a second, one read shared by
  all callers) when a request names a model that no list holds, so an adapter loaded a moment
  ago is gated, not refused;
- a name that is neither configured nor served by any engine is answered 404 `unknown_model`,
  as vLLM itself would answer it, without a trip to the engine. Nothing passes ungated.

When two engines list the same name, the first engine in the configuration gets it (logged). A
failed read keeps that engine's previous list.

Each entry's `max_model_len` (vLLM lists the context limit per model) is kept with it:
`max_model_len(model)` is what `extproc/contextlen.py` checks a request against (None: the
engine does not say, and no length is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp

from .config import EngineConfig, Settings

log = logging.getLogger("extproc.models")

#: The fewest seconds between two reads caused by unknown names (a client naming a model that
#: does not exist must not turn into a stream of /v1/models calls).
MISS_REFRESH_INTERVAL_SECONDS = 1.0


class ModelRegistry:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._configured: dict[str, EngineConfig] = dict(settings.model_to_engine)
        self._engines = [e for e in settings.engines if e.models]  # engines under admission
        self._served: dict[str, tuple[str, ...]] = {e.name: () for e in self._engines}
        self._context: dict[str, dict[str, int]] = {e.name: {} for e in self._engines}  # engine -> model -> limit
        self._table: dict[str, EngineConfig] = dict(self._configured)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self._last_refresh = float("-inf")

    @property
    def enabled(self) -> bool:
        return self._settings.models_refresh_seconds > 0 and bool(self._engines)

    def engine_for(self, model: str) -> EngineConfig | None:
        return self._table.get(model)

    def max_model_len(self, model: str) -> int | None:
        """The context limit `model`'s engine lists for it on /v1/models (None: not listed)."""
        engine = self._table.get(model)
        return self._context.get(engine.name, {}).get(model) if engine is not None else None

    def known(self) -> list[str]:
        return sorted(self._table)

    def served(self) -> dict[str, list[str]]:
        """Each engine's names as last read from its /v1/models."""
        return {name: list(models) for name, models in self._served.items()}

    async def lookup(self, model: str) -> EngineConfig | None:
        """The engine for `model`, re-reading the engines' lists first if no list holds it."""
        engine = self._table.get(model)
        if engine is not None or not self.enabled:
            return engine
        if self._refreshing is None and time.monotonic() - self._last_refresh < MISS_REFRESH_INTERVAL_SECONDS:
            return None
        await self.refresh()
        return self._table.get(model)

    async def refresh(self) -> None:
        """Re-read every engine's /v1/models; concurrent callers share one read."""
        if self._refreshing is None:
            self._refreshing = task = asyncio.ensure_future(self._refresh())
            task.add_done_callback(self._refreshed)
        with contextlib.suppress(Exception):  # logged by _refreshed; the previous lists stay
            await asyncio.shield(self._refreshing)

    def _refreshed(self, task: asyncio.Future[None]) -> None:
        if self._refreshing is task:
            self._refreshing = None
        if not task.cancelled() and task.exception() is not None:
            log.error("reading served models failed", exc_info=task.exception())

    async def start(self) -> None:
        if not self.enabled:
            return
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._settings.poll_interval))
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="models")

    async def stop(self) -> None:
        for task in (self._task, self._refreshing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.models_refresh_seconds)
            await self.refresh()

    async def _refresh(self) -> None:
        assert self._session is not None
        results = await asyncio.gather(*(self._read(e) for e in self._engines))
        self._last_refresh = time.monotonic()
        changed = False
        for engine, result in zip(self._engines, results, strict=True):
            if result is None:
                continue
            models, context = result
            if context != self._context[engine.name]:
                log.info("served context limits", extra={"engine": engine.name, "max_model_len": context})
                self._context[engine.name] = context
            if models != self._served[engine.name]:
                added = sorted(set(models) - set(self._served[engine.name]))
                removed = sorted(set(self._served[engine.name]) - set(models))
                log.info("served models changed", extra={"engine": engine.name, "added": added, "removed": removed})
                self._served[engine.name] = models
                changed = True
        if changed:
            self._rebuild()

    async def _read(self, engine: EngineConfig) -> tuple[tuple[str, ...], dict[str, int]] | None:
        assert self._session is not None
        url = f"{engine.url}/v1/models"
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                doc = await response.json(content_type=None)
            entries = [m for m in doc["data"] if isinstance(m, dict) and m.get("id")]
            names = tuple(sorted({str(m["id"]) for m in entries}))
            context = {str(m["id"]): m["max_model_len"] for m in entries
                       if isinstance(m.get("max_model_len"), int) and not isinstance(m["max_model_len"], bool)
                       and m["max_model_len"] > 0}
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
            log.warning("cannot list served models; keeping the previous list",
                        extra={"engine": engine.name, "url": url, "error": str(exc) or type(exc).__name__})
            return None
        return names, context

    def _rebuild(self) -> None:
        table = dict(self._configured)
        for engine in self._engines:
            for model in self._served[engine.name]:
                owner = table.setdefault(model, engine)
                if owner is not engine and model not in self._configured:
                    log.warning("two engines serve the same model; the first one gets it",
                                extra={"model": model, "engine": owner.name, "also": engine.name})
        self._table = table
