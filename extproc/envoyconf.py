"""Generate the Envoy config from the same settings the service runs with (one source of truth).

The timeouts follow from the park cap (DESIGN.md, Envoy 1.40 facts):
- route `timeout: 0s`: the route timeout also bounds the whole upstream response, and a
  generation can stream for many minutes;
- `stream_idle_timeout` fires while a request is parked and while a long prefill produces no
  bytes: it must exceed the park cap plus the worst time to first token (default cap + 600 s);
- ext_proc `message_timeout` bounds ordinary answers. The service answers in well under a
  millisecond, but Envoy 1.40's ext_proc fails a message timeout, a reset stream and an
  unreachable service alike (`failure_mode_allow`: open = forward ungated), and has no option that
  tells them apart. So every timeout that could declare a live service dead is at least
  `SERVICE_STALL_SECONDS` (15 s): `message_timeout`; the HTTP/2 `connection_keepalive` timeout on
  the service's connection (a ping unanswered for that long closes the connection and resets every
  stream on it, parked ones included; interval 30 s, so a dead peer without a FIN is noticed within
  ~50 s); and the override a parked request gets. A stall shorter than that (GC, a starved CPU, a
  stopped process) holds requests, and the service decides each one when it resumes: admitted, or
  503 + Retry-After. Fail-open is left for a service that is down: connection refused or reset
  (at once), or silent for longer than `SERVICE_STALL_SECONDS`;
- `max_message_timeout` must admit the one `override_message_timeout` the service sends when it
  parks a request (park cap + margin, at least `SERVICE_STALL_SECONDS`): park cap + 2 margins, at
  least `SERVICE_STALL_SECONDS` + margin;
- the listener's `per_connection_buffer_limit_bytes` is the body cap: with body mode
  BUFFERED_PARTIAL a larger body reaches the service as a prefix with `end_of_stream=false`, and
  the service answers 413 itself (a JSON body, not Envoy's plain text); on a one-message route
  (below, body mode BUFFERED) Envoy answers 413 itself, shaped by the local reply config;
- each parked request holds one gRPC stream and one upstream request slot on the ext_proc
  cluster: its circuit breakers are set to the service's stream limit, far above any queue bound.

The engine's own cluster is the backstop behind the service: its circuit breaker allows at most
max in-flight + engine queue slots concurrent requests (`max_requests`, which Envoy applies to
HTTP/1.1 upstreams too, counted across all workers). Whatever the service does (answers late
under a burst, is down, is restarting) and whatever `failure_mode_allow` says, one Envoy never
has more gated requests at the engine than the gate itself would admit; the next one gets
Envoy's own 503 at once, shaped like the service's (JSON body, `Retry-After`,
`x-admission-outcome: engine_overloaded`, local reply config on response flag UO); every other
answer Envoy makes itself is shaped the same way (`LOCAL_REPLIES`). Gated paths, any path
with an escaped slash or backslash that the engine's router could decode into one, and every
other POST off the pass list go to that cluster; the pass list and every other request
(`/v1/models`, `/health`, `/tokenize`, GETs, ...) go to a second cluster for the same engine
(`<cluster>_ungated`) with the service's stream limit, so long generations never starve health
checks and model listings.

One message per request where it is safe (measured on a do-nothing ext_proc: 1,960 -> 3,470
requests/s): a POST to a gated JSON path that declares a body (`content-length` of at least
one byte: the HTTP codecs then guarantee the body comes) takes a route of its own whose ext_proc
override skips the request headers phase (body mode BUFFERED), names the gated path in the
stream's gRPC metadata and enables Envoy's buffer filter after ext_proc. Without that buffer
filter Envoy 1.40 passes a skipped headers phase straight on to the router, which starts the
upstream request before the service has decided (`python -m bench.hotpath --probe-one-message`);
with it the headers wait for the body, and the body waits for the service's answer. Everything
else on a gated path (no or chunked body, another method, multipart uploads, which may exceed the
cap, escaped separators) keeps the two messages.

With several engines Envoy routes on the engine the service names in the request's dynamic
metadata (`llm_admission.engine`, the only namespace ext_proc may write), with the route chosen
again after its answer: a header would not do, since Envoy applies no header mutation from a body
answer when it skipped the headers phase. A one-message route is the route until then, and it
answers `engine_not_selected` if the service named no engine; so does every gated path.

Every POST that is not on the pass list (`ADMISSION_PASS_PATHS`, vLLM's cheap routes) is gated,
an unknown path included, and routed as a gated path (to the bounded cluster, or by the
service's metadata): a route a new engine release adds never reaches the engine unbounded
through the catch-all while the service is down and Envoy fails open.

Every request header starting with `x-admission-` is removed as the request enters Envoy (HCM
early header mutation, before routing): a client can neither pose as the service's answer nor
hand the engine an `x-admission-engine` of its own, on gated paths, ungated paths, or while the
service is down; and no client can set dynamic metadata.

With mTLS on the service's gRPC port (`EXTPROC_TLS_*`, or `extproc_tls`), the `extproc` cluster
gets a TLS transport socket: Envoy presents its client certificate, offers ALPN h2, and accepts
the service only with a certificate that chains to the CA and names the host Envoy dialled (its
DNS name, or IP address) as a subject alternative name. Without `extproc_tls` and with the
service's own TLS settings, Envoy presents the service's certificate and verifies with the
service's client CA: one Secret for both sides, as the chart mounts it.

`failure_mode_allow` is the explicit choice for "the admission service is down": `open` (default)
forwards requests ungated, so an admission outage never becomes an inference outage; `closed`
answers 503 (`status_on_error`) instead.

Slow clients cannot hold the listener (a client that sends a partial request header and one
byte every few seconds, hundreds of them): HCM `request_headers_timeout`
(`REQUEST_HEADERS_TIMEOUT_SECONDS`, 10 s: a real client sends its headers in one write; a slow
mobile link needs a few seconds; the timer starts at the first byte and no trickle resets it)
closes such a connection, with a 408, however slowly it trickles, so the connection cap below is
held by slow clients for at most that long; a downstream connection with no request in progress
is closed after `DOWNSTREAM_IDLE_TIMEOUT_SECONDS` (60 s, the HTTP/1 keep-alive a client pool
holds; Envoy's default is 1 h). Neither timer touches a request that is parked or generating (the
headers are in, and a request is in progress). Under connection pressure the overload manager
shortens the idle timeout (`reduce_timeouts`, HTTP_DOWNSTREAM_CONNECTION_IDLE, scaled from 50% to
90% of the connection cap down to `MIN_DOWNSTREAM_IDLE_TIMEOUT_SECONDS`), so idle keep-alive
connections give their slots to new clients first. The stream idle timer is deliberately not
scaled: it is what a parked request waits under. Measured (default 512 MiB, cap 166, `python -m
pytest tests/integration/test_slow_clients.py`): 400 slow-header connections, 166 accepted and
234 refused at once; the 166 are answered 408 after 10 s, and a new client is served then; before
these timeouts the 166 were held for as long as they trickled and every new client was refused.

Envoy's memory is bounded against its container's limit (`overload_manager`): every downstream
connection may hold up to two body-cap buffers (its read buffer and the request body buffered
for the service, each up to `per_connection_buffer_limit_bytes`), so a global cap on downstream
connections is sized as (heap cap - a base reserve for Envoy itself) / (2 x body cap), and the
heap cap is 90% of the memory limit (the rest is stacks and the binary). Past the cap Envoy
refuses new connections (`global_downstream_max_connections`); at 95% of the heap cap it
returns freed memory to the system (`shrink_heap`), at 98% it answers new requests 503 (
`stop_accepting_requests`) instead of being OOM-killed with every stream it holds.

This module is the only place the Envoy bootstrap is written: `extproc envoy-config` prints it
(envoy/envoy.yaml is its output for the default settings), the local stack
(devstack/) builds it with options, and the Helm chart's Envoy pods get it from an
init container that runs `extproc envoy-config` with the service's own environment. What only a
deployment knows is an option here: the listen, admin and health addresses, where the service
is, the first-token allowance, Envoy's memory limit, and whether the ext_proc filter is there.

Every config is checked against Envoy's own API types when it is built (`check_envoy_config`,
with envoy-data-plane's messages): a misspelled field, an unknown enum value, a malformed
duration or an unregistered `@type` fails here, naming the field, not when Envoy starts.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Any

import yaml

from .config import EngineConfig, Settings
from .contract import (
    DECLARED_BODY_REGEX,
    ENDPOINT_METADATA,
    ESCAPED_SEPARATOR_REGEX,
    MAX_EXT_PROC_MESSAGE_TIMEOUT_SECONDS,
    MAX_PARK_SECONDS,
    OUTCOME_HEADER,
    PARK_TIMEOUT_MARGIN_SECONDS,
    READ_REQUEST_HEADERS,
    REQUEST_ID_ATTRIBUTE,
    ROUTE_METADATA_KEY,
    ROUTE_METADATA_NAMESPACE,
    SERVICE_REPLY_DETAILS_PREFIX,
    SERVICE_STALL_SECONDS,
    STRIPPED_HEADER_PREFIX,
    UNGATED_CLUSTER_SUFFIX,
)
from .endpoints import endpoint_for, path_pattern
from .outcomes import ENVOY_REJECTIONS, REJECTIONS, Outcome, Rejection

DEFAULT_TTFT_ALLOWANCE_SECONDS = 600
#: The inference listener's HCM stat prefix (the chart's preStop reads http.<prefix>.downstream_rq_active).
INFERENCE_STAT_PREFIX = "inference"
#: Admin paths the optional health listener forwards: what the kubelet's probes and Prometheus need.
HEALTH_PATHS = ("/ready", "/stats/prometheus")
#: Envoy closes an idle connection to an engine after this long: before vLLM does (its API server
#: closes idle keep-alive connections after 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so a request is
#: never written onto a connection the engine is closing (2 s to spare for a busy machine; on vLLM
#: 0.32 without it, two parked requests released together after an idle spell got 503
#: `connection_termination`). A close that still races a request is retried once
#: (`reset-before-request`: the engine never saw it).
ENGINE_IDLE_TIMEOUT_SECONDS = 3
#: Envoy's container memory limit when none is given (the chart's default envoy.resources.limits.memory).
DEFAULT_ENVOY_MEMORY_LIMIT_BYTES = 512 * 1024 * 1024
#: The overload manager's heap cap, in percent of the memory limit.
HEAP_PERCENT_OF_LIMIT = 90
#: Heap kept for Envoy itself (measured 64 MiB idle, 82 MiB with 256 connections), not for buffers.
ENVOY_BASE_HEAP_BYTES = 128 * 1024 * 1024
#: Body-cap buffers one downstream connection may hold: its read buffer and the buffered request body.
BUFFERS_PER_CONNECTION = 2
#: A client's whole request header must arrive within this (HCM request_headers_timeout).
REQUEST_HEADERS_TIMEOUT_SECONDS = 10
#: A downstream connection with no request in progress is closed after this (HCM idle_timeout).
DOWNSTREAM_IDLE_TIMEOUT_SECONDS = 60
#: The idle timeout under connection pressure (the overload manager's reduce_timeouts, saturated).
MIN_DOWNSTREAM_IDLE_TIMEOUT_SECONDS = 1
#: Connection pressure (fraction of the cap) where the idle timeout starts shrinking, and where it is smallest.
IDLE_SCALING_FROM, IDLE_SCALING_TO = 0.5, 0.9
#: The HTTP/2 keepalive on the service's connection: a ping every interval, the peer dead if unanswered.
SERVICE_KEEPALIVE_INTERVAL_SECONDS = 30
#: Below this many connections the memory limit is too small for the body cap.
MIN_DOWNSTREAM_CONNECTIONS = 16
_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                   "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _seconds(value: float) -> str:
    return f"{math.ceil(value)}s"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class ExtprocTls:
    """Envoy's side of mTLS to the service: the certificate and key it presents, the CA it verifies
    the service's certificate with, and the name that certificate must carry (None: the host
    Envoy dials). File paths as Envoy's container sees them."""

    cert: str
    key: str
    ca: str
    server_name: str | None = None


def _extproc_transport_socket(tls: ExtprocTls, host: str) -> dict[str, Any]:
    """The extproc cluster's UpstreamTlsContext: client certificate, ALPN h2 (gRPC), and the
    service's certificate checked against the CA and its subject alternative name."""
    name = tls.server_name or host
    context: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {
            "alpn_protocols": ["h2"],
            "tls_certificates": [{"certificate_chain": {"filename": tls.cert},
                                  "private_key": {"filename": tls.key}}],
            "validation_context": {
                "trusted_ca": {"filename": tls.ca},
                "match_typed_subject_alt_names": [
                    {"san_type": "IP_ADDRESS" if _is_ip(name) else "DNS", "matcher": {"exact": name}}],
            },
        },
    }
    if not _is_ip(name):
        context["sni"] = name
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def _cluster(name: str, host: str, port: int, *, http2: bool, max_requests: int, connect_timeout: str,
             max_connections: int | None = None, idle_timeout: float | None = None) -> dict[str, Any]:
    """A cluster of one endpoint: STATIC for an IP address (v4 or v6), else STRICT_DNS. `idle_timeout`:
    Envoy closes a pooled HTTP/1.1 connection idle that long (an engine's cluster: before the engine does)."""
    connections = max_connections or max_requests
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if _is_ip(host) else "STRICT_DNS",
        "connect_timeout": connect_timeout,
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    "max_connections": connections,
                    "max_pending_requests": connections,
                    "max_requests": max_requests,
                    "max_retries": 3,
                }
            ]
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(host, port)}}]}],
        },
    }
    if not _is_ip(host):
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "max_concurrent_streams": max_requests,
                        # A dead peer (node gone without a FIN) is noticed within ~50 s instead of
                        # when TCP gives up (the service allows pings every 10 s); a live one that
                        # stalls for less than SERVICE_STALL_SECONDS is not declared dead.
                        "connection_keepalive": {"interval": _seconds(SERVICE_KEEPALIVE_INTERVAL_SECONDS),
                                                 "timeout": _seconds(SERVICE_STALL_SECONDS)},
                    }
                },
            }
        }
    elif idle_timeout is not None:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "common_http_protocol_options": {"idle_timeout": _seconds(idle_timeout)},
                "explicit_http_config": {"http_protocol_options": {}},
            }
        }
    return cluster


def memory_bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity in bytes: an integer with an optional unit (Ki, Mi, Gi, Ti, k, M, G, T)."""
    match = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(quantity).strip())
    if not match:
        raise ValueError(f"memory quantity {quantity!r}: "
                         "want an integer with an optional unit Ki, Mi, Gi, Ti, k, M, G or T")
    return int(match.group(1)) * _QUANTITY_UNITS[match.group(2) or ""]


def heap_cap_bytes(memory_limit_bytes: int) -> int:
    """The overload manager's heap cap for a container memory limit."""
    return memory_limit_bytes * HEAP_PERCENT_OF_LIMIT // 100


def max_downstream_connections(memory_limit_bytes: int, buffer_bytes: int) -> int:
    """Downstream connections one Envoy may hold, each with up to two body-cap buffers, within its heap cap."""
    per_connection = BUFFERS_PER_CONNECTION * buffer_bytes
    connections = (heap_cap_bytes(memory_limit_bytes) - ENVOY_BASE_HEAP_BYTES) // per_connection
    if connections < MIN_DOWNSTREAM_CONNECTIONS:
        raise ValueError(
            f"Envoy's memory limit ({memory_limit_bytes} bytes) leaves room for {max(connections, 0)} connections of "
            f"{BUFFERS_PER_CONNECTION} x {buffer_bytes}-byte buffers (at least {MIN_DOWNSTREAM_CONNECTIONS} needed): "
            "raise the memory limit, lower the body cap, or set the connection cap explicitly")
    return connections


_CONNECTIONS_MONITOR = "envoy.resource_monitors.global_downstream_max_connections"


def _overload_manager(memory_limit_bytes: int, connections: int) -> dict[str, Any]:
    heap = "envoy.resource_monitors.fixed_heap"
    return {
        "refresh_interval": "0.25s",
        "resource_monitors": [
            {"name": heap, "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                "max_heap_size_bytes": heap_cap_bytes(memory_limit_bytes)}},
            {"name": _CONNECTIONS_MONITOR, "typed_config": {
                "@type": ("type.googleapis.com/"
                          "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"),
                "max_active_downstream_connections": connections}},
        ],
        "actions": [
            {"name": "envoy.overload_actions.shrink_heap", "triggers": [{"name": heap, "threshold": {"value": 0.95}}]},
            {"name": "envoy.overload_actions.stop_accepting_requests",
             "triggers": [{"name": heap, "threshold": {"value": 0.98}}]},
            # Idle keep-alive connections give their slots up first when the cap is near.
            {"name": "envoy.overload_actions.reduce_timeouts",
             "triggers": [{"name": _CONNECTIONS_MONITOR, "scaled": {
                 "scaling_threshold": IDLE_SCALING_FROM, "saturation_threshold": IDLE_SCALING_TO}}],
             "typed_config": {
                 "@type": "type.googleapis.com/envoy.config.overload.v3.ScaleTimersOverloadActionConfig",
                 "timer_scale_factors": [{"timer": "HTTP_DOWNSTREAM_CONNECTION_IDLE",
                                          "min_timeout": _seconds(MIN_DOWNSTREAM_IDLE_TIMEOUT_SECONDS)}]}},
        ],
    }


def engine_bound(settings: Settings, engine: EngineConfig) -> int:
    """Concurrent requests one Envoy may have on an engine's gated cluster: what the gate admits."""
    return engine.limits.max_inflight + settings.effective_engine_queue_slots


def _route(match: dict[str, Any], cluster: str, engine: EngineConfig | None = None) -> dict[str, Any]:
    """A route to `cluster`; with `engine`, only for requests the service admitted to it."""
    if engine is not None:
        match = {**match, "dynamic_metadata": [{
            "filter": ROUTE_METADATA_NAMESPACE, "path": [{"key": ROUTE_METADATA_KEY}],
            "value": {"string_match": {"exact": engine.name}}}]}
    return {"match": match, "route": {"cluster": cluster, "timeout": "0s"}}


_EXT_PROC = "envoy.filters.http.ext_proc"
_BUFFER = "envoy.filters.http.buffer"
#: Request processing with the headers phase skipped: the body, whole, is the only message.
_ONE_MESSAGE_MODE = {
    "request_header_mode": "SKIP",
    "response_header_mode": "SKIP",
    "request_body_mode": "BUFFERED",
    "response_body_mode": "NONE",
    "request_trailer_mode": "SKIP",
    "response_trailer_mode": "SKIP",
}


def _one_message_route(settings: Settings, path: str, action: dict[str, Any]) -> dict[str, Any]:
    """A POST to gated `path` declaring a body: ext_proc gets the body alone (the path in the stream's
    metadata), and the buffer filter holds the request until the service has answered. `action`:
    the one engine's cluster, or (several engines) the answer when the service named no engine,
    since its answer makes Envoy choose the route again, among the engines' routes."""
    match = {"path": path, "headers": [
        {"name": ":method", "string_match": {"exact": "POST"}},
        {"name": "content-length", "string_match": {"safe_regex": {"regex": DECLARED_BODY_REGEX}}},
    ]}
    route: dict[str, Any] = {"match": match, **action}
    route["typed_per_filter_config"] = {
        _EXT_PROC: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"processing_mode": _ONE_MESSAGE_MODE,
                          "grpc_initial_metadata": [{"key": ENDPOINT_METADATA, "value": path}]},
        },
        _BUFFER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute",
            "buffer": {"max_request_bytes": settings.max_body_bytes},
        },
    }
    return route


def _pass_matches(settings: Settings) -> list[dict[str, Any]]:
    """The pass list's paths (any method), as route matches."""
    return [{"safe_regex": {"regex": path_pattern(p)}} if "*" in p else {"path": p} for p in settings.pass_paths]


_ANY_POST = {"prefix": "/", "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]}


def _routes(settings: Settings, bound: bool, one_message: bool) -> list[dict[str, Any]]:
    """Gated paths, and every POST off the pass list, to each engine's bounded cluster (by the
    service's metadata with several engines, 503 when it named none; the first engine's with one),
    the one-message routes first when `one_message`; the pass list and every other request to the
    first engine's ungated cluster."""
    engines, first = settings.engines, settings.engines[0]
    if not settings.gating or not bound:
        routes = [_route({"prefix": "/"}, e.cluster, e) for e in engines] if len(engines) > 1 else []
        return routes + [_route({"prefix": "/"}, first.cluster)]
    ungated = first.cluster + UNGATED_CLUSTER_SUFFIX
    # A POST to a path nobody listed is gated (the service gates it too): a route a new engine
    # release adds does engine work until someone says otherwise, and must not pass unbounded
    # (as the catch-all would) while the service is down and Envoy fails open.
    gated: list[dict[str, Any]] = [{"path": path} for path in settings.gated_paths]
    gated.append({"safe_regex": {"regex": ESCAPED_SEPARATOR_REGEX}})
    gated.append(_ANY_POST)
    passed = [_route(m, ungated) for m in _pass_matches(settings)]
    one_message_paths = [p for p in settings.gated_paths if one_message and not endpoint_for(p).multipart]
    if len(engines) > 1:
        # No engine named: the service did not answer (down, or late and Envoy failed open). Only
        # it knows which engine serves the model, so Envoy answers 503 rather than guess
        # (`engine_not_selected`, a local reply with details `direct_response`). A one-message
        # route answers so too: it is the route until the service's answer names an engine, after
        # which Envoy chooses again and finds that engine's route, listed first.
        unnamed = {"direct_response": {"status": ENVOY_REJECTIONS[Outcome.ENGINE_NOT_SELECTED].status}}
        routes = [_route(m, e.cluster, e) for e in engines for m in gated]
        routes += [_one_message_route(settings, path, unnamed) for path in one_message_paths]
        routes += passed
        routes += [{"match": m, **unnamed} for m in gated]
    else:
        routes = [_one_message_route(settings, path, {"route": {"cluster": first.cluster, "timeout": "0s"}})
                  for path in one_message_paths]
        routes += passed
        routes += [_route(m, first.cluster) for m in gated]
    routes.append(_route({"prefix": "/"}, ungated))
    return routes


_ROUTER: dict[str, Any] = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}
_ADMIN_CLUSTER = "envoy_admin"
_HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


_CEL_FILTER = "envoy.access_loggers.extension_filters.cel"
_CEL_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"


@dataclass(frozen=True)
class LocalReply:
    """One kind of answer Envoy makes itself, and how it is shown to the client."""

    outcome: Outcome
    match: dict[str, Any]  # an access log filter
    message: str  # may use Envoy substitution commands (%RESPONSE_CODE_DETAILS%, %LOCAL_REPLY_BODY%)
    keep_status: bool = False  # keep the status Envoy chose (the catch-all)


def _flags(*flags: str) -> dict[str, Any]:
    return {"response_flag_filter": {"flags": list(flags)}}


def _status(code: int) -> dict[str, Any]:
    return {"status_code_filter": {"comparison": {"op": "EQ", "value": {
        "default_value": code, "runtime_key": f"admission.local_reply.status_{code}"}}}}


def _details_prefix(prefix: str) -> dict[str, Any]:
    return {"extension_filter": {"name": _CEL_FILTER, "typed_config": {
        "@type": _CEL_TYPE, "expression": f"response.code_details.startsWith('{prefix}')"}}}


def _details(details: str) -> dict[str, Any]:
    return {"extension_filter": {"name": _CEL_FILTER, "typed_config": {
        "@type": _CEL_TYPE, "expression": f"response.code_details == '{details}'"}}}


#: Every local reply the generated config can produce, first match wins (after the service's own
#: answers). Verified on Envoy 1.40: connect refused = UF, no endpoint = UH, reset before the
#: response = UC/UR/LR, stream idle timeout = SI (504), a failed ext_proc call with
#: failure_mode_allow false = details `ext_proc_error_...` (no flag), HTTP/1 codec errors = 400
#: and 431 (no flag). The catch-all keeps whatever status Envoy chose.
LOCAL_REPLIES: tuple[LocalReply, ...] = (
    LocalReply(Outcome.ENGINE_OVERLOADED, _flags("UO"),
               "the engine is at capacity and the gateway holds no more requests for it; retry later"),
    LocalReply(Outcome.ENGINE_UNAVAILABLE, _flags("UF", "UH", "UC", "UR", "LR", "URX", "UMSDR"),
               "the engine could not be reached or closed the connection before answering; retry later "
               "(%RESPONSE_CODE_DETAILS%)"),
    LocalReply(Outcome.ENGINE_TIMEOUT, _flags("UT", "SI"),
               "no answer from the engine within the gateway's timeout (%RESPONSE_CODE_DETAILS%)"),
    LocalReply(Outcome.NO_ROUTE, _flags("NR", "NC"), "no route for this request (%RESPONSE_CODE_DETAILS%)"),
    LocalReply(Outcome.ADMISSION_UNAVAILABLE, _details_prefix("ext_proc_"),
               "the admission service did not answer and the gateway fails closed; retry later "
               "(%RESPONSE_CODE_DETAILS%)"),
    LocalReply(Outcome.ENGINE_NOT_SELECTED, _details("direct_response"),
               "the admission service did not say which engine serves this model (it is down or did not "
               "answer in time) and the gateway does not guess among several engines; retry later"),
    LocalReply(Outcome.BODY_TOO_LARGE, _status(413),
               "request body exceeds the limit of {limit} bytes (%RESPONSE_CODE_DETAILS%)"),
    LocalReply(Outcome.HEADERS_TOO_LARGE, _status(431),
               "request headers exceed the gateway's limit (%RESPONSE_CODE_DETAILS%)"),
    LocalReply(Outcome.BAD_REQUEST, _status(400), "malformed HTTP request (%RESPONSE_CODE_DETAILS%)"),
    LocalReply(Outcome.GATEWAY_ERROR, {"status_code_filter": {"comparison": {"op": "GE", "value": {
        "default_value": 0, "runtime_key": "admission.local_reply.any"}}}},
               "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)", keep_status=True),
)


def _rejection(outcome: Outcome) -> Rejection:
    return ENVOY_REJECTIONS.get(outcome) or REJECTIONS[outcome]


def _local_reply_config(settings: Settings) -> dict[str, Any]:
    """Envoy's own answers in the service's shape: an OpenAI-style JSON error body and
    `x-admission-outcome`, plus `Retry-After` where the client should retry (local reply config)."""
    mappers: list[dict[str, Any]] = [{"filter": _details_prefix(SERVICE_REPLY_DETAILS_PREFIX)}]
    for reply in LOCAL_REPLIES:
        row = _rejection(reply.outcome)
        headers = [(OUTCOME_HEADER, reply.outcome.value)]
        if row.retry_after:
            headers.insert(0, ("retry-after", str(settings.retry_after_seconds)))
        mapper: dict[str, Any] = {"filter": reply.match}
        if not reply.keep_status:
            mapper["status_code"] = row.status
        mapper["headers_to_add"] = [
            {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for key, value in headers
        ]
        mapper["body_format_override"] = {
            "json_format": {"error": {"message": reply.message.replace("{limit}", str(settings.max_body_bytes)),
                                      "type": row.error_type, "code": reply.outcome.value}},
            "content_type": "application/json",
        }
        mappers.append(mapper)
    return {"mappers": mappers}


def build_envoy_config(
    settings: Settings,
    *,
    listen_host: str = "0.0.0.0",
    listen_port: int = 8080,
    admin_host: str = "127.0.0.1",
    admin_port: int = 9901,
    extproc_host: str | None = None,
    extproc_port: int | None = None,
    failure_mode: str = "open",
    stream_idle_timeout: float | None = None,
    bound_engines: bool = True,
    memory_limit_bytes: int | None = None,
    downstream_connections: int | None = None,
    first_token_allowance: float = DEFAULT_TTFT_ALLOWANCE_SECONDS,
    health_host: str = "0.0.0.0",
    health_port: int | None = None,
    ext_proc: bool = True,
    extproc_tls: ExtprocTls | None = None,
) -> dict[str, Any]:
    """The Envoy bootstrap as a dict, checked against Envoy's API types; `render_envoy_config`
    turns it into YAML.

    `stream_idle_timeout` defaults to the park cap + `first_token_allowance` (the worst time to
    first token after a park).

    `health_port`: one more listener, `envoy_health`, forwarding only /ready and
    /stats/prometheus to the admin interface (which stays where `admin_host` says, loopback by
    default: the admin API can drain or stop Envoy). It ignores the global connection cap, so
    probes and scrapes are answered while the inference listener is full. The chart's pods use it.

    `ext_proc=False`: no ext_proc filter and no cluster for the service; Envoy forwards straight
    to the engine (the local stack's and the benchmarks' baseline).

    `memory_limit_bytes` is Envoy's container memory limit: it sizes the overload manager's heap
    cap and, unless `downstream_connections` is given, the global downstream connection cap.
    None (the default here): no overload manager, for an Envoy without a memory limit (the local
    stack of devstack/, benchmarks holding thousands of connections on purpose).
    `render_envoy_config`, the config file for a deployment, defaults to the chart's 512 MiB.

    `extproc_tls`: mTLS to the service (`ExtprocTls`). None: the service's own certificate, key and
    client CA when it serves mTLS (`settings.tls`), else plaintext.

    `bound_engines=False` leaves out the engine clusters' bound (and the ungated cluster): only
    for reproducing the reference gate, which had none (`bench.admission --mode reference`).
    """
    if failure_mode not in ("open", "closed"):
        raise ValueError(f"failure_mode={failure_mode!r}: must be open or closed")
    park = settings.max_park_seconds
    idle = stream_idle_timeout if stream_idle_timeout is not None else park + first_token_allowance
    if idle <= park + PARK_TIMEOUT_MARGIN_SECONDS:
        raise ValueError(
            f"stream idle timeout {idle:g}s must exceed the park cap plus margin "
            f"({park:g}s + {PARK_TIMEOUT_MARGIN_SECONDS:g}s), or parked requests are cut off by Envoy"
        )
    longest_park = MAX_PARK_SECONDS  # load_settings refuses more; Settings built by hand may not
    if park > longest_park:
        raise ValueError(
            f"park cap {park:g}s: Envoy's ext_proc max_message_timeout (park cap + "
            f"{2 * PARK_TIMEOUT_MARGIN_SECONDS:g}s) may be at most {MAX_EXT_PROC_MESSAGE_TIMEOUT_SECONDS}s, "
            f"so no engine may park longer than {longest_park:g}s"
        )
    extproc_host = extproc_host or ("127.0.0.1" if settings.grpc_host in ("0.0.0.0", "::", "") else settings.grpc_host)
    extproc_port = extproc_port or settings.grpc_port

    engines = settings.engines
    bound_engines = bound_engines and settings.gating
    one_message = ext_proc and bound_engines
    routes = _routes(settings, bound_engines, one_message)

    ext_proc_filter: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "extproc"}},
        "failure_mode_allow": failure_mode == "open",
        "message_timeout": _seconds(SERVICE_STALL_SECONDS),
        "max_message_timeout": _seconds(max(park + PARK_TIMEOUT_MARGIN_SECONDS, SERVICE_STALL_SECONDS)
                                        + PARK_TIMEOUT_MARGIN_SECONDS),
        "allow_mode_override": True,
        # Only the headers the service reads: the others cost a decode on both sides of every stream.
        "forward_rules": {"allowed_headers": {"patterns": [{"exact": h} for h in READ_REQUEST_HEADERS]}},
        "processing_mode": {
            "request_header_mode": "SEND",
            "response_header_mode": "SKIP",
            "request_body_mode": "BUFFERED_PARTIAL",
            "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        },
    }
    if failure_mode == "closed":
        ext_proc_filter["status_on_error"] = {"code": 503}
    if one_message:
        ext_proc_filter["request_attributes"] = [REQUEST_ID_ATTRIBUTE]  # sent with the first message, headers or body
    if ext_proc and len(engines) > 1:  # the service names the engine there; nothing else may be written
        ext_proc_filter["metadata_options"] = {"receiving_namespaces": {"untyped": [ROUTE_METADATA_NAMESPACE]}}
    filters: list[dict[str, Any]] = []
    if ext_proc:
        filters.append({"name": _EXT_PROC, "typed_config": ext_proc_filter})
    if one_message:  # only where a one-message route enables it
        filters.append({"name": _BUFFER, "disabled": True, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": settings.max_body_bytes}})

    hcm: dict[str, Any] = {
        "@type": _HCM_TYPE,
        "stat_prefix": INFERENCE_STAT_PREFIX,
        "codec_type": "AUTO",
        "normalize_path": True,
        "merge_slashes": True,
        "stream_idle_timeout": _seconds(idle),
        "request_headers_timeout": _seconds(REQUEST_HEADERS_TIMEOUT_SECONDS),
        "common_http_protocol_options": {"idle_timeout": _seconds(DOWNSTREAM_IDLE_TIMEOUT_SECONDS)},
        "generate_request_id": True,
        # Before routing and before any filter: a client must never pose as the service's answer
        # or pass the engine a header the service sets, and this holds even when the service is
        # down and Envoy fails open.
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    "@type": ("type.googleapis.com/"
                              "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"),
                    "mutations": [{"remove_on_match": {"key_matcher": {"prefix": STRIPPED_HEADER_PREFIX}}}],
                },
            }
        ],
        "local_reply_config": _local_reply_config(settings),
        "route_config": {
            "name": "engines",
            "virtual_hosts": [{"name": "engines", "domains": ["*"], "routes": routes,
                               # an engine connection closed under a request not yet written: send it
                               # once more on a new connection (see ENGINE_IDLE_TIMEOUT_SECONDS)
                               "retry_policy": {"retry_on": "reset-before-request", "num_retries": 1}}],
        },
        "http_filters": [*filters, _ROUTER],
    }
    clusters = []
    if extproc_tls is None and settings.tls is not None:
        extproc_tls = ExtprocTls(settings.tls.cert, settings.tls.key, settings.tls.client_ca)
    if ext_proc:
        extproc_cluster = _cluster("extproc", extproc_host, extproc_port, http2=True,
                                   max_requests=settings.max_streams, connect_timeout="1s")
        if extproc_tls is not None:
            extproc_cluster["transport_socket"] = _extproc_transport_socket(extproc_tls, extproc_host)
        clusters.append(extproc_cluster)
    for e in engines:
        bound = engine_bound(settings, e) if bound_engines else settings.max_streams
        clusters.append(_cluster(e.cluster, e.upstream_host, e.upstream_port, http2=False, max_requests=bound,
                                 idle_timeout=ENGINE_IDLE_TIMEOUT_SECONDS,
                                 max_connections=settings.max_streams, connect_timeout="5s"))
    if bound_engines:
        first = engines[0]
        clusters.append(_cluster(first.cluster + UNGATED_CLUSTER_SUFFIX, first.upstream_host, first.upstream_port,
                                 idle_timeout=ENGINE_IDLE_TIMEOUT_SECONDS,
                                 http2=False, max_requests=settings.max_streams, connect_timeout="5s"))
    listeners: list[dict[str, Any]] = [
        {
            "name": "inference",
            "address": _addr(listen_host, listen_port),
            "per_connection_buffer_limit_bytes": settings.max_body_bytes,
            "filter_chains": [
                {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
            ],
        }
    ]
    if health_port is not None:
        listeners.append(_health_listener(health_host, health_port))
        reach_admin = "127.0.0.1" if admin_host in ("0.0.0.0", "::", "") else admin_host
        clusters.append(_cluster(_ADMIN_CLUSTER, reach_admin, admin_port, http2=False, max_requests=64,
                                 connect_timeout="1s"))
    # The admin interface (loopback: stats, the preStop drain) neither counts toward the global
    # connection cap nor is refused by it.
    config: dict[str, Any] = {"admin": {"address": _addr(admin_host, admin_port), "ignore_global_conn_limit": True}}
    if memory_limit_bytes is not None:
        connections = downstream_connections or max_downstream_connections(memory_limit_bytes, settings.max_body_bytes)
        config["overload_manager"] = _overload_manager(memory_limit_bytes, connections)
    config["static_resources"] = {"listeners": listeners, "clusters": clusters}
    check_envoy_config(config)
    return config


def _health_listener(host: str, port: int) -> dict[str, Any]:
    routes = [{"match": {"path": path}, "route": {"cluster": _ADMIN_CLUSTER}} for path in HEALTH_PATHS]
    return {
        "name": "envoy_health",
        "address": _addr(host, port),
        # Probes and scrapes are answered even when the inference listener is at the connection cap.
        "ignore_global_conn_limit": True,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": _HCM_TYPE,
            "stat_prefix": "envoy_health",
            "request_headers_timeout": _seconds(REQUEST_HEADERS_TIMEOUT_SECONDS),
            "common_http_protocol_options": {"idle_timeout": _seconds(DOWNSTREAM_IDLE_TIMEOUT_SECONDS)},
            "route_config": {"name": "envoy_health", "virtual_hosts": [
                {"name": "envoy_health", "domains": ["*"], "routes": routes}]},
            "http_filters": [_ROUTER],
        }}]}],
    }


#: The modules of every `@type` the config uses: importing one registers its type URL, so that
#: `check_envoy_config` can parse the typed_config that names it (envoy-data-plane, Envoy's API).
_TYPED_CONFIG_MODULES = (
    "envoy.config.overload.v3",
    "envoy.extensions.filters.network.http_connection_manager.v3",
    "envoy.extensions.filters.http.ext_proc.v3",
    "envoy.extensions.filters.http.router.v3",
    "envoy.extensions.filters.http.buffer.v3",
    "envoy.extensions.http.early_header_mutation.header_mutation.v3",
    "envoy.extensions.access_loggers.filters.cel.v3",
    "envoy.extensions.resource_monitors.fixed_heap.v3",
    "envoy.extensions.resource_monitors.downstream_connections.v3",
    "envoy.extensions.upstreams.http.v3",
    "envoy.extensions.transport_sockets.tls.v3",
)


def check_envoy_config(config: dict[str, Any]) -> None:
    """Parse the bootstrap into Envoy's own `Bootstrap` message (envoy-data-plane's dataclasses of
    Envoy's data-plane API): an unknown field, enum value or `@type`, or a malformed duration
    raises ValueError naming it. Envoy's field constraints (a port's range, a non-empty name) are
    left to Envoy: the tests run `envoy --mode validate` on every config they generate."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        # envoy-data-plane 2.2.0's classes use a Pydantic API deprecated since Pydantic 2.12
        # (a classmethod `model_validator`); importing them warns, using them does not.
        warnings.simplefilter("ignore", DeprecationWarning)
        from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

        for module in _TYPED_CONFIG_MODULES:
            importlib.import_module(f"envoy_data_plane.{module}")
    try:
        Bootstrap.from_dict(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the generated Envoy config does not fit Envoy's API: {exc}") from None


def render_envoy_config(settings: Settings, **kwargs: Any) -> str:
    """The config file: `build_envoy_config` as YAML, for an Envoy container with the chart's
    default memory limit (DEFAULT_ENVOY_MEMORY_LIMIT_BYTES) unless `memory_limit_bytes` says otherwise."""
    kwargs.setdefault("memory_limit_bytes", DEFAULT_ENVOY_MEMORY_LIMIT_BYTES)
    header = (
        "# Generated by `extproc envoy-config` from the service's settings; do not edit by hand.\n"
        "# Regenerate after changing MAX_BODY_BYTES, ADMISSION_MAX_PARK_SECONDS or the engines.\n"
    )
    return header + yaml.safe_dump(build_envoy_config(settings, **kwargs), sort_keys=False)
