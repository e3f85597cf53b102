"""The ext_proc gRPC servicer: translates Envoy's per-request stream into admission decisions.

Protocol rules this module relies on (Envoy 1.40, DESIGN.md):
- One bidirectional stream per HTTP request. Envoy sends `request_headers`, then one
  `request_body` holding the whole body (`end_of_stream=false` when request trailers follow it).
  A gated JSON request's headers answer switches the body mode to BUFFERED: Envoy holds the
  headers until the body's answer (under the filter's BUFFERED_PARTIAL, a body still arriving
  when the headers were answered let them on to the router, which chose its route before the
  body's answer could name the engine) and answers 413 itself past the cap. A multipart upload
  keeps BUFFERED_PARTIAL: only its first `per_connection_buffer_limit_bytes` come, with
  `end_of_stream=false`, when it is larger.
- On a one-message route (one engine, a POST to a gated JSON path declaring a body: envoyconf)
  Envoy skips the headers phase: the stream's gRPC metadata names the gated path
  (`ENDPOINT_METADATA`), its only request message is `request_body` with the whole body (body
  mode BUFFERED: Envoy answers 413 itself past the cap) and the request id as an attribute. The
  buffer filter after ext_proc holds the request's headers until the body is answered, so nothing
  reaches the engine before the decision. A header mutation in that answer is ignored (Envoy has
  no headers to apply it to), which is why only one engine gets these routes: the route header
  selects among several.
- Each message must be answered within `message_timeout`, unless the answer is preceded by one
  `override_message_timeout` (<= `max_message_timeout`); that is how a request is parked. Only
  the first override counts, so a parked request gets exactly one, sized above the park cap and
  never below `message_timeout` (`SERVICE_STALL_SECONDS`: a parked request survives a stall).
- The stream stays open until the HTTP stream ends, even after the last request-phase answer.
  Its end is the completion signal that frees the request's slot in the local ledger; a stream
  that ends or breaks while parked means the client went away.
- Rejections are ImmediateResponses (HTTP status + JSON body), never gRPC errors: a gRPC error
  would hand the request to Envoy's failure mode instead of giving the client an answer. After
  one, the servicer ends the stream itself.
- Anything out of that order (a stream that does not start with `request_headers`, no
  `request_body` after a gated request's headers, response-phase messages) is answered with the
  matching CONTINUE until the stream ends; a message that arrives while parked is logged and not
  answered (Envoy sends none while it waits for the body's answer).

Shape: `ExternalProcessor.Process` is a loop that reads the stream and feeds each message to the
stream's `Conversation`; while the request is parked it also waits for the gate, whichever comes
first, and feeds the gate's decision to it (`decided`). The conversation holds the protocol: what to
answer in which phase, from the pure verdicts of `extproc.classify` and the gate's decisions;
it records every metric and log line about the request in one method (`_record`), and releases
the request's ticket when the stream ends (`close`, from the loop's `finally`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2

from .admission import Admission
from .classify import Gated, Passed, Rejected, Routed, classify_body, classify_headers, classify_route, route
from .config import EngineConfig, Settings
from .contextlen import LengthFacts, context_refusal, output_limit
from .contract import (
    ENDPOINT_METADATA,
    EXT_PROC_ATTRIBUTES,
    OUTCOME_HEADER,
    PARK_TIMEOUT_MARGIN_SECONDS,
    READ_REQUEST_HEADERS,
    REQUEST_ID_ATTRIBUTE,
    ROUTE_HEADER,
    ROUTE_METADATA_KEY,
    ROUTE_METADATA_NAMESPACE,
    SERVICE_REPLY_DETAILS_PREFIX,
    SERVICE_STALL_SECONDS,
)
from .endpoints import PathRules
from .estimate import CostEstimate
from .gate import Decision, Ticket
from .metrics import Metrics
from .models import ModelRegistry
from .outcomes import REJECTIONS, Outcome, error_body, rejection_message
from .tokencount import CHAT, COUNTABLE, Estimator
from .wire import base_pb2, http_status_pb2, pb, pb_grpc, processing_mode_pb2

log = logging.getLogger("extproc.servicer")

_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
#: A gated JSON request's headers answer: its whole body is the next message, and Envoy holds the
#: headers until the body's answer. Under the filter's BUFFERED_PARTIAL a body that had not fully
#: arrived when this answer came let the headers on to the router first: the route was chosen (with
#: several engines, the `engine_not_selected` one) and the response sent before the body's answer
#: could name the engine (`!route_cache_blocked_`). Past the cap Envoy answers 413 itself.
_BUFFER_BODY = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED),
)
_SKIP_BODY = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(request_body_mode=processing_mode_pb2.ProcessingMode.NONE),
)

Write = Callable[[pb.ProcessingResponse], Awaitable[None]]


class Phase(enum.Enum):
    HEADERS = "headers"  # nothing seen yet: `request_headers` expected (or `request_body` on a one-message route)
    BODY = "body"  # a gated request's headers answered: `request_body` expected
    PARKED = "parked"  # the park answer sent: waiting for the gate's decision or the stream's end
    OPEN = "open"  # answered: CONTINUE to anything else until the HTTP stream ends
    DONE = "done"  # rejected: the servicer ends the stream


@dataclass(eq=False, slots=True)
class _Stream:
    """What one ext_proc stream (one HTTP request) has accumulated; never the body itself."""

    request_id: str = "-"
    target: str = ""  # `:path` as sent, query included (on a one-message route: the gated path it names)
    route_path: str | None = None  # the gated path a one-message route names (no headers phase)
    phase: Phase = Phase.HEADERS
    gated: Gated | None = None  # until the body is read
    routed: Routed | None = None  # engine, endpoint and body facts of a request that reached the gate
    cost: CostEstimate | None = None
    ticket: Ticket | None = None
    admitted: bool = False  # sent to the engine (its facts feed the estimator's calibration at the end)
    waiting: asyncio.Future[Decision] | None = None  # while parked: the gate's decision, for `decided`
    started: float = 0.0  # perf_counter when the decision being made began (decision latency)

    def __repr__(self) -> str:
        engine = self.routed.engine.name if self.routed is not None else None
        path = self.target.split("?", 1)[0]
        return f"<Stream {self.request_id} {path} {self.phase.value} engine={engine} {self.ticket}>"


@dataclass(frozen=True, slots=True)
class _Shared:
    """What every stream's conversation uses: built once by the servicer."""

    settings: Settings
    admission: Admission
    metrics: Metrics
    paths: PathRules
    models: ModelRegistry
    estimator: Estimator
    admitted_responses: dict[str, pb.ProcessingResponse]  # by engine name
    park_responses: dict[str, pb.ProcessingResponse]  # by engine name


class Conversation:
    """One stream's side of the ext_proc protocol: fed Envoy's messages and the gate's decision,
    it writes the answers through `write`."""

    __slots__ = ("stream", "_shared", "_write")

    def __init__(self, shared: _Shared, write: Write, route_path: str | None = None) -> None:
        self.stream = _Stream(route_path=route_path)
        self._shared = shared
        self._write = write

    def __repr__(self) -> str:
        return f"<Conversation {self.stream!r}>"

    async def receive(self, message: pb.ProcessingRequest) -> None:
        """One message from Envoy."""
        phase = self.stream.phase
        if phase is Phase.OPEN:
            await self._write(_continue_for(message))
        elif phase is Phase.HEADERS and message.HasField("request_headers"):
            await self._on_headers(message.request_headers)
        elif phase is Phase.HEADERS and self.stream.route_path is not None and message.HasField("request_body"):
            self._on_route(message)
            step = await self._on_body(message.request_body)
            del message  # as below
            await self._answer(step)
        elif phase is Phase.BODY and message.HasField("request_body"):
            step = await self._on_body(message.request_body)
            del message  # decided: a parked or admitted request must not keep its body (up to MAX_BODY_BYTES)
            await self._answer(step)
        elif phase is Phase.PARKED:
            log.warning("unexpected message while parked: %s", message.WhichOneof("request"))
        else:
            log.warning("expected %s, got %s; answering CONTINUE", "request_headers" if phase is Phase.HEADERS
                        else "request_body", message.WhichOneof("request"))
            self.stream.phase = Phase.OPEN
            await self._write(_continue_for(message))

    async def decided(self, decision: Decision) -> None:
        """The gate's decision about the parked ticket."""
        self.stream.waiting = None
        self.stream.started = time.perf_counter()
        await self._answer(decision)

    def failed(self) -> None:
        """The stream failed with an exception (being handled): Envoy's failure mode decides."""
        self._record(None)

    async def close(self) -> None:
        """The stream is over, however it ended: release what the request holds."""
        s = self.stream
        waiting, s.waiting = s.waiting, None
        if waiting is not None:
            if not waiting.done():
                self._record(Outcome.CLIENT_GONE)
            waiting.cancel()  # a cancelled wait takes the ticket out of the queue (as client_gone)
            await asyncio.gather(waiting, return_exceptions=True)
        if s.routed is not None:
            engine = s.routed.engine.name
            if s.ticket is not None:
                await self._shared.admission.finish(engine, s.ticket)
            if s.admitted:
                self._shared.estimator.finished(engine, s.routed.facts)

    # --- phases ----------------------------------------------------------------------------------

    async def _on_headers(self, request: pb.HttpHeaders) -> None:
        s, shared = self.stream, self._shared
        headers = _header_map(request)
        s.request_id = headers.get("x-request-id", "-")
        s.target = headers.get(":path", "")
        verdict = classify_headers(headers, request.end_of_stream, shared.paths, shared.settings)
        if isinstance(verdict, Gated):
            s.gated = verdict
            s.phase = Phase.BODY
            # A multipart upload may exceed the cap: it keeps BUFFERED_PARTIAL (its form fields
            # are read from the prefix).
            await self._write(_CONTINUE_HEADERS if verdict.endpoint.multipart else _BUFFER_BODY)
        elif isinstance(verdict, Passed):
            self._record(Outcome.PASSED_THROUGH, verdict.reason)
            s.phase = Phase.OPEN
            await self._write(_SKIP_BODY)
        else:
            await self._reject(verdict.outcome, verdict.message)

    def _on_route(self, message: pb.ProcessingRequest) -> None:
        """A one-message route's body arrived first: the request is gated on the path the route names."""
        s = self.stream
        assert s.route_path is not None
        attributes = message.attributes.get(EXT_PROC_ATTRIBUTES)
        if attributes is not None and REQUEST_ID_ATTRIBUTE in attributes.fields:
            s.request_id = attributes.fields[REQUEST_ID_ATTRIBUTE].string_value or "-"
        s.target = s.route_path
        s.gated = classify_route(s.route_path)

    async def _on_body(self, body: pb.HttpBody) -> Passed | Rejected | Decision:
        """Classify the body, route it, estimate its cost and ask the gate: the step to answer."""
        s, shared = self.stream, self._shared
        s.started = time.perf_counter()
        gated, s.gated = s.gated, None
        assert gated is not None
        facts = classify_body(gated, body.body, body.end_of_stream, shared.settings)
        if isinstance(facts, (Passed, Rejected)):
            return facts
        routed = route(gated, facts, await shared.models.lookup(facts.model), shared.models.known)
        if isinstance(routed, Rejected):
            return routed
        s.routed = routed
        engine = routed.engine
        snap = shared.admission.gate(engine.name).snapshot
        s.cost = cost = await shared.estimator.estimate(engine, routed.endpoint, body.body, facts,
                                                        snap.prompt_tokens_total if snap else None,
                                                        snap.scrape_started if snap else None)
        refusal = context_refusal(_length_facts(routed, body.body, cost), shared.models.max_model_len(facts.model))
        if refusal is not None:  # the engine would refuse it without using KV: say so now, never forward it
            return Rejected(Outcome.CONTEXT_LENGTH_EXCEEDED, refusal)
        decision = await shared.admission.arrive(engine.name, facts.model, cost.tokens, cost.generation_tokens,
                                                 facts.engine_requests)
        s.ticket = decision.ticket
        return decision

    async def _answer(self, step: Passed | Rejected | Decision) -> None:
        s, shared = self.stream, self._shared
        if isinstance(step, Passed):
            self._record(Outcome.PASSED_THROUGH, step.reason)
            s.phase = Phase.OPEN
            await self._write(_CONTINUE_BODY)
            return
        if isinstance(step, Rejected):
            await self._reject(step.outcome, step.message)
            return
        outcome, routed = step.outcome, s.routed
        assert routed is not None and s.cost is not None
        engine = routed.engine.name
        if outcome is Outcome.PARKED:
            self._record(outcome)
            s.phase = Phase.PARKED
            # The ticket may be decided (admitted by a completion, expired, drained) while this
            # write is in flight; `wait` still returns that decision.
            await self._write(shared.park_responses[engine])
            s.waiting = asyncio.ensure_future(shared.admission.wait(engine, step.ticket))
        elif outcome.admits:
            # Failed-open requests too: the engine counts their prompts all the same.
            shared.estimator.admitted(engine, routed.facts.model, s.cost)
            s.admitted = True
            s.phase = Phase.OPEN
            await self._write(shared.admitted_responses[engine])
            self._record(outcome)
        else:
            await self._reject(outcome, _gate_message(step, routed.engine, s.cost, shared.admission),
                               step.retry_after)

    async def _reject(self, outcome: Outcome, message: str, retry_after: int | None = None) -> None:
        row = REJECTIONS[outcome]
        headers = [_header("content-type", "application/json"), _header(OUTCOME_HEADER, outcome.value)]
        if row.retry_after:
            headers.append(_header("retry-after", str(retry_after or self._shared.settings.retry_after_seconds)))
        self._record(outcome, message)
        self.stream.phase = Phase.DONE
        await self._write(pb.ProcessingResponse(
            immediate_response=pb.ImmediateResponse(
                # The stubs type an enum field as its StatusCode class; on the wire (and at runtime) it is this int.
                status=http_status_pb2.HttpStatus(code=row.status),  # type: ignore[arg-type]
                headers=pb.HeaderMutation(set_headers=headers),
                body=error_body(outcome, message),
                details=SERVICE_REPLY_DETAILS_PREFIX + outcome.value,  # envoyconf keeps these replies as they are
            )
        ))

    # --- the record ------------------------------------------------------------------------------

    def _record(self, outcome: Outcome | None, detail: str = "") -> None:
        """Every metric and log line about this request: once per decision, or once for a stream
        that failed (`outcome` None). `Admission` counts the gate's own decisions (admitted, parked,
        rejected, park durations) and the estimator its estimates; the rest is counted here."""
        s, m = self.stream, self._shared.metrics
        if outcome is None:
            m.internal_errors.inc()  # fail-open by default: count it so a bug never hides behind it
            log.exception("ext_proc stream failed", extra={"request_id": s.request_id})
            return
        if outcome is Outcome.PASSED_THROUGH:
            m.child(m.passthrough, detail).inc()
            return
        engine = s.routed.engine.name if s.routed is not None else "none"
        if outcome is Outcome.CLIENT_GONE:
            log.info("client gone while parked", extra={"request_id": s.request_id, "engine": engine})
            return
        if s.ticket is None:  # rejected before the gate (path, body, model): not counted by Admission
            m.child(m.rejected, engine, "", outcome.value).inc()
        else:
            m.child(m.decision_latency, engine, outcome.value).observe(time.perf_counter() - s.started)
        if outcome.admits:
            if log.isEnabledFor(logging.DEBUG):  # the common case: no dict built for a line nobody reads
                cost = s.cost
                log.debug("admitted", extra={"request_id": s.request_id, "engine": engine, "outcome": outcome.value,
                                             # the rule that admitted it (projected policy), "" otherwise
                                             "policy": s.ticket.policy if s.ticket is not None else "",
                                             # what the engine's prompt counter is expected to add, and from where
                                             **({"prompt_tokens": cost.engine_prompt_tokens,
                                                 "estimate_source": cost.source} if cost is not None else {})})
        elif outcome is Outcome.PARKED:
            assert s.routed is not None
            log.info("parked", extra={"request_id": s.request_id, "engine": engine, "model": s.routed.facts.model,
                                      "queue_depth": self._shared.admission.gate(engine).queue_depth})
        else:
            log.info("rejected", extra={"request_id": s.request_id, "engine": engine, "outcome": outcome.value,
                                        "status": REJECTIONS[outcome].status, "detail": detail})


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, settings: Settings, admission: Admission, metrics: Metrics,
                 models: ModelRegistry | None = None) -> None:
        self.estimator = Estimator(settings, metrics)
        multi_engine = len(settings.engines) > 1
        self._shared = _Shared(
            settings=settings, admission=admission, metrics=metrics,
            paths=PathRules(settings.gated_paths, settings.pass_paths),
            models=models or ModelRegistry(settings), estimator=self.estimator,
            admitted_responses={e.name: admitted_response(e.name, multi_engine) for e in settings.engines},
            park_responses={e.name: _park_response(e) for e in settings.engines},
        )

    async def aclose(self) -> None:
        """Release what the servicer holds beyond its streams (the estimator's connections)."""
        await self.estimator.aclose()

    def conversation(self, write: Write, route_path: str | None = None) -> Conversation:
        """A new stream's conversation, answering through `write` (`route_path`: a one-message route's)."""
        return Conversation(self._shared, write, route_path)

    async def Process(  # noqa: N802
        self, request_iterator: object,
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> None:
        conversation = Conversation(self._shared, context.write, _route_path(context))
        stream = conversation.stream
        reading: asyncio.Future[pb.ProcessingRequest] | None = None  # a read started while parked, not collected
        try:
            while stream.phase is not Phase.DONE:  # after a rejection the servicer ends the stream
                waiting = stream.waiting
                if waiting is not None:  # parked: the gate's decision or the stream's end, whichever first
                    if reading is None:
                        reading = asyncio.ensure_future(context.read())
                    await asyncio.wait((waiting, reading), return_when=asyncio.FIRST_COMPLETED)
                    if waiting.done():
                        await conversation.decided(waiting.result())
                        continue
                    if reading.exception() is not None:
                        return  # the stream broke while parked: the client is gone
                    message, reading = reading.result(), None
                elif reading is not None:
                    message, reading = await reading, None
                else:
                    message = await context.read()
                if message is grpc.aio.EOF:  # type: ignore[comparison-overlap]  # the stubs leave EOF out of read()
                    return
                await conversation.receive(message)
                del message  # not kept while parked or open
        except Exception:
            conversation.failed()
            raise
        finally:
            if reading is not None:  # never leave a read behind to fail unobserved
                reading.cancel()
                await asyncio.gather(reading, return_exceptions=True)
            await conversation.close()


def _route_path(context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse]) -> str | None:
    """The gated path a one-message route names in the stream's gRPC metadata; None on other routes."""
    for key, value in context.invocation_metadata() or ():
        if key == ENDPOINT_METADATA:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


def _length_facts(routed: Routed, body: bytes, cost: CostEstimate) -> LengthFacts:
    """What the context-length rules read from a routed request and its estimate."""
    facts, path = routed.facts, routed.endpoint.path
    limit, param = output_limit(path == CHAT, facts.max_tokens, facts.max_completion_tokens)
    if path not in COUNTABLE:  # other endpoints name their limits otherwise: the engine decides
        limit = None
    return LengthFacts(prompt_tokens=cost.prompt_tokens, exact=cost.exact, prompts=cost.prompts,
                       output_limit=limit, output_param=param,
                       # the key anywhere in the body: vLLM may truncate instead of refusing; let it decide
                       truncates=b'"truncate_prompt_tokens"' in body)


def _gate_message(decision: Decision, engine: EngineConfig, cost: CostEstimate, admission: Admission) -> str:
    """The client-facing message for the gate's rejection of this request."""
    if decision.outcome is Outcome.EXCEEDS_KV_CAPACITY:
        gate = admission.gate(engine.name)
        return rejection_message(decision.outcome, engine=engine.name, needed=gate.cost(decision.ticket),
                                 prompt_tokens=cost.prompt_tokens, generation_tokens=cost.generation_tokens,
                                 capacity=gate.capacity_tokens)
    if decision.outcome in REJECTIONS:
        return rejection_message(decision.outcome, engine=engine.name,
                                 max_park_seconds=engine.limits.max_park_seconds)
    return decision.outcome.value


def _park_response(engine: EngineConfig) -> pb.ProcessingResponse:
    # Never below the filter's own message_timeout: a parked request must survive a stall too.
    timeout = max(engine.limits.max_park_seconds + PARK_TIMEOUT_MARGIN_SECONDS, SERVICE_STALL_SECONDS)
    seconds = int(timeout)
    return pb.ProcessingResponse(
        override_message_timeout=duration_pb2.Duration(seconds=seconds, nanos=int((timeout - seconds) * 1e9))
    )


def admitted_response(engine: str, several_engines: bool) -> pb.ProcessingResponse:
    """The body answer that admits a request to `engine`: with several engines, its name in the
    metadata Envoy routes on (and the route chosen again); the header for the engine's side, where
    Envoy still holds the headers. The benchmarks' stand-in ext_procs answer with it too."""
    answer = pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(set_headers=[_header(ROUTE_HEADER, engine)]),
                clear_route_cache=several_engines,
            )
        )
    )
    if several_engines:
        answer.dynamic_metadata.update({ROUTE_METADATA_NAMESPACE: {ROUTE_METADATA_KEY: engine}})
    return answer


_READ_HEADERS = frozenset(READ_REQUEST_HEADERS)


def _header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """The headers the service reads (Envoy's forward rules send no others; any others are not decoded)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        key = h.key
        if key in _READ_HEADERS:
            raw = h.raw_value
            out[key] = raw.decode("utf-8", "replace") if raw else h.value
    return out


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _continue_for(message: pb.ProcessingRequest) -> pb.ProcessingResponse:
    kind = message.WhichOneof("request")
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
