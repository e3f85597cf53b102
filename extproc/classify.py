"""What a gated request is, from what its ext_proc stream has shown: a route or a rejection.

Pure functions, no IO, no asyncio, no metrics: the servicer feeds them what Envoy sent and
turns their answers into ext_proc messages. A request is classified in three steps, one per
point where the stream has learnt something new:

1. `classify_headers` (the `request_headers` message): an ungated path passes (`Passed`); an
   encoded spelling of a gated path, a declared length over the cap or a gated POST without a
   body is rejected (`Rejected`); otherwise the request is `Gated` and its body is read. On a
   one-message route (no headers phase) `classify_route` makes it `Gated` from the path the route
   names: Envoy's route has already checked the method and that a body is declared.
2. `classify_body` (the `request_body` message): a body over the cap (or a prefix of one, cut
   at the cap and sent with `end_of_stream=false`; a shorter body with `end_of_stream=false` is
   whole, with trailers after it) and a body the endpoint's parser refuses are rejected; with no
   model configured the request passes; otherwise the body's `BodyFacts` (model, stream, sizes,
   n / best_of) are what admission needs.
3. `route` (after the model registry's answer): the engine serving the model, or 404.

Two things the decision needs may take IO and are therefore awaited by the servicer between
the steps, their results fed in: the model registry's lookup (it re-reads the engines'
`/v1/models` when no list holds a name) and the cost estimate (`tokencount.Estimator`: a
tokenizer thread or the engine's `/tokenize`). The facts are pure (here); the estimate is not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .bodyscan import BodyError, BodyFacts
from .config import EngineConfig, Settings
from .endpoints import Endpoint, PathRules, Route, body_facts, endpoint_for
from .outcomes import Outcome, rejection_message

#: Longest part of a client's path quoted back in a rejection.
QUOTED_PATH_CHARS = 200


@dataclass(frozen=True, slots=True)
class Rejected:
    """Answer the client with this outcome's status and message; nothing reaches the engine."""

    outcome: Outcome
    message: str


@dataclass(frozen=True, slots=True)
class Passed:
    """Not subject to admission; `reason` is the `admission_passthrough_total` label."""

    reason: str


@dataclass(slots=True)  # not frozen: built for every request, and a frozen one costs three times as much
class Gated:
    """A gated request whose body is still to be read."""

    path: str  # without the query
    endpoint: Endpoint
    content_type: str


@dataclass(slots=True)  # not frozen: built for every gated request (see Gated)
class Routed:
    """A gated request with its engine and the facts its cost estimate needs."""

    engine: EngineConfig
    endpoint: Endpoint
    facts: BodyFacts


NOT_GATED = Passed("path_not_gated")
NO_MODELS = Passed("no_models_configured")


def classify_headers(headers: Mapping[str, str], end_of_stream: bool, rules: PathRules,
                     settings: Settings) -> Gated | Passed | Rejected:
    """The request headers' verdict: gated (read the body), passed through, or rejected."""
    target = headers.get(":path", "")
    route, path = rules.route(headers.get(":method", ""), target)
    if route is Route.PASS:
        return NOT_GATED
    if route is Route.AMBIGUOUS:
        return _reject(Outcome.AMBIGUOUS_PATH, path=target[:QUOTED_PATH_CHARS])
    endpoint = endpoint_for(path)
    declared = headers.get("content-length", "")
    if not endpoint.multipart and declared.isdigit() and int(declared) > settings.max_body_bytes:
        return too_large(settings, int(declared))
    if end_of_stream:
        return _reject(Outcome.INVALID_BODY, detail="request body is required")
    return Gated(path, endpoint, headers.get("content-type", ""))


def classify_route(path: str) -> Gated:
    """A one-message route's verdict (no headers seen): Envoy's route matched the gated `path`, a
    POST declaring a body, and enforces the body cap itself; the body is read."""
    return Gated(path, endpoint_for(path), "")  # multipart endpoints never get a one-message route


def classify_body(gated: Gated, body: bytes, end_of_stream: bool, settings: Settings) -> BodyFacts | Passed | Rejected:
    """The body's verdict: the facts admission needs, passed through (nothing gated), or rejected."""
    # A multipart upload (audio) may exceed the cap: its form fields are read from the prefix.
    # `end_of_stream` false does not make a body too large: Envoy sends the whole body so when
    # request trailers follow it (HTTP/2, gRPC-web). Only a prefix Envoy cut at its buffer limit
    # (BUFFERED_PARTIAL; the cap) is: it holds at least the cap.
    if not gated.endpoint.multipart and (len(body) > settings.max_body_bytes
                                         or (not end_of_stream and len(body) >= settings.max_body_bytes)):
        return too_large(settings, None)
    try:
        facts = body_facts(gated.endpoint, body, gated.content_type, end_of_stream, settings.bytes_per_token)
    except BodyError as exc:
        return _reject(exc.outcome, detail=exc.message)
    if not settings.gating:
        return NO_MODELS
    return facts


def route(gated: Gated, facts: BodyFacts, engine: EngineConfig | None,
          known: Callable[[], Iterable[str]]) -> Routed | Rejected:
    """The engine the registry named for the body's model, or 404 naming the models it knows."""
    if engine is None:
        return _reject(Outcome.UNKNOWN_MODEL, model=facts.model, known=", ".join(known()) or "(none)")
    return Routed(engine, gated.endpoint, facts)


def too_large(settings: Settings, declared: int | None) -> Rejected:
    return _reject(Outcome.BODY_TOO_LARGE, limit=settings.max_body_bytes,
                   declared="" if declared is None else f" ({declared} bytes)")


def _reject(outcome: Outcome, **fields: object) -> Rejected:
    return Rejected(outcome, rejection_message(outcome, **fields))
