"""The contract between the generated Envoy config and the service, in one place.

Both `envoyconf` (which writes the Envoy config) and the servicer (which answers Envoy's ext_proc
stream) import these names; a value changed here changes both sides together.
"""

from __future__ import annotations

#: The engine the service chose for an admitted request, as a request header the engine sees
#: (where Envoy still has the headers: a one-message route has passed them on already).
ROUTE_HEADER = "x-admission-engine"
#: With several engines Envoy routes on the engine the service chose, written by the service into
#: this dynamic metadata (namespace, key) of the request: something no client can set, and which,
#: unlike a header, a body answer can set when the headers phase was skipped.
ROUTE_METADATA_NAMESPACE = "llm_admission"
ROUTE_METADATA_KEY = "engine"
#: The outcome of every answer the gateway gives itself (`outcomes.Outcome` values).
OUTCOME_HEADER = "x-admission-outcome"
#: Request headers with this prefix are removed as the request enters Envoy (client-set ones), so
#: a client can neither pick an engine nor pose as the service's answer.
STRIPPED_HEADER_PREFIX = "x-admission-"
#: The service's own answers (ext_proc ImmediateResponse) carry the response code details
#: `admission_<outcome>`; the local reply config leaves them exactly as they are.
SERVICE_REPLY_DETAILS_PREFIX = "admission_"
#: Paths the engine's router could decode into a gated path (RE2, whole path, query removed).
ESCAPED_SEPARATOR_REGEX = ".*%(2[fF]|5[cC]).*"
#: The cluster for ungated paths of the first engine is its cluster name plus this suffix.
UNGATED_CLUSTER_SUFFIX = "_ungated"
#: Extra time Envoy waits beyond the park cap, so the 503 at the cap always beats Envoy's timeout.
PARK_TIMEOUT_MARGIN_SECONDS = 5.0
#: How long the service may stall (a GC pause, CPU starvation on a loaded node, a stopped process)
#: before Envoy gives up on it. Envoy 1.40's ext_proc has one failure path for "unreachable",
#: "timed out" and "stream reset" alike (`failure_mode_allow`), so every timeout that could declare
#: a live service dead is at least this long: the filter's `message_timeout`, the HTTP/2 keepalive
#: timeout on the service's connection, and the override a parked request gets. A stall shorter than
#: this holds requests and then they are decided; only a service that is down (connection refused or
#: reset, dead for longer than this) is failed open.
SERVICE_STALL_SECONDS = 15.0
#: Envoy's bound on ext_proc's max_message_timeout (a proto constraint: at most 1 h).
MAX_EXT_PROC_MESSAGE_TIMEOUT_SECONDS = 3600
#: The longest park cap: Envoy's max_message_timeout is the park cap plus two margins.
MAX_PARK_SECONDS = MAX_EXT_PROC_MESSAGE_TIMEOUT_SECONDS - 2 * PARK_TIMEOUT_MARGIN_SECONDS
#: The request headers the service reads (the path, method and body headers it classifies by, the
#: request id for its logs); Envoy's ext_proc `forward_rules` sends it only these.
READ_REQUEST_HEADERS = (":method", ":path", "content-length", "content-type", "x-request-id")
#: One-message routes: for a POST to a gated JSON path that declares a body
#: (`content-length` matching DECLARED_BODY_REGEX), Envoy skips the request headers phase and sends
#: the whole body as the stream's only message. The route names its gated path in this gRPC
#: metadata key, and the request id comes as this ext_proc request attribute.
ENDPOINT_METADATA = "x-admission-endpoint"
REQUEST_ID_ATTRIBUTE = "request.id"
#: The namespace of the attributes Envoy's ext_proc filter sends.
EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"
#: A declared body of at least one byte (RE2, the whole `content-length` value).
DECLARED_BODY_REGEX = "[1-9][0-9]*"
