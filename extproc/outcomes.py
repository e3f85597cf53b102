"""The one list of things that can happen to a request, and what each means at the HTTP edge.

Every decision the service makes ends in exactly one `Outcome`. The enum value doubles as the
metric label (`admission_rejected_total{reason=...}`, `admission_admitted_total{via=...}`) and
the `x-admission-outcome` response header, so logs, metrics and client-visible answers agree.
`REJECTIONS` maps each rejecting outcome to its HTTP status, OpenAI-style error fields and the
message the client reads (`rejection_message` fills it in); the servicer turns that row into an
Envoy ImmediateResponse and nothing else invents statuses or messages. (Envoy's own answers,
`ENVOY_REJECTIONS`, take their messages from the local reply config in `envoyconf`.)
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class Outcome(enum.StrEnum):
    # The request goes upstream.
    ADMITTED = "admitted"  # gate open on arrival
    ADMITTED_AFTER_PARK = "admitted_after_park"  # waited in the park, then capacity freed
    ADMITTED_FAIL_OPEN = "admitted_fail_open"  # engine state unknown or stale: admit, count it
    PASSED_THROUGH = "passed_through"  # path or model not gated: no admission decision at all
    # The request is held; one of the outcomes above or below follows.
    PARKED = "parked"
    # The request is answered by the service and never reaches the engine.
    QUEUE_FULL = "queue_full"
    PARK_TIMEOUT = "park_timeout"
    EXPECTED_WAIT_TOO_LONG = "expected_wait_too_long"  # the park cap would run out first: say so now
    EXCEEDS_KV_CAPACITY = "exceeds_kv_capacity"  # needs more KV than the engine has at all
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the model's max_model_len refuses it (contextlen)
    SHUTTING_DOWN = "shutting_down"
    BODY_TOO_LARGE = "body_too_large"
    INVALID_BODY = "invalid_body"
    MISSING_MODEL = "missing_model"
    UNKNOWN_MODEL = "unknown_model"
    DUPLICATE_MODEL = "duplicate_model"
    AMBIGUOUS_PATH = "ambiguous_path"  # an encoded or non-canonical spelling of a gated path
    # Answered by Envoy itself, never by the service: the engine cluster's circuit breaker is full
    # (the backstop when the service answered late or not at all; see envoyconf).
    ENGINE_OVERLOADED = "engine_overloaded"
    # Envoy's other local replies, shaped like the service's (envoyconf `LOCAL_REPLIES`).
    ENGINE_UNAVAILABLE = "engine_unavailable"  # connect failure, no healthy host, reset before answering
    ENGINE_TIMEOUT = "engine_timeout"  # nothing sent or received for the stream idle timeout
    ADMISSION_UNAVAILABLE = "admission_unavailable"  # the service failed and Envoy fails closed
    ENGINE_NOT_SELECTED = "engine_not_selected"  # several engines and the service named none: no guessing
    NO_ROUTE = "no_route"
    HEADERS_TOO_LARGE = "headers_too_large"
    BAD_REQUEST = "bad_request"  # not parsable as HTTP
    GATEWAY_ERROR = "gateway_error"  # any other reply Envoy makes itself (its status is kept)
    # The client went away while parked: nothing to answer, nothing admitted.
    CLIENT_GONE = "client_gone"

    @property
    def admits(self) -> bool:
        return self in _ADMITTING


_ADMITTING = frozenset(
    {Outcome.ADMITTED, Outcome.ADMITTED_AFTER_PARK, Outcome.ADMITTED_FAIL_OPEN, Outcome.PASSED_THROUGH}
)


@dataclass(frozen=True)
class Rejection:
    """How a rejecting outcome is shown to the client."""

    status: int
    error_type: str
    retry_after: bool  # whether the answer carries Retry-After (the client should try again)
    #: The service's message to the client, a `str.format` template (`{detail}`: the body parser's
    #: own words); None for Envoy's answers, whose messages are in envoyconf's local replies.
    message: str | None = None


REJECTIONS: dict[Outcome, Rejection] = {
    Outcome.QUEUE_FULL: Rejection(
        503, "service_unavailable", retry_after=True,
        message="engine `{engine}` is at capacity and its queue is full; retry later"),
    Outcome.PARK_TIMEOUT: Rejection(
        503, "service_unavailable", retry_after=True,
        message="engine `{engine}` stayed at capacity for {max_park_seconds:g}s; retry later"),
    Outcome.EXPECTED_WAIT_TOO_LONG: Rejection(
        503, "service_unavailable", retry_after=True,
        message="engine `{engine}` is at capacity and the expected wait exceeds {max_park_seconds:g}s; retry later"),
    Outcome.EXCEEDS_KV_CAPACITY: Rejection(
        400, "invalid_request_error", retry_after=False,
        message="this request needs about {needed} tokens of KV cache (prompt ~{prompt_tokens} + up to "
                "{generation_tokens} generated), more than engine `{engine}` holds in total ({capacity}); "
                "shorten the prompt or lower max_tokens"),
    # vLLM's own words for the refusal it would make (extproc/contextlen.py).
    Outcome.CONTEXT_LENGTH_EXCEEDED: Rejection(400, "invalid_request_error", retry_after=False, message="{detail}"),
    Outcome.SHUTTING_DOWN: Rejection(
        503, "service_unavailable", retry_after=True, message="the admission service is shutting down; retry"),
    Outcome.BODY_TOO_LARGE: Rejection(
        413, "invalid_request_error", retry_after=False,
        message="request body{declared} exceeds the limit of {limit} bytes"),  # declared: " (N bytes)" or ""
    Outcome.INVALID_BODY: Rejection(400, "invalid_request_error", retry_after=False, message="{detail}"),
    Outcome.MISSING_MODEL: Rejection(400, "invalid_request_error", retry_after=False, message="{detail}"),
    Outcome.UNKNOWN_MODEL: Rejection(
        404, "not_found_error", retry_after=False,
        message="The model `{model}` does not exist. Known models: {known}"),
    Outcome.DUPLICATE_MODEL: Rejection(400, "invalid_request_error", retry_after=False, message="{detail}"),
    Outcome.AMBIGUOUS_PATH: Rejection(
        400, "invalid_request_error", retry_after=False,
        message="the path `{path}` is an encoded or non-canonical spelling of a gated endpoint; send the plain "
                "path (e.g. /v1/chat/completions)"),
}

#: Rejections Envoy answers itself (local reply config), in the same shape; the service never
#: decides or counts them.
ENVOY_REJECTIONS: dict[Outcome, Rejection] = {
    Outcome.ENGINE_OVERLOADED: Rejection(503, "service_unavailable", retry_after=True),
    Outcome.ENGINE_UNAVAILABLE: Rejection(503, "service_unavailable", retry_after=True),
    Outcome.ENGINE_TIMEOUT: Rejection(504, "timeout_error", retry_after=False),
    Outcome.ADMISSION_UNAVAILABLE: Rejection(503, "service_unavailable", retry_after=True),
    Outcome.ENGINE_NOT_SELECTED: Rejection(503, "service_unavailable", retry_after=True),
    Outcome.NO_ROUTE: Rejection(404, "not_found_error", retry_after=False),
    Outcome.HEADERS_TOO_LARGE: Rejection(431, "invalid_request_error", retry_after=False),
    Outcome.BAD_REQUEST: Rejection(400, "invalid_request_error", retry_after=False),
    Outcome.GATEWAY_ERROR: Rejection(500, "server_error", retry_after=False),  # status: Envoy's own
}

#: Outcomes counted in `admission_rejected_total{reason}`.
REJECTED_REASONS: tuple[Outcome, ...] = (*REJECTIONS, Outcome.CLIENT_GONE)

#: The rejections that mean "the engine is full": what the dashboard's rejection ratio and the alert
#: LLMAdmissionHighRejectionRatio count (a client's bad request or a shutdown is not capacity).
CAPACITY_REJECTIONS: tuple[Outcome, ...] = (Outcome.QUEUE_FULL, Outcome.PARK_TIMEOUT, Outcome.EXPECTED_WAIT_TOO_LONG)
#: The same as a PromQL regex over the `reason` label.
CAPACITY_REASONS_REGEX = "|".join(o.value for o in CAPACITY_REJECTIONS)


def rejection_message(outcome: Outcome, **fields: object) -> str:
    """The client-facing message for a rejecting outcome of the service, its template filled in."""
    template = REJECTIONS[outcome].message
    assert template is not None, outcome
    return template.format(**fields)


def error_body(outcome: Outcome, message: str) -> bytes:
    """The OpenAI-style JSON error document for a rejecting outcome."""
    row = REJECTIONS.get(outcome) or ENVOY_REJECTIONS[outcome]
    doc = {"error": {"message": message, "type": row.error_type, "code": outcome.value}}
    return json.dumps(doc, separators=(",", ":")).encode()
