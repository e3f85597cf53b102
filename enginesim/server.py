"""aiohttp front end: vLLM 0.11's OpenAI-compatible routes, /metrics, and /control.

Behaviour that clients and gateways can observe:

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: streaming (SSE,
  ``content-type: text/event-stream; charset=utf-8``) or a single JSON body.
  As in vLLM (Starlette sends the status line before the first chunk), a streaming
  response's status and headers go out as soon as the engine accepts the request; its
  first ``data:`` line follows the first token. Exception: a request that arrives while
  the engine is held gets no bytes at all until its first token.
- A client that disconnects aborts its request in the scheduler (its blocks are freed),
  which is what vLLM's ``with_cancellation`` does. The aiohttp runner must be created
  with ``handler_cancellation=True`` (``create_runner`` does this).
- ``GET /metrics`` serves Prometheus text format 0.0.4 (OpenMetrics if the Accept header
  asks for it), subject to ``/control/metrics_mode``.
- vLLM 0.33's queue limits (``--max-num-queued-reqs`` / ``--max-num-queued-tokens``), see
  ``QueueLimits``: a refused request gets HTTP 503 and vLLM's JSON error body, no Retry-After,
  streaming or not. vLLM checks twice: in ``_preflight`` before the prompt is rendered, and again
  in ``AsyncLLM.add_request``, which for a stream runs inside the response generator, after the
  200 and its headers went out. A request that passed the first check while others were
  rendering can therefore still be refused by the second: then a non-streaming request gets
  the same 503, a streaming one HTTP 200 with one SSE error event (the same body, code 503)
  and ``data: [DONE]``. ``_render`` stands for the render step (one event-loop turn here).

The /control routes (JSON in, JSON out) exist for deterministic tests; see ``ControlApi``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from . import protocol
from .config import SimConfig
from .engine import Engine, RequestHandle

__all__ = ["METRICS_CONTENT_TYPE", "METRICS_MODES", "QueueLimits", "create_app", "create_runner"]

log = logging.getLogger("enginesim.server")

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
METRICS_MODES = ("ok", "fail", "hang", "garbage", "missing", "truncated", "half", "nan", "out_of_range")
GARBAGE_BODY = b"<html>oops</html>\n\x00\xff\xfe\x89PNG\r\n\x1a\n{{not prometheus}}\nvllm:\n"

ENGINE_KEY = web.AppKey("engine", Engine)
CONFIG_KEY = web.AppKey("config", SimConfig)
STATE_KEY = web.AppKey("state", dict)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status,
                             dumps=lambda o: json.dumps(o, separators=(",", ":")))


def _error(exc: protocol.ApiError) -> web.Response:
    return _json(exc.body(), status=exc.status)


class _DigestingStreamResponse(web.StreamResponse):
    """A StreamResponse that keeps the SHA-256 of the body bytes it wrote."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.digest = hashlib.sha256()

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        self.digest.update(data)
        await super().write(data)


class QueueLimits:
    """vLLM 0.33's ``AsyncLLM.check_admission``, over the requests this server has in flight.

    - ``max_num_queued_reqs``: refused when unfinished requests (waiting + running on every
      rank; ``OutputProcessor.get_num_unfinished_requests``) plus this request's ``n`` would
      exceed the limit.
    - ``max_num_queued_tokens``: refused when the prompt tokens of requests still in prefill
      already reach the limit (``current >= max``; the newcomer's own prompt is not added).
      "In prefill" is the frontend's ``is_prefilling``: true from arrival until the request's
      first output reaches the API server, whatever chunked prefill has done, and it does not
      become true again after a preemption (``OutputProcessor.get_num_queued_tokens``).

    Each refusal increments ``vllm:admission_rejections{reason}`` (the requests check first).
    """

    def __init__(self, max_num_queued_reqs: int | None, max_num_queued_tokens: int | None,
                 metrics: Any) -> None:
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self._metrics = metrics  # a callable returning the engine's current EngineMetrics
        self._in_flight: dict[RequestHandle, None] = {}
        self._past_prefill: set[RequestHandle] = set()

    @property
    def active(self) -> bool:
        return self.max_num_queued_reqs is not None or self.max_num_queued_tokens is not None

    def _prune(self) -> None:
        for handle in [h for h in self._in_flight if h.done]:
            del self._in_flight[handle]
            self._past_prefill.discard(handle)

    def num_requests(self) -> int:
        self._prune()
        return len(self._in_flight)

    def num_queued_tokens(self) -> int:
        self._prune()
        return sum(h.prompt_tokens for h in self._in_flight
                   if h not in self._past_prefill and h.tokens.empty())

    def check(self, n: int = 1) -> None:
        """Raise vLLM's 503 ApiError if admitting ``n`` sequences would break a limit."""
        if self.max_num_queued_reqs is not None and (
                self.num_requests() + n > self.max_num_queued_reqs):
            self._metrics().record_admission_rejection("max_num_queued_reqs")
            raise protocol.queue_limit_error("max_num_queued_reqs")
        if self.max_num_queued_tokens is not None and (
                self.num_queued_tokens() >= self.max_num_queued_tokens):
            self._metrics().record_admission_rejection("max_num_queued_tokens")
            raise protocol.queue_limit_error("max_num_queued_tokens")

    def track(self, handle: RequestHandle) -> None:
        self._in_flight[handle] = None

    def saw_token(self, handle: RequestHandle) -> None:
        """The request's first output reached the API server: it is no longer prefilling."""
        if handle in self._in_flight:
            self._past_prefill.add(handle)


LIMITS_KEY = web.AppKey("limits", QueueLimits)


async def _render(parsed: protocol.ParsedRequest) -> None:
    """vLLM renders the prompt (chat template, tokenizer) between its two admission checks;
    an await there lets other requests in. Here: one turn of the event loop."""
    await asyncio.sleep(0)


class OpenAIApi:
    """The generation routes, /v1/models and /health."""

    def __init__(self, app: web.Application) -> None:
        self._app = app

    @property
    def engine(self) -> Engine:
        return self._app[ENGINE_KEY]

    @property
    def config(self) -> SimConfig:
        return self._app[CONFIG_KEY]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.COMPLETION)

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.config
        return _json(protocol.model_list(cfg.model, cfg.scheduler.max_model_len,
                                         int(time.time()), f"modelperm-{uuid.uuid4().hex}"))

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    @property
    def limits(self) -> QueueLimits:
        return self._app[LIMITS_KEY]

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        cfg = self.config
        raw = await request.read()
        limits = self.limits
        try:
            parsed = protocol.parse_request(
                kind, raw, served_model=cfg.model, max_model_len=cfg.scheduler.max_model_len,
                bytes_per_token=cfg.bytes_per_token, default_max_tokens=cfg.default_max_tokens,
                preflight=limits.check if limits.active else None)
        except protocol.ApiError as exc:
            return _error(exc)
        if limits.active:
            await _render(parsed)
            try:
                limits.check(parsed.n)  # AsyncLLM.add_request's own check
            except protocol.ApiError as exc:
                if parsed.stream:
                    return await self._stream_refused(request, parsed, exc)
                return _error(exc)
        header_id = request.headers.get("X-Request-Id")
        # The body's and the response's SHA-256 let tests prove a proxy passed both unchanged.
        info = {"request_id": header_id, "model": parsed.model, "user": parsed.user,
                "metadata": parsed.metadata, "kind": kind, "stream": parsed.stream,
                "body_sha256": hashlib.sha256(raw).hexdigest()}
        engine = self.engine
        held_at_arrival = engine.held
        handle = engine.submit(parsed.prompt_tokens, parsed.max_tokens, info)
        if limits.active:
            limits.track(handle)
        prefix = "chatcmpl" if kind == protocol.CHAT else "cmpl"
        response_id = f"{prefix}-{header_id or uuid.uuid4().hex}"
        created = int(time.time())
        try:
            if parsed.stream:
                return await self._stream(request, parsed, handle, response_id, created,
                                          prepare_early=not held_at_arrival)
            return await self._full(parsed, handle, response_id, created)
        except ConnectionResetError:
            # The client went away mid-stream; the request is aborted below.
            return web.Response(status=499)
        finally:
            if not handle.done:
                engine.abort(handle)

    async def _stream_refused(self, request: web.Request, parsed: protocol.ParsedRequest,
                              exc: protocol.ApiError) -> web.StreamResponse:
        """A stream refused by add_request's check: vLLM has already sent 200 and its SSE
        headers; the generator yields one error event, then [DONE]."""
        response = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        await response.prepare(request)
        if parsed.kind == protocol.CHAT:
            await response.write(protocol.sse(exc.body()))
        else:
            await response.write(protocol.sse_error_completion(exc.body()))
        await response.write(protocol.SSE_DONE)
        await response.write_eof()
        return response

    async def _full(self, parsed: protocol.ParsedRequest, handle: RequestHandle,
                    response_id: str, created: int) -> web.Response:
        count = 0
        while await handle.tokens.get() is not None:
            if count == 0:
                self.limits.saw_token(handle)
            count += 1
        if handle.state != "finished":
            return _error(protocol.ApiError(500, "The engine was reset or is shutting down", "InternalServerError"))
        text = "".join(protocol.token_text(i) for i in range(count))
        build = protocol.chat_response if parsed.kind == protocol.CHAT else (
            protocol.completion_response)
        response = _json(build(response_id, created, parsed.model, text, parsed.prompt_tokens, count))
        assert isinstance(response.body, bytes)
        handle.arrival["response_sha256"] = hashlib.sha256(response.body).hexdigest()
        return response

    async def _stream(self, request: web.Request, parsed: protocol.ParsedRequest,
                      handle: RequestHandle, response_id: str, created: int,
                      prepare_early: bool) -> web.StreamResponse:
        response = _DigestingStreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        if prepare_early:
            await response.prepare(request)
        model = parsed.model
        chat = parsed.kind == protocol.CHAT
        count = 0
        while (token := await handle.tokens.get()) is not None:
            if count == 0:
                self.limits.saw_token(handle)
            if not response.prepared:
                await response.prepare(request)
            parts: list[dict[str, Any]] = []
            if chat and token.index == 0:
                parts.append(protocol.chat_chunk_first(response_id, created, model))
            finish = "length" if token.finished else None
            text = protocol.token_text(token.index)
            count += 1
            if chat:
                chunk = protocol.chat_chunk_token(response_id, created, model, text, finish)
            else:
                chunk = protocol.completion_chunk_token(response_id, created, model, text, finish)
            parts.append(chunk)
            if parsed.continuous_usage:
                for part in parts:
                    part["usage"] = protocol.usage(parsed.prompt_tokens,
                                                   count if part is chunk else 0)
            await response.write(b"".join(protocol.sse(part) for part in parts))
        if not response.prepared:
            await response.prepare(request)
        if handle.state == "finished":
            if parsed.include_usage:
                await response.write(protocol.sse(protocol.usage_chunk(
                    parsed.kind, response_id, created, model, parsed.prompt_tokens, count)))
        else:
            await response.write(protocol.sse(protocol.ApiError(
                500, "The engine was reset or is shutting down", "InternalServerError").body()))
        await response.write(protocol.SSE_DONE)
        handle.arrival["response_sha256"] = response.digest.hexdigest()
        await response.write_eof()
        return response


class ControlApi:
    """/control: pin gauges, break /metrics, hold the engine, inspect and reset state.

    - ``POST /control/pin`` ``{"running": int|null, "waiting": int|null, "kv_usage": float|null}``:
      /metrics reports these values (on every engine rank) instead of the model's; a key
      set to null unpins that gauge, a missing key leaves it as it is.
    - ``POST /control/unpin``: clear every pin.
    - ``POST /control/metrics_mode`` ``{"mode": MODE}``, a 200 document unless said otherwise:
      ``ok``; ``fail`` (HTTP 500); ``hang`` (no answer); ``garbage`` (not Prometheus text);
      ``missing`` (without the three scheduler gauges); ``truncated`` (cut two characters into
      the first ``vllm:kv_cache_usage_perc`` value, so ``0.97`` ends as ``0.``); ``half`` (the
      first half of the lines, cut at a line boundary: the gauges stay, ``cache_config_info``
      near the end is lost); ``nan`` / ``out_of_range`` (every KV usage value reads ``NaN`` /
      ``1.5``).
    - ``POST /control/hold`` ``{"hold": bool}``: stop / resume engine steps.
    - ``POST /control/sleep`` ``{"level": 0|1|2}`` (default 1) / ``POST /control/wake_up``:
      vLLM's ``/sleep`` and ``/wake_up`` (dev mode) as the metrics see them: no engine step
      while asleep, ``vllm:engine_sleep_state`` (0.33) says so, and the scheduler gauges keep
      the values of the last step (arrivals do not show). Requests in flight are kept
      (vLLM's ``mode=keep``; its default ``abort`` would end them) and resume on wake-up.
    - ``GET /control/state``, ``GET /control/arrivals``: what the engine saw.
    - ``GET /control/timeline``: when it held how many requests and how much KV (``Engine.occupancy``).
    - ``POST /control/reset``: fresh schedulers and metrics; also unpins, sets the metrics
      mode back to ok and releases the hold. Requests in flight end with an error.
    """

    def __init__(self, app: web.Application) -> None:
        self._app = app

    @property
    def engine(self) -> Engine:
        return self._app[ENGINE_KEY]

    @property
    def state(self) -> dict[str, Any]:
        return self._app[STATE_KEY]

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read() or b"{}")
        except json.JSONDecodeError as exc:
            raise web.HTTPBadRequest(text=json.dumps({"error": f"invalid JSON: {exc}"}),
                                     content_type="application/json") from None
        if not isinstance(body, dict):
            raise _bad("body must be a JSON object")
        return body

    async def pin(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        pins = dict(self.engine.metrics.pins)
        for key, kind in (("running", int), ("waiting", int), ("kv_usage", float)):
            if key not in body:
                continue
            value = body[key]
            if value is None:
                pins[key] = None
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise _bad(f"{key} must be a non-negative number or null, got {value!r}")
            if kind is int and value != int(value):
                raise _bad(f"{key} must be an integer, got {value!r}")
            pins[key] = kind(value)
        unknown = set(body) - {"running", "waiting", "kv_usage"}
        if unknown:
            raise _bad(f"unknown keys: {sorted(unknown)}")
        self.engine.metrics.set_pins(pins["running"], pins["waiting"], pins["kv_usage"])
        return _json({"pins": self.engine.metrics.pins})

    async def unpin(self, request: web.Request) -> web.Response:
        self.engine.metrics.set_pins(None, None, None)
        return _json({"pins": self.engine.metrics.pins})

    async def metrics_mode(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        mode = body.get("mode")
        if mode not in METRICS_MODES:
            raise _bad(f"mode must be one of {list(METRICS_MODES)}, got {mode!r}")
        self.state["metrics_mode"] = mode
        return _json({"mode": mode})

    async def hold(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        hold = body.get("hold")
        if not isinstance(hold, bool):
            raise _bad(f"hold must be true or false, got {hold!r}")
        self.engine.set_hold(hold)
        return _json({"hold": hold})

    async def sleep(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        level = body.get("level", 1)
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise _bad(f"level must be 0, 1 or 2, got {level!r}")
        self.engine.set_hold(True)
        self.engine.metrics.record_sleep_state(True, level)
        return _json({"status": "sleeping", "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        self.engine.metrics.record_sleep_state(False, 0)
        self.engine.set_hold(False)
        return _json({"status": "awake", "tags": None})

    async def get_state(self, request: web.Request) -> web.Response:
        doc = self.engine.state()
        doc["metrics_mode"] = self.state["metrics_mode"]
        doc["pins"] = self.engine.metrics.pins
        return _json(doc)

    async def timeline(self, request: web.Request) -> web.Response:
        return _json(self.engine.occupancy())

    async def arrivals(self, request: web.Request) -> web.Response:
        items = [{"id": a["request_id"] if a["request_id"] is not None else str(a["seq"]), **a}
                 for a in self.engine.arrivals]
        return _json({"arrivals": items})

    async def reset(self, request: web.Request) -> web.Response:
        await self.engine.reset()
        self.state["metrics_mode"] = "ok"
        return _json({"reset": True})


def _bad(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json")


class MetricsApi:
    """GET /metrics, honouring the control metrics mode."""

    def __init__(self, app: web.Application) -> None:
        self._app = app

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        mode = self._app[STATE_KEY]["metrics_mode"]
        metrics = self._app[ENGINE_KEY].metrics
        if mode == "fail":
            return web.Response(status=500, text="Internal Server Error")
        if mode == "hang":
            # Answer nothing until the client gives up (the handler is cancelled then)
            # or the server shuts down.
            await self._app[STATE_KEY]["shutdown"].wait()
            return web.Response(status=503)
        if mode == "garbage":
            return web.Response(body=GARBAGE_BODY, headers={"Content-Type": METRICS_CONTENT_TYPE})
        if mode == "ok" and "application/openmetrics-text" in request.headers.get("Accept", ""):
            return web.Response(body=generate_openmetrics(metrics.registry),
                                headers={"Content-Type": OPENMETRICS_TYPE})
        body = metrics.exposition(without_gauges=(mode == "missing"))
        if mode in _BROKEN_DOCUMENTS:
            body = _BROKEN_DOCUMENTS[mode](body)
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


_KV_SAMPLE = re.compile(rb"^(vllm:kv_cache_usage_perc\{[^}\n]*\} )(\S+)$", re.MULTILINE)


def _truncated(body: bytes) -> bytes:
    match = _KV_SAMPLE.search(body)
    assert match is not None, "the exposition has no vllm:kv_cache_usage_perc sample"
    return body[: match.start(2) + 2]


def _half(body: bytes) -> bytes:
    lines = body.splitlines(keepends=True)
    return b"".join(lines[: len(lines) // 2])


_BROKEN_DOCUMENTS = {
    "truncated": _truncated,
    "half": _half,
    "nan": lambda body: _KV_SAMPLE.sub(rb"\1NaN", body),
    "out_of_range": lambda body: _KV_SAMPLE.sub(rb"\g<1>1.5", body),
}


def create_app(config: SimConfig, engine: Engine | None = None) -> web.Application:
    """The simulator's aiohttp application; the engine starts and stops with it."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[CONFIG_KEY] = config
    app[ENGINE_KEY] = engine if engine is not None else Engine(config)
    app[STATE_KEY] = {"metrics_mode": "ok", "shutdown": asyncio.Event()}
    app[LIMITS_KEY] = QueueLimits(config.max_num_queued_reqs, config.max_num_queued_tokens,
                                  lambda: app[ENGINE_KEY].metrics)

    async def on_startup(app: web.Application) -> None:
        app[ENGINE_KEY].start()

    async def on_shutdown(app: web.Application) -> None:
        # Runs before aiohttp waits for open connections: end every request now so a
        # long generation does not hold the process up.
        app[STATE_KEY]["shutdown"].set()
        await app[ENGINE_KEY].stop()

    async def on_cleanup(app: web.Application) -> None:
        await app[ENGINE_KEY].stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)

    openai_api = OpenAIApi(app)
    control = ControlApi(app)
    metrics = MetricsApi(app)
    app.router.add_post("/v1/chat/completions", openai_api.chat)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_get("/v1/models", openai_api.models)
    app.router.add_get("/health", openai_api.health)
    app.router.add_get("/metrics", metrics.metrics)
    app.router.add_post("/control/pin", control.pin)
    app.router.add_post("/control/unpin", control.unpin)
    app.router.add_post("/control/metrics_mode", control.metrics_mode)
    app.router.add_post("/control/hold", control.hold)
    app.router.add_post("/control/sleep", control.sleep)
    app.router.add_post("/control/wake_up", control.wake_up)
    app.router.add_get("/control/state", control.get_state)
    app.router.add_get("/control/arrivals", control.arrivals)
    app.router.add_get("/control/timeline", control.timeline)
    app.router.add_post("/control/reset", control.reset)
    return app


def create_runner(app: web.Application) -> web.AppRunner:
    """An AppRunner that cancels handlers on client disconnect (abort semantics)."""
    return web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
