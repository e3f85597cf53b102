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
import random
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS_TYPE,
    generate_latest as generate_openmetrics,
)

from extproc.tokenizer import TemplateError, Tokenizer, get_tokenizer

from . import protocol
from .config import SimConfig
from .engine import Engine, RequestHandle
from .outputs import OutputLenModel, SequenceEnd, TextStream, plan_end
from .scheduler import TokenOutput

__all__ = ["METRICS_CONTENT_TYPE", "METRICS_MODES", "QueueLimits", "create_app", "create_runner"]

log = logging.getLogger("enginesim.server")

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
METRICS_MODES = ("ok", "fail", "hang", "garbage", "missing", "truncated", "half", "nan", "out_of_range")
GARBAGE_BODY = b"<html>oops</html>\n\x00\xff\xfe\x89PNG\r\n\x1a\n{{not prometheus}}\nvllm:\n"

ENGINE_KEY = web.AppKey("engine", Engine)
CONFIG_KEY = web.AppKey("config", SimConfig)
STATE_KEY = web.AppKey("state", dict)
TOKENIZER_KEY = web.AppKey("tokenizer", Tokenizer)
OUTPUT_LEN_KEY = web.AppKey("output_len", OutputLenModel)


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

    @property
    def tokenizer(self) -> Tokenizer:
        return self._app[TOKENIZER_KEY]

    async def _parse(self, kind: str, raw: bytes) -> protocol.ParsedRequest:
        """Validate, run the first queue-limit check, count the prompt, check its length."""
        cfg = self.config
        limits = self.limits
        body = protocol.decode_request(kind, raw, served_model=cfg.model,
                                       preflight=limits.check if limits.active else None)
        # Counting holds the event loop ~1.3 ms per 65k tokens (the tokenizer keeps the GIL,
        # so a thread would not help); see enginesim/README.md.
        prompt_tokens = protocol.count_prompt(body, self.tokenizer)
        return protocol.finish_request(body, prompt_tokens, max_model_len=cfg.scheduler.max_model_len,
                                       default_max_tokens=cfg.default_max_tokens)

    def _plan(self, parsed: protocol.ParsedRequest) -> list[tuple[SequenceEnd, TextStream]]:
        """Each sequence's end and text stream (``enginesim.outputs``)."""
        engine = self.engine
        tokenizer = self.tokenizer
        words = tokenizer.output_words() if tokenizer.exact else None
        stop_counts = [tokenizer.count_text(s) for s in parsed.stop]
        plans = []
        for i in range(parsed.n):
            seed = parsed.seed + i if parsed.seed is not None else engine.rng.getrandbits(64)
            rng = random.Random(seed)
            eos = None if parsed.ignore_eos else self._app[OUTPUT_LEN_KEY].sample(rng)
            if eos is None and not parsed.ignore_eos and not parsed.max_tokens_explicit:
                # --output-len max: a request without a limit still ends where a model would
                eos = self.config.no_limit_len or None
            end = plan_end(parsed.max_tokens, eos, parsed.stop, stop_counts,
                           parsed.include_stop_str_in_output)
            plans.append((end, TextStream(words, rng, end, parsed.stop)))
        return plans

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        raw = await request.read()
        limits = self.limits
        try:
            parsed = await self._parse(kind, raw)
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
        plans = self._plan(parsed)
        queue: asyncio.Queue[TokenOutput | None] = asyncio.Queue()
        prefix = (f"n-{uuid.uuid4().hex}", parsed.prompt_tokens) if parsed.n > 1 else None
        handles = []
        for index, (end, _) in enumerate(plans):
            handles.append(engine.submit(
                parsed.prompt_tokens, parsed.max_tokens,
                info if parsed.n == 1 else {**info, "choice": index},
                eos_at=end.end if end.reason == "stop" else None, prefix=prefix, tokens=queue))
        if limits.active:
            for handle in handles:
                limits.track(handle)
        prefix_id = "chatcmpl" if kind == protocol.CHAT else "cmpl"
        response_id = f"{prefix_id}-{header_id or uuid.uuid4().hex}"
        created = int(time.time())
        choices = {h.engine_request_id: (i, h, end, text)
                   for i, (h, (end, text)) in enumerate(zip(handles, plans, strict=True))}
        try:
            if parsed.stream:
                return await self._stream(request, parsed, queue, choices, response_id, created,
                                          prepare_early=not held_at_arrival)
            return await self._full(parsed, queue, choices, response_id, created)
        except ConnectionResetError:
            # The client went away mid-stream; the request is aborted below.
            return web.Response(status=499)
        finally:
            for handle in handles:
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

    @staticmethod
    async def _tokens(queue: asyncio.Queue[TokenOutput | None], count: int) -> AsyncIterator[TokenOutput]:
        """The tokens of ``count`` sequences sharing ``queue``, until each has ended."""
        ended = 0
        while ended < count:
            token = await queue.get()
            if token is None:
                ended += 1
            else:
                yield token

    async def _full(self, parsed: protocol.ParsedRequest, queue: asyncio.Queue[TokenOutput | None],
                    choices: dict[str, Any], response_id: str, created: int) -> web.Response:
        texts: dict[str, list[str]] = {rid: [] for rid in choices}
        count = 0
        async for token in self._tokens(queue, len(choices)):
            _, handle, _, stream = choices[token.request_id]
            if not texts[token.request_id]:
                self.limits.saw_token(handle)
            texts[token.request_id].append(stream.next())
            count += 1
        if any(handle.state != "finished" for _, handle, _, _ in choices.values()):
            return _error(protocol.ApiError(500, "The engine was reset or is shutting down", "InternalServerError"))
        answer = [protocol.Choice("".join(texts[rid]), end.reason, end.stop_reason)
                  for rid, (_, _, end, _) in choices.items()]
        build = protocol.chat_response if parsed.kind == protocol.CHAT else (
            protocol.completion_response)
        response = _json(build(response_id, created, parsed.model, answer, parsed.prompt_tokens, count))
        assert isinstance(response.body, bytes)
        for _, handle, _, _ in choices.values():
            handle.arrival["response_sha256"] = hashlib.sha256(response.body).hexdigest()
        return response

    async def _stream(self, request: web.Request, parsed: protocol.ParsedRequest,
                      queue: asyncio.Queue[TokenOutput | None], choices: dict[str, Any],
                      response_id: str, created: int, prepare_early: bool) -> web.StreamResponse:
        response = _DigestingStreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        if prepare_early:
            await response.prepare(request)
        model = parsed.model
        chat = parsed.kind == protocol.CHAT
        counts = dict.fromkeys(choices, 0)
        started: set[str] = set()
        async for token in self._tokens(queue, len(choices)):
            index, handle, end, stream = choices[token.request_id]
            if counts[token.request_id] == 0:
                self.limits.saw_token(handle)
            if not response.prepared:
                await response.prepare(request)
            counts[token.request_id] += 1
            text = stream.next()
            if not text and not token.finished:
                continue  # the EOS token or a withheld stop string: vLLM sends no empty delta
            parts: list[dict[str, Any]] = []
            if chat and token.request_id not in started:
                started.add(token.request_id)
                parts.append(protocol.chat_chunk_first(response_id, created, model, index))
            finish = end.reason if token.finished else None
            stop_reason = end.stop_reason if token.finished else None
            if chat:
                chunk = protocol.chat_chunk_token(response_id, created, model, text, finish, index,
                                                  stop_reason)
            else:
                chunk = protocol.completion_chunk_token(response_id, created, model, text, finish,
                                                        index, stop_reason)
            parts.append(chunk)
            if parsed.continuous_usage:
                for part in parts:
                    part["usage"] = protocol.usage(parsed.prompt_tokens,
                                                   counts[token.request_id] if part is chunk else 0)
            await response.write(b"".join(protocol.sse(part) for part in parts))
        if not response.prepared:
            await response.prepare(request)
        if all(handle.state == "finished" for _, handle, _, _ in choices.values()):
            if parsed.include_usage:
                await response.write(protocol.sse(protocol.usage_chunk(
                    parsed.kind, response_id, created, model, parsed.prompt_tokens,
                    sum(counts.values()))))
        else:
            await response.write(protocol.sse(protocol.ApiError(
                500, "The engine was reset or is shutting down", "InternalServerError").body()))
        await response.write(protocol.SSE_DONE)
        for _, handle, _, _ in choices.values():
            handle.arrival["response_sha256"] = response.digest.hexdigest()
        await response.write_eof()
        return response

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``: ``prompt`` (completion) or ``messages`` (+ ``tools``, chat
        template applied, ``add_generation_prompt`` true by default); answers the ids and count."""
        cfg = self.config
        try:
            body = json.loads(await request.read())
        except (UnicodeDecodeError, json.JSONDecodeError):
            return _error(protocol.ApiError(400, "invalid JSON body", "Bad Request"))
        if not isinstance(body, dict):
            return _error(protocol.ApiError(400, "request body must be a JSON object", "Bad Request"))
        model = body.get("model", cfg.model)
        if model is not None and model != cfg.model:
            return _error(protocol.ApiError(404, f"The model `{model}` does not exist.", "NotFoundError"))
        tokenizer = self.tokenizer
        try:
            if "messages" in body:
                tools = body.get("tools") or None
                ids = tokenizer.encode_chat(body["messages"], tools,
                                            body.get("add_generation_prompt", True) is not False)
            elif isinstance(body.get("prompt"), str):
                ids = tokenizer.encode_prompt(body["prompt"], body.get("add_special_tokens", True) is not False)
            else:
                return _error(protocol.ApiError(400, "Field required: 'prompt' or 'messages'", "Bad Request"))
        except TemplateError as exc:
            return _error(protocol.ApiError(400, str(exc), "BadRequestError"))
        return _json(protocol.tokenize_response([int(i) for i in ids], cfg.scheduler.max_model_len))

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": text}``."""
        cfg = self.config
        try:
            body = json.loads(await request.read())
        except (UnicodeDecodeError, json.JSONDecodeError):
            return _error(protocol.ApiError(400, "invalid JSON body", "Bad Request"))
        if not isinstance(body, dict) or not isinstance(body.get("tokens"), list):
            return _error(protocol.ApiError(400, "Field required: 'tokens'", "Bad Request"))
        model = body.get("model", cfg.model)
        if model is not None and model != cfg.model:
            return _error(protocol.ApiError(404, f"The model `{model}` does not exist.", "NotFoundError"))
        try:
            text = self.tokenizer.decode(body["tokens"])
        except TemplateError as exc:
            return _error(protocol.ApiError(400, str(exc), "BadRequestError"))
        return _json({"prompt": text})


class ControlApi:
    """/control: pin gauges, break /metrics, hold the engine, inspect and reset state.

    - ``POST /control/pin`` ``{"running": int|null, "waiting": int|null, "kv_usage": float|null}``:
      /metrics reports these values (on every engine rank) instead of the model's; a key
      set to null unpins that gauge, a missing key leaves it as it is.
    - ``POST /control/unpin``: clear every pin.
    - ``POST /control/metrics_mode`` ``{"mode": MODE, "delay_s": S}``, a 200 document unless said
      otherwise, answered ``delay_s`` seconds late (default 0: a busy API server's slow /metrics):
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
        delay = body.get("delay_s", 0.0)
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= 60:
            raise _bad(f"delay_s must be a number of seconds in [0, 60], got {delay!r}")
        self.state["metrics_delay_s"] = float(delay)
        return _json({"mode": mode, "delay_s": float(delay)})

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
        self.state["metrics_delay_s"] = 0.0
        return _json({"reset": True})


def _bad(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json")


class MetricsApi:
    """GET /metrics, honouring the control metrics mode."""

    def __init__(self, app: web.Application) -> None:
        self._app = app

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        mode = self._app[STATE_KEY]["metrics_mode"]
        delay = self._app[STATE_KEY].get("metrics_delay_s", 0.0)
        if delay:
            await asyncio.sleep(delay)  # the document is the state after the delay, as a busy server's is
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
            return web.Response(body=generate_openmetrics(metrics.served),
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
    tokenizer = get_tokenizer(config.tokenizer, config.bytes_per_token)
    if tokenizer.exact:
        tokenizer.output_words()  # build the word list now, not on the first request
    app[TOKENIZER_KEY] = tokenizer
    app[OUTPUT_LEN_KEY] = OutputLenModel.parse(config.output_len)
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
    app.router.add_post("/tokenize", openai_api.tokenize)
    app.router.add_post("/detokenize", openai_api.detokenize)
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
