"""The ext_proc gRPC servicer: translates Envoy's per-request stream into admission decisions.

Protocol rules this module relies on (Envoy 1.40, DESIGN.md):
- One bidirectional stream per HTTP request. Envoy sends `request_headers`, then (body mode
  BUFFERED_PARTIAL) one `request_body` holding the whole body, or only its first
  `per_connection_buffer_limit_bytes` with `end_of_stream=false` when it is larger.
- Each message must be answered within `message_timeout`, unless the answer is preceded by one
  `override_message_timeout` (<= `max_message_timeout`); that is how a request is parked. Only
  the first override counts, so a parked request gets exactly one, sized above the park cap.
- The stream stays open until the HTTP stream ends, even after the last request-phase answer.
  Its end is the completion signal that frees the request's slot in the local ledger; a stream
  that ends while parked means the client went away.
- Rejections are ImmediateResponses (HTTP status + JSON body), never gRPC errors: a gRPC error
  would hand the request to Envoy's failure mode instead of giving the client an answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2

from .admission import Admission
from .bodyscan import BodyError, BodyFacts
from .config import EngineConfig, Settings
from .contract import OUTCOME_HEADER, PARK_TIMEOUT_MARGIN_SECONDS, ROUTE_HEADER
from .endpoints import PathRules, Route, body_facts, endpoint_for
from .gate import Decision, Ticket
from .metrics import Metrics
from .models import ModelRegistry
from .outcomes import REJECTIONS, Outcome, error_body
from .tokencount import Estimator
from .wire import base_pb2, http_status_pb2, pb, pb_grpc, processing_mode_pb2

log = logging.getLogger("extproc.servicer")

_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_SKIP_BODY = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(request_body_mode=processing_mode_pb2.ProcessingMode.NONE),
)


@dataclass
class _Stream:
    """What one ext_proc stream (one HTTP request) has accumulated."""

    request_id: str = "-"
    path: str = ""
    engine: EngineConfig | None = None
    ticket: Ticket | None = None
    admitted: BodyFacts | None = None  # the body facts of a request sent to the engine (calibration)

    def __repr__(self) -> str:
        return f"<Stream {self.request_id} {self.path} engine={self.engine.name if self.engine else None} {self.ticket}>"


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, settings: Settings, admission: Admission, metrics: Metrics,
                 models: ModelRegistry | None = None) -> None:
        self._settings = settings
        self._admission = admission
        self._metrics = metrics
        self._paths = PathRules(settings.gated_paths)
        self._models = models or ModelRegistry(settings)
        self._multi_engine = len(settings.engines) > 1
        self._admitted_responses = {e.name: self._admitted_response(e) for e in settings.engines}
        self._estimator = Estimator(settings, metrics)

    async def aclose(self) -> None:
        """Release what the servicer holds beyond its streams (the estimator's connections)."""
        await self._estimator.aclose()

    async def Process(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        stream = _Stream()
        try:
            await self._process(context, stream)
        except Exception:
            # The stream fails with a gRPC error and Envoy's failure mode decides (fail-open by
            # default); count it so a bug never hides behind fail-open.
            self._metrics.internal_errors.inc()
            log.exception("ext_proc stream failed", extra={"request_id": stream.request_id})
            raise
        finally:
            if stream.ticket is not None and stream.engine is not None:
                await self._admission.finish(stream.engine.name, stream.ticket)
            if stream.admitted is not None and stream.engine is not None:
                self._estimator.finished(stream.engine.name, stream.admitted)

    async def _process(self, context: grpc.aio.ServicerContext, stream: _Stream) -> None:
        message = await context.read()
        if message is grpc.aio.EOF:
            return
        if not message.HasField("request_headers"):
            log.warning("stream did not start with request_headers; answering CONTINUE")
            await self._drain(context, message)
            return
        headers = _header_map(message.request_headers)
        stream.request_id = headers.get("x-request-id", "-")
        route, stream.path = self._paths.route(headers.get(":method", ""), headers.get(":path", ""))
        if route is Route.AMBIGUOUS:
            await self._reject(
                context, stream, Outcome.AMBIGUOUS_PATH,
                f"the path `{headers.get(':path', '')[:200]}` is an encoded or non-canonical spelling of a gated "
                "endpoint; send the plain path (e.g. /v1/chat/completions)",
            )
            return
        if route is Route.PASS:
            self._metrics.passthrough.labels("path_not_gated").inc()
            await context.write(_SKIP_BODY)
            await self._drain(context, None)
            return
        endpoint = endpoint_for(stream.path)

        declared = headers.get("content-length", "")
        if not endpoint.multipart and declared.isdigit() and int(declared) > self._settings.max_body_bytes:
            await self._reject(context, stream, Outcome.BODY_TOO_LARGE, self._too_large_message(int(declared)))
            return
        if message.request_headers.end_of_stream:
            await self._reject(context, stream, Outcome.INVALID_BODY, "request body is required")
            return
        await context.write(_CONTINUE_HEADERS)

        message = await context.read()
        if message is grpc.aio.EOF:
            return
        if not message.HasField("request_body"):
            log.warning("expected request_body, got %s; answering CONTINUE", message.WhichOneof("request"))
            await self._drain(context, message)
            return
        started = time.perf_counter()
        body = message.request_body
        # A multipart upload (audio) may exceed the cap: its form fields are read from the prefix.
        if not endpoint.multipart and (not body.end_of_stream or len(body.body) > self._settings.max_body_bytes):
            await self._reject(context, stream, Outcome.BODY_TOO_LARGE, self._too_large_message(None))
            return
        try:
            facts = body_facts(endpoint, body.body, headers.get("content-type", ""), body.end_of_stream,
                               self._settings.bytes_per_token)
        except BodyError as exc:
            await self._reject(context, stream, exc.outcome, exc.message)
            return
        if not self._settings.gating:
            self._metrics.passthrough.labels("no_models_configured").inc()
            await context.write(_CONTINUE_BODY)
            await self._drain(context, None)
            return
        engine = await self._models.lookup(facts.model)
        if engine is None:
            known = ", ".join(self._models.known()) or "(none)"
            await self._reject(
                context, stream, Outcome.UNKNOWN_MODEL,
                f"The model `{facts.model}` does not exist. Known models: {known}",
            )
            return

        stream.engine = engine
        snap = self._admission.gate(engine.name).snapshot
        cost = await self._estimator.estimate(engine, endpoint, body.body, facts,
                                              snap.prompt_tokens_total if snap else None,
                                              snap.scrape_started if snap else None)
        decision = await self._admission.arrive(engine.name, facts.model, cost.tokens, cost.generation_tokens)
        stream.ticket = decision.ticket
        outcome = decision.outcome
        # Decided: nothing below reads the request, and a parked or admitted one must not keep its
        # body (up to MAX_BODY_BYTES) for as long as it waits or streams.
        del message, body, headers
        pending_read: asyncio.Future[object] | None = None
        try:
            if outcome is Outcome.PARKED:
                self._metrics.child(self._metrics.decision_latency, engine.name, outcome.value).observe(
                    time.perf_counter() - started)
                log.info("parked", extra={"request_id": stream.request_id, "engine": engine.name, "model": facts.model,
                                          "queue_depth": self._admission.gate(engine.name).queue_depth})
                # The ticket may be decided (admitted by a completion, expired, drained) while this
                # write is in flight; `wait` still returns that decision.
                await context.write(self._park_response(engine))
                decision, pending_read = await self._wait_parked(context, stream)
                outcome = decision.outcome
                if outcome is Outcome.CLIENT_GONE:
                    log.info("client gone while parked", extra={"request_id": stream.request_id, "engine": engine.name})
                    return
                started = time.perf_counter()
            if outcome.admits:
                # Failed-open requests too: the engine counts their prompts all the same.
                self._estimator.admitted(engine.name, facts.model, cost)
                stream.admitted = facts
                await context.write(self._admitted_responses[engine.name])
                self._metrics.child(self._metrics.decision_latency, engine.name, outcome.value).observe(
                    time.perf_counter() - started)
                log.debug("admitted", extra={"request_id": stream.request_id, "engine": engine.name, "outcome": outcome.value})
                reader, pending_read = pending_read, None
                await self._drain(context, None, reader)
                return
            gate = self._admission.gate(engine.name)
            message_text = {
                Outcome.QUEUE_FULL: f"engine `{engine.name}` is at capacity and its queue is full; retry later",
                Outcome.PARK_TIMEOUT: (
                    f"engine `{engine.name}` stayed at capacity for {engine.limits.max_park_seconds:g}s; retry later"
                ),
                Outcome.EXPECTED_WAIT_TOO_LONG: (
                    f"engine `{engine.name}` is at capacity and the expected wait exceeds "
                    f"{engine.limits.max_park_seconds:g}s; retry later"
                ),
                Outcome.EXCEEDS_KV_CAPACITY: (
                    f"this request needs about {gate.cost(decision.ticket)} tokens of KV cache (prompt ~"
                    f"{cost.prompt_tokens} + up to {cost.generation_tokens} generated), more than engine "
                    f"`{engine.name}` holds in total ({gate.capacity_tokens}); shorten the prompt or lower max_tokens"
                ),
                Outcome.SHUTTING_DOWN: "the admission service is shutting down; retry",
            }.get(outcome, outcome.value)
            self._metrics.child(self._metrics.decision_latency, engine.name, outcome.value).observe(
                time.perf_counter() - started)
            await self._reject(context, stream, outcome, message_text, counted=True, retry_after=decision.retry_after)
        finally:
            if pending_read is not None:  # never leave a read behind to fail unobserved
                pending_read.cancel()
                await asyncio.gather(pending_read, return_exceptions=True)

    async def _wait_parked(
        self, context: grpc.aio.ServicerContext, stream: _Stream
    ) -> tuple[Decision, asyncio.Future[object] | None]:
        """Wait for the gate's answer while watching the stream; its end means the client left."""
        assert stream.engine is not None and stream.ticket is not None
        waiter = asyncio.ensure_future(self._admission.wait(stream.engine.name, stream.ticket))
        reader: asyncio.Future[object] = asyncio.ensure_future(context.read())
        returned = False
        try:
            while True:
                await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if waiter.done():
                    decision = waiter.result()
                    returned = True
                    return decision, reader
                if reader.exception() is None and reader.result() is not grpc.aio.EOF:
                    log.warning("unexpected message while parked: %s", reader.result().WhichOneof("request"))  # type: ignore[attr-defined]
                    reader = asyncio.ensure_future(context.read())
                    continue
                returned = True
                return Decision(stream.ticket, Outcome.CLIENT_GONE), None
        finally:
            if not waiter.done():
                waiter.cancel()
                await asyncio.gather(waiter, return_exceptions=True)
            if not returned:  # failed or cancelled: the caller never sees the read
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)

    async def _drain(
        self, context: grpc.aio.ServicerContext, message: object | None, pending: asyncio.Future[object] | None = None
    ) -> None:
        """Answer anything else Envoy sends with CONTINUE until the HTTP stream ends."""
        while True:
            if message is not None:
                await context.write(_continue_for(message))
            if pending is not None:
                message, pending = await pending, None
            else:
                message = await context.read()
            if message is grpc.aio.EOF:
                return

    async def _reject(
        self, context: grpc.aio.ServicerContext, stream: _Stream, outcome: Outcome, message: str,
        counted: bool = False, retry_after: int | None = None,
    ) -> None:
        row = REJECTIONS[outcome]
        engine = stream.engine.name if stream.engine else "none"
        if not counted:  # gate outcomes are counted by Admission; body/validation outcomes here
            self._metrics.rejected.labels(engine, stream.ticket.model if stream.ticket else "", outcome.value).inc()
        headers = [_header("content-type", "application/json"), _header(OUTCOME_HEADER, outcome.value)]
        if row.retry_after:
            headers.append(_header("retry-after", str(retry_after or self._settings.retry_after_seconds)))
        log.info("rejected", extra={"request_id": stream.request_id, "engine": engine, "outcome": outcome.value,
                                    "status": row.status, "detail": message})
        await context.write(
            pb.ProcessingResponse(
                immediate_response=pb.ImmediateResponse(
                    status=http_status_pb2.HttpStatus(code=row.status),  # type: ignore[arg-type]
                    headers=pb.HeaderMutation(set_headers=headers),
                    body=error_body(outcome, message),
                    details=f"admission_{outcome.value}",
                )
            )
        )

    def _too_large_message(self, declared: int | None) -> str:
        size = f" ({declared} bytes)" if declared is not None else ""
        return f"request body{size} exceeds the limit of {self._settings.max_body_bytes} bytes"

    def _park_response(self, engine: EngineConfig) -> pb.ProcessingResponse:
        timeout = engine.limits.max_park_seconds + PARK_TIMEOUT_MARGIN_SECONDS
        seconds = int(timeout)
        return pb.ProcessingResponse(
            override_message_timeout=duration_pb2.Duration(seconds=seconds, nanos=int((timeout - seconds) * 1e9))
        )

    def _admitted_response(self, engine: EngineConfig) -> pb.ProcessingResponse:
        return pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    header_mutation=pb.HeaderMutation(set_headers=[_header(ROUTE_HEADER, engine.name)]),
                    clear_route_cache=self._multi_engine,
                )
            )
        )


def _header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _continue_for(message: object) -> pb.ProcessingResponse:
    kind = message.WhichOneof("request")  # type: ignore[attr-defined]
    if kind == "request_headers":
        return _CONTINUE_HEADERS
    if kind == "request_body":
        return _CONTINUE_BODY
    if kind == "request_trailers":
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    if kind == "response_headers":
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    if kind == "response_body":
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
