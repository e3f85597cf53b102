"""Generate the Envoy config from the same settings the service runs with (one source of truth).

The timeouts follow from the park cap (DESIGN.md, Envoy 1.40 facts):
- route `timeout: 0s`: the route timeout also bounds the whole upstream response, and a
  generation can stream for many minutes;
- `stream_idle_timeout` fires while a request is parked and while a long prefill produces no
  bytes: it must exceed the park cap plus the worst time to first token (default cap + 600 s);
- ext_proc `message_timeout` bounds ordinary answers (the service answers in well under a
  millisecond); `max_message_timeout` must admit the one `override_message_timeout` the service
  sends when it parks a request (park cap + margin);
- the listener's `per_connection_buffer_limit_bytes` is the body cap: with body mode
  BUFFERED_PARTIAL a larger body reaches the service as a prefix with `end_of_stream=false`, and
  the service answers 413 itself (a JSON body, not Envoy's plain text);
- each parked request holds one gRPC stream and one upstream request slot on the ext_proc
  cluster: its circuit breakers are set to the service's stream limit, far above any queue bound.

Every request header starting with `x-admission-` is removed as the request enters Envoy (HCM
early header mutation, before routing): only the service sets `x-admission-engine`, so a client
cannot pick an engine, on gated paths, ungated paths, or while the service is down.

`failure_mode_allow` is the explicit choice for "the admission service is down": `open` (default)
forwards requests ungated, so an admission outage never becomes an inference outage; `closed`
answers 503 (`status_on_error`) instead.
"""

from __future__ import annotations

import ipaddress
import math
from typing import Any

import yaml

from .admission import PARK_TIMEOUT_MARGIN_SECONDS
from .config import EngineConfig, Settings
from .servicer import ROUTE_HEADER

DEFAULT_TTFT_ALLOWANCE_SECONDS = 600
#: Request headers with this prefix are removed as the request enters Envoy (client-set ones).
STRIPPED_HEADER_PREFIX = "x-admission-"


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


def _cluster(name: str, host: str, port: int, *, http2: bool, max_requests: int, connect_timeout: str) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if _is_ip(host) else "STRICT_DNS",
        "connect_timeout": connect_timeout,
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    "max_connections": max_requests,
                    "max_pending_requests": max_requests,
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
                        # A dead peer (node gone without a FIN) is noticed within ~35 s instead of
                        # when TCP gives up; the service allows pings every 10 s.
                        "connection_keepalive": {"interval": "30s", "timeout": "5s"},
                    }
                },
            }
        }
    return cluster


def _route(engine: EngineConfig, match_header: bool) -> dict[str, Any]:
    match: dict[str, Any] = {"prefix": "/"}
    if match_header:
        match["headers"] = [{"name": ROUTE_HEADER, "string_match": {"exact": engine.name}}]
    return {"match": match, "route": {"cluster": engine.cluster, "timeout": "0s"}}


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
) -> dict[str, Any]:
    """The Envoy bootstrap as a dict; `render_envoy_config` turns it into YAML."""
    if failure_mode not in ("open", "closed"):
        raise ValueError(f"failure_mode={failure_mode!r}: must be open or closed")
    park = settings.max_park_seconds
    idle = stream_idle_timeout if stream_idle_timeout is not None else park + DEFAULT_TTFT_ALLOWANCE_SECONDS
    if idle <= park + PARK_TIMEOUT_MARGIN_SECONDS:
        raise ValueError(
            f"stream idle timeout {idle:g}s must exceed the park cap plus margin "
            f"({park:g}s + {PARK_TIMEOUT_MARGIN_SECONDS:g}s), or parked requests are cut off by Envoy"
        )
    extproc_host = extproc_host or ("127.0.0.1" if settings.grpc_host in ("0.0.0.0", "::", "") else settings.grpc_host)
    extproc_port = extproc_port or settings.grpc_port

    engines = settings.engines
    multi = len(engines) > 1
    routes = [_route(e, match_header=True) for e in engines] if multi else []
    routes.append(_route(engines[0], match_header=False))  # ungated paths and the single-engine case

    ext_proc: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "extproc"}},
        "failure_mode_allow": failure_mode == "open",
        "message_timeout": "1s",
        "max_message_timeout": _seconds(park + 2 * PARK_TIMEOUT_MARGIN_SECONDS),
        "allow_mode_override": True,
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
        ext_proc["status_on_error"] = {"code": 503}

    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "codec_type": "AUTO",
        "normalize_path": True,
        "merge_slashes": True,
        "stream_idle_timeout": _seconds(idle),
        "generate_request_id": True,
        # Before routing and before any filter: a client must never choose the engine (the routes
        # match `x-admission-engine`) or pose as the service's answer, and this holds even when
        # the service is down and Envoy fails open.
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                    "mutations": [{"remove_on_match": {"key_matcher": {"prefix": STRIPPED_HEADER_PREFIX}}}],
                },
            }
        ],
        "route_config": {
            "name": "engines",
            "virtual_hosts": [{"name": "engines", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            },
        ],
    }
    clusters = [
        _cluster("extproc", extproc_host, extproc_port, http2=True, max_requests=settings.max_streams, connect_timeout="1s")
    ]
    clusters += [
        _cluster(e.cluster, e.upstream_host, e.upstream_port, http2=False, max_requests=settings.max_streams,
                 connect_timeout="5s")
        for e in engines
    ]
    return {
        "admin": {"address": _addr(admin_host, admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": _addr(listen_host, listen_port),
                    "per_connection_buffer_limit_bytes": settings.max_body_bytes,
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


def render_envoy_config(settings: Settings, **kwargs: Any) -> str:
    header = (
        "# Generated by `extproc envoy-config` from the service's settings; do not edit by hand.\n"
        "# Regenerate after changing MAX_BODY_BYTES, ADMISSION_MAX_PARK_SECONDS or the engines.\n"
    )
    return header + yaml.safe_dump(build_envoy_config(settings, **kwargs), sort_keys=False)
