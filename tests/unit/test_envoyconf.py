"""The generated Envoy config: valid for the real binary, timeouts consistent with the park cap."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.config import load_settings
from extproc.envoyconf import build_envoy_config, render_envoy_config

ROOT = Path(__file__).resolve().parents[2]
ENVOY = str(Path(sys.executable).parent / "envoy")
LOCAL_ENV = {"ADMISSION_OBSERVE_MODELS": "sim-model"}


def _validate(text: str, tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    result = subprocess.run([ENVOY, "--mode", "validate", "-c", str(path), "--log-level", "error"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _ext_proc(doc: dict) -> dict:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["http_filters"][0]["typed_config"]


def _hcm(doc: dict) -> dict:
    return doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def test_committed_local_config_passes_envoy_validate(tmp_path: Path) -> None:
    _validate((ROOT / "envoy" / "envoy.yaml").read_text(), tmp_path)


@pytest.mark.parametrize("park", ["5", "120", "900"])
def test_timeouts_follow_the_park_cap(park: str, tmp_path: Path) -> None:
    settings = load_settings({**LOCAL_ENV, "ADMISSION_MAX_PARK_SECONDS": park})
    doc = build_envoy_config(settings)
    ext = _ext_proc(doc)
    hcm = _hcm(doc)
    cap = float(park)
    assert float(ext["max_message_timeout"].rstrip("s")) > cap
    assert float(hcm["stream_idle_timeout"].rstrip("s")) > cap
    assert all(r["route"]["timeout"] == "0s" for r in hcm["route_config"]["virtual_hosts"][0]["routes"])
    assert "request_timeout" not in hcm
    _validate(yaml.safe_dump(doc), tmp_path)


def test_body_cap_is_the_listener_buffer_limit_and_bodies_reach_the_service_partially() -> None:
    doc = build_envoy_config(load_settings({**LOCAL_ENV, "MAX_BODY_BYTES": "2048"}))
    assert doc["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] == 2048
    assert _ext_proc(doc)["processing_mode"]["request_body_mode"] == "BUFFERED_PARTIAL"


def test_envoy_sends_the_service_only_the_request_headers_it_reads() -> None:
    from extproc.contract import READ_REQUEST_HEADERS
    from extproc.servicer import _READ_HEADERS

    rules = _ext_proc(build_envoy_config(load_settings(LOCAL_ENV)))["forward_rules"]
    assert rules == {"allowed_headers": {"patterns": [{"exact": h} for h in READ_REQUEST_HEADERS]}}
    assert _READ_HEADERS == set(READ_REQUEST_HEADERS)
    assert {":path", ":method", "content-length", "content-type", "x-request-id"} <= _READ_HEADERS


def _one_message_routes(doc: dict) -> list[dict]:
    routes = _hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]
    return [r for r in routes if "typed_per_filter_config" in r]


def test_with_one_engine_a_post_declaring_a_body_to_a_json_endpoint_is_one_message() -> None:
    from extproc.contract import ENDPOINT_METADATA

    settings = load_settings({**LOCAL_ENV, "MAX_BODY_BYTES": "4096"})
    doc = build_envoy_config(settings)
    routes = _hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]
    one = _one_message_routes(doc)
    json_paths = [p for p in settings.gated_paths if not p.startswith("/v1/audio/")]
    assert [r["match"]["path"] for r in one] == json_paths and routes[:len(one)] == one  # before the others
    for route in one:
        (method, length) = route["match"]["headers"]
        assert method == {"name": ":method", "string_match": {"exact": "POST"}}
        regex = length["string_match"]["safe_regex"]["regex"]
        assert [bool(re.fullmatch(regex, v)) for v in ("1", "65536", "0", "", "00", "-1", "1 ")] == [
            True, True, False, False, False, False, False]
        assert route["route"] == {"cluster": "engine_default", "timeout": "0s"}
        overrides = route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
        assert overrides["processing_mode"]["request_header_mode"] == "SKIP"
        assert overrides["processing_mode"]["request_body_mode"] == "BUFFERED"
        assert overrides["grpc_initial_metadata"] == [{"key": ENDPOINT_METADATA, "value": route["match"]["path"]}]
        buffer = route["typed_per_filter_config"]["envoy.filters.http.buffer"]
        assert buffer["buffer"] == {"max_request_bytes": 4096}
    # The buffer filter, off elsewhere, sits after ext_proc: it holds the headers until the body is answered.
    names = [f["name"] for f in _hcm(doc)["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.buffer", "envoy.filters.http.router"]
    assert _hcm(doc)["http_filters"][1]["disabled"] is True
    assert _ext_proc(doc)["request_attributes"] == ["request.id"]


def test_no_ext_proc_or_nothing_gated_keeps_two_messages() -> None:
    for doc in (build_envoy_config(load_settings(LOCAL_ENV), ext_proc=False),
                build_envoy_config(load_settings({"ADMISSION_OBSERVE_MODELS": ""}))):
        assert _one_message_routes(doc) == []
        assert "envoy.filters.http.buffer" not in [f["name"] for f in _hcm(doc)["http_filters"]]


def test_with_several_engines_a_one_message_route_answers_503_until_the_service_names_an_engine(
        tmp_path: Path) -> None:
    engines = tmp_path / "engines.yaml"
    engines.write_text("engines:\n  - {name: a, url: 'http://127.0.0.1:8000', models: [qwen]}\n"
                       "  - {name: b, url: 'http://127.0.0.1:8001', models: [llama]}\n")
    settings = load_settings({"EXTPROC_CONFIG": str(engines)})
    doc = build_envoy_config(settings)
    routes = _hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]
    one = _one_message_routes(doc)
    assert [r["match"]["path"] for r in one] == [p for p in settings.gated_paths if not p.startswith("/v1/audio/")]
    # Only the first choice: the service's answer makes Envoy choose again, and the engines'
    # routes come first; a route the service named no engine for answers engine_not_selected.
    first = routes.index(one[0])
    assert all("dynamic_metadata" in r["match"] for r in routes[:first])
    assert all(r["direct_response"] == {"status": 503} and "dynamic_metadata" not in r["match"] for r in one)
    assert _ext_proc(doc)["metadata_options"] == {"receiving_namespaces": {"untyped": ["llm_admission"]}}
    assert "envoy.filters.http.buffer" in [f["name"] for f in _hcm(doc)["http_filters"]]
    _validate(yaml.safe_dump(doc), tmp_path)


def test_envoys_own_413_names_the_limit() -> None:
    mappers = _hcm(build_envoy_config(load_settings({**LOCAL_ENV, "MAX_BODY_BYTES": "4096"})))["local_reply_config"]
    (too_large,) = [m for m in mappers["mappers"] if m.get("status_code") == 413]
    assert too_large["body_format_override"]["json_format"]["error"]["message"].startswith(
        "request body exceeds the limit of 4096 bytes")


def test_ext_proc_circuit_breakers_exceed_any_queue_bound() -> None:
    settings = load_settings({**LOCAL_ENV, "VLLM_MAX_QUEUE_DEPTH": "500"})
    (extproc,) = [c for c in build_envoy_config(settings)["static_resources"]["clusters"] if c["name"] == "extproc"]
    assert extproc["circuit_breakers"]["thresholds"][0]["max_requests"] > 500


def test_failure_mode_is_explicit(tmp_path: Path) -> None:
    settings = load_settings(LOCAL_ENV)
    assert _ext_proc(build_envoy_config(settings))["failure_mode_allow"] is True
    closed = build_envoy_config(settings, failure_mode="closed")
    assert _ext_proc(closed)["failure_mode_allow"] is False
    assert _ext_proc(closed)["status_on_error"] == {"code": 503}
    _validate(yaml.safe_dump(closed), tmp_path)


def test_stream_idle_timeout_below_the_park_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="must exceed the park cap"):
        build_envoy_config(load_settings(LOCAL_ENV), stream_idle_timeout=60)


def test_several_engines_get_a_cluster_each_and_routes_on_the_services_metadata(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"
    path.write_text(
        "engines:\n"
        "  - {name: big, url: 'http://vllm-big.llm.svc:8000', models: [qwen]}\n"
        "  - {name: small, url: 'http://127.0.0.1:8001', models: [llama]}\n"
    )
    settings = load_settings({"EXTPROC_CONFIG": str(path)})
    doc = build_envoy_config(settings)
    names = [c["name"] for c in doc["static_resources"]["clusters"]]
    assert names == ["extproc", "engine_big", "engine_small", "engine_big_ungated"]
    routes = _hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]
    picked = [(r["match"].get("dynamic_metadata", [{}])[0].get("value", {}).get("string_match", {}).get("exact"),
               r["route"]["cluster"] if "route" in r else r["direct_response"])
              for r in routes]
    gated = len(settings.gated_paths) + 2  # each gated path, any path with an escaped separator, any other POST
    one_message = len(_one_message_routes(doc))  # a POST declaring a body to a JSON endpoint
    passed = len(settings.pass_paths)
    # A gated path the service named no engine for (it did not answer) is answered 503: no guessing.
    assert picked == ([("big", "engine_big")] * gated + [("small", "engine_small")] * gated
                      + [(None, {"status": 503})] * one_message + [(None, "engine_big_ungated")] * passed
                      + [(None, {"status": 503})] * gated + [(None, "engine_big_ungated")])
    for route in routes[:2 * gated]:  # the service's metadata, written where only ext_proc may write
        (matcher,) = route["match"]["dynamic_metadata"]
        assert (matcher["filter"], matcher["path"]) == ("llm_admission", [{"key": "engine"}])
        assert route["match"].get("headers", [{"name": ":method"}])[0]["name"] == ":method"
    _validate(yaml.safe_dump(doc), tmp_path)


def _thresholds(doc: dict, cluster: str) -> dict:
    (found,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == cluster]
    (thresholds,) = found["circuit_breakers"]["thresholds"]
    return thresholds


def test_the_engine_cluster_admits_no_more_concurrent_requests_than_the_gate() -> None:
    settings = load_settings({**LOCAL_ENV, "ADMISSION_MAX_INFLIGHT": "6", "ADMISSION_ENGINE_QUEUE_SLOTS": "2"})
    doc = build_envoy_config(settings)
    assert _thresholds(doc, "engine_default")["max_requests"] == 8
    assert _thresholds(doc, "engine_default_ungated")["max_requests"] == settings.max_streams
    without_budget = build_envoy_config(load_settings({**LOCAL_ENV, "ADMISSION_MAX_INFLIGHT": "6",
                                                       "ADMISSION_KV_BUDGET": "false"}))
    assert _thresholds(without_budget, "engine_default")["max_requests"] == 6  # no engine queue slots


def test_gated_paths_and_escaped_separators_route_to_the_bounded_cluster() -> None:
    settings = load_settings(LOCAL_ENV)
    routes = _hcm(build_envoy_config(settings))["route_config"]["virtual_hosts"][0]["routes"]
    bounded = [r["match"] for r in routes if r["route"]["cluster"] == "engine_default"]
    # Every gated path, after the one-message routes (a POST declaring a body to a JSON endpoint).
    assert [m["path"] for m in bounded if "path" in m and "headers" not in m] == list(settings.gated_paths)
    (regex,) = [m["safe_regex"]["regex"] for m in bounded if "safe_regex" in m]
    assert re.fullmatch(regex, "/v1/chat%2Fcompletions") and re.fullmatch(regex, "/v1%5cchat")
    assert not re.fullmatch(regex, "/v1/models")
    assert routes[-1] == {"match": {"prefix": "/"}, "route": {"cluster": "engine_default_ungated", "timeout": "0s"}}


def _cluster_for(routes: list[dict], method: str, path: str, engine: str | None = None) -> object:
    """The cluster (or direct response) Envoy's first matching route picks, as far as these matchers go."""
    for r in routes:
        m = r["match"]
        if "path" in m and m["path"] != path or "prefix" in m and not path.startswith(m["prefix"]):
            continue
        if "safe_regex" in m and not re.fullmatch(m["safe_regex"]["regex"], path):
            continue
        if any(h["name"] == ":method" and h["string_match"]["exact"] != method for h in m.get("headers", [])):
            continue
        if any(h["name"] == "content-length" for h in m.get("headers", [])):
            continue  # a chunked request: no declared length
        if "dynamic_metadata" in m and m["dynamic_metadata"][0]["value"]["string_match"]["exact"] != engine:
            continue
        return r["route"]["cluster"] if "route" in r else r["direct_response"]
    raise AssertionError(f"no route for {method} {path}")


def test_a_post_off_the_pass_list_takes_the_bounded_cluster_even_without_the_service(tmp_path: Path) -> None:
    # What the route table does with the service down and Envoy failing open: an engine route vLLM
    # added (or an admin POST) is never sent unbounded to the ungated cluster.
    routes = _hcm(build_envoy_config(load_settings(LOCAL_ENV)))["route_config"]["virtual_hosts"][0]["routes"]
    assert _cluster_for(routes, "POST", "/v9/new-thing") == "engine_default"
    assert _cluster_for(routes, "POST", "/v1/chat/completions/batch") == "engine_default"
    assert _cluster_for(routes, "POST", "/tokenize") == "engine_default_ungated"
    assert _cluster_for(routes, "POST", "/v1/responses/r1/cancel") == "engine_default_ungated"
    assert _cluster_for(routes, "GET", "/v9/new-thing") == "engine_default_ungated"
    path = tmp_path / "engines.yaml"
    path.write_text("engines:\n  - {name: a, url: 'http://127.0.0.1:8000', models: [m]}\n"
                    "  - {name: b, url: 'http://127.0.0.1:8001', models: [n]}\n")
    several = _hcm(build_envoy_config(load_settings({"EXTPROC_CONFIG": str(path)})))
    routes = several["route_config"]["virtual_hosts"][0]["routes"]
    assert _cluster_for(routes, "POST", "/v9/new-thing") == {"status": 503}  # no engine named: no guess
    assert _cluster_for(routes, "POST", "/v9/new-thing", engine="b") == "engine_b"
    assert _cluster_for(routes, "POST", "/tokenize") == "engine_a_ungated"


def test_nothing_gated_means_no_bound_on_the_engine_cluster() -> None:
    doc = build_envoy_config(load_settings({**LOCAL_ENV, "ADMISSION_OBSERVE_MODELS": ""}))
    assert [c["name"] for c in doc["static_resources"]["clusters"]] == ["extproc", "engine_default"]
    assert _thresholds(doc, "engine_default")["max_requests"] == load_settings(LOCAL_ENV).max_streams


def test_the_breakers_answer_is_shaped_like_the_services() -> None:
    service, *mappers = _hcm(build_envoy_config(load_settings(LOCAL_ENV)))["local_reply_config"]["mappers"]
    # The service's own answers (details `admission_<outcome>`) come first and are left as they are.
    assert service == {"filter": {"extension_filter": {
        "name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        "expression": "response.code_details.startsWith('admission_')"}}}}
    (mapper,) = [m for m in mappers if m["filter"] == {"response_flag_filter": {"flags": ["UO"]}}]
    assert mapper["status_code"] == 503
    headers = {h["header"]["key"]: h["header"]["value"] for h in mapper["headers_to_add"]}
    assert headers == {"retry-after": "5", "x-admission-outcome": "engine_overloaded"}
    assert mapper["body_format_override"]["json_format"]["error"]["code"] == "engine_overloaded"


def test_client_set_admission_headers_are_removed_before_routing() -> None:
    (extension,) = _hcm(build_envoy_config(load_settings(LOCAL_ENV)))["early_header_mutation_extensions"]
    assert extension["name"] == "envoy.http.early_header_mutation.header_mutation"
    assert extension["typed_config"]["mutations"] == [{"remove_on_match": {"key_matcher": {"prefix": "x-admission-"}}}]


# --- the overload manager and the connection cap ------------------------------------------------


def _monitors(doc: dict) -> dict:
    return {m["name"]: m["typed_config"] for m in doc["overload_manager"]["resource_monitors"]}


@pytest.mark.parametrize(
    ("limit", "body", "connections"),
    [
        ("512Mi", 1 << 20, 166),  # the chart's default: (0.9 x 512 MiB - 128 MiB) / 2 MiB
        ("1Gi", 1 << 20, 396),
        ("512Mi", 4 << 20, 41),
        ("2G", 1 << 20, 794),
    ],
)
def test_the_connection_cap_leaves_room_for_two_body_buffers_per_connection(limit: str, body: int, connections: int,
                                                                            tmp_path: Path) -> None:
    from extproc.envoyconf import memory_bytes

    settings = load_settings({**LOCAL_ENV, "MAX_BODY_BYTES": str(body)})
    doc = build_envoy_config(settings, memory_limit_bytes=memory_bytes(limit))
    monitors = _monitors(doc)
    heap = monitors["envoy.resource_monitors.fixed_heap"]["max_heap_size_bytes"]
    assert heap == memory_bytes(limit) * 90 // 100
    cap = monitors["envoy.resource_monitors.global_downstream_max_connections"]["max_active_downstream_connections"]
    assert cap == connections
    # Every connection at two full buffers, plus Envoy's own 128 MiB, stays within the heap cap.
    assert cap * 2 * body + 128 * 2**20 <= heap < (cap + 1) * 2 * body + 128 * 2**20
    actions = {a["name"]: a["triggers"][0] for a in doc["overload_manager"]["actions"]}
    assert actions == {
        "envoy.overload_actions.shrink_heap": {"name": "envoy.resource_monitors.fixed_heap",
                                               "threshold": {"value": 0.95}},
        "envoy.overload_actions.stop_accepting_requests": {"name": "envoy.resource_monitors.fixed_heap",
                                                           "threshold": {"value": 0.98}},
        "envoy.overload_actions.reduce_timeouts": {
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "scaled": {"scaling_threshold": 0.5, "saturation_threshold": 0.9}}}
    _validate(render_envoy_config(settings, memory_limit_bytes=memory_bytes(limit)), tmp_path)


def test_the_committed_local_config_has_the_overload_manager_of_the_default_limit() -> None:
    doc = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    assert _monitors(doc)["envoy.resource_monitors.global_downstream_max_connections"] == {
        "@type": ("type.googleapis.com/"
                  "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"),
        "max_active_downstream_connections": 166}


def test_an_explicit_cap_wins_and_no_limit_means_no_overload_manager() -> None:
    from extproc.envoyconf import DEFAULT_ENVOY_MEMORY_LIMIT_BYTES

    settings = load_settings(LOCAL_ENV)
    doc = build_envoy_config(settings, memory_limit_bytes=DEFAULT_ENVOY_MEMORY_LIMIT_BYTES, downstream_connections=5000)
    monitor = _monitors(doc)["envoy.resource_monitors.global_downstream_max_connections"]
    assert monitor["max_active_downstream_connections"] == 5000
    # The local stack's Envoy runs without a container limit (and benchmarks hold thousands of
    # connections): the dict builder adds no overload manager unless given a limit; the config
    # file (`extproc envoy-config`, envoy/envoy.yaml) is for the chart's default 512 MiB container.
    assert "overload_manager" not in build_envoy_config(settings)
    assert "overload_manager" not in build_envoy_config(settings, memory_limit_bytes=None)
    assert "overload_manager:" in render_envoy_config(settings)
    assert "overload_manager:" not in render_envoy_config(settings, memory_limit_bytes=None)


def test_under_connection_pressure_only_the_idle_keep_alive_timeout_shrinks() -> None:
    """Idle keep-alive connections give their slots up first (down to 1 s at 90% of the cap); the
    stream idle timer, which a parked request waits under, is never scaled."""
    from extproc.envoyconf import DEFAULT_ENVOY_MEMORY_LIMIT_BYTES

    doc = build_envoy_config(load_settings(LOCAL_ENV), memory_limit_bytes=DEFAULT_ENVOY_MEMORY_LIMIT_BYTES)
    (reduce,) = [a for a in doc["overload_manager"]["actions"] if a["name"] == "envoy.overload_actions.reduce_timeouts"]
    assert reduce["typed_config"]["timer_scale_factors"] == [
        {"timer": "HTTP_DOWNSTREAM_CONNECTION_IDLE", "min_timeout": "1s"}]


def test_slow_clients_are_cut_off_by_the_headers_timeout_and_idle_connections_by_the_idle_timeout(
        tmp_path: Path) -> None:
    doc = build_envoy_config(load_settings(LOCAL_ENV), health_port=9902)
    health = doc["static_resources"]["listeners"][1]["filter_chains"][0]["filters"][0]["typed_config"]
    for hcm in (_hcm(doc), health):
        # A whole request header within 10 s of its first byte, however slowly it trickles.
        assert hcm["request_headers_timeout"] == "10s"
        # A connection with no request in progress: 60 s (Envoy's default is 1 h).
        assert hcm["common_http_protocol_options"] == {"idle_timeout": "60s"}
    # Neither is a timer a parked or generating request waits under: the stream idle timeout is.
    assert float(_hcm(doc)["stream_idle_timeout"].rstrip("s")) > 10
    # The admin interface neither takes a slot of the connection cap nor is refused by it.
    assert doc["admin"]["ignore_global_conn_limit"] is True
    _validate(yaml.safe_dump(doc), tmp_path)


@pytest.mark.parametrize("park", ["1", "5", "120", "900"])
def test_no_timeout_declares_a_stalled_service_dead_before_the_stall_allowance(park: str, tmp_path: Path) -> None:
    """Envoy fails a message timeout or a reset stream like an unreachable service (open: forward
    ungated); every timer that could do so on a live service allows a stall of SERVICE_STALL_SECONDS."""
    from extproc.contract import PARK_TIMEOUT_MARGIN_SECONDS, SERVICE_STALL_SECONDS

    doc = build_envoy_config(load_settings({**LOCAL_ENV, "ADMISSION_MAX_PARK_SECONDS": park}))
    ext = _ext_proc(doc)
    assert ext["message_timeout"] == "15s" and SERVICE_STALL_SECONDS == 15
    (cluster,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "extproc"]
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert options["explicit_http_config"]["http2_protocol_options"]["connection_keepalive"] == {
        "interval": "30s", "timeout": "15s"}
    # The override a parked request gets (park cap + margin, at least the stall allowance) fits.
    override = max(float(park) + PARK_TIMEOUT_MARGIN_SECONDS, SERVICE_STALL_SECONDS)
    assert float(ext["max_message_timeout"].rstrip("s")) >= override + PARK_TIMEOUT_MARGIN_SECONDS
    assert float(_hcm(doc)["stream_idle_timeout"].rstrip("s")) > override
    assert ext["failure_mode_allow"] is True  # still fails open when the service is down
    _validate(yaml.safe_dump(doc), tmp_path)


def test_a_memory_limit_too_small_for_the_body_cap_is_refused() -> None:
    settings = load_settings({**LOCAL_ENV, "MAX_BODY_BYTES": str(16 << 20)})
    with pytest.raises(ValueError, match="leaves room for 3 connections"):
        build_envoy_config(settings, memory_limit_bytes=256 * 2**20)


@pytest.mark.parametrize(("quantity", "expected"), [("512Mi", 536870912), ("1Gi", 1073741824), ("2G", 2 * 10**9),
                                                     ("800k", 800000), (1048576, 1048576), ("1Ti", 2**40)])
def test_memory_quantities(quantity: str | int, expected: int) -> None:
    from extproc.envoyconf import memory_bytes

    assert memory_bytes(quantity) == expected


@pytest.mark.parametrize("quantity", ["1.5Gi", "512MiB", "-1Gi", "", "1e9"])
def test_memory_quantities_the_generator_cannot_read_are_refused(quantity: str) -> None:
    from extproc.envoyconf import memory_bytes

    with pytest.raises(ValueError, match="memory quantity"):
        memory_bytes(quantity)


@pytest.mark.integration
def test_envoy_refuses_connections_beyond_the_cap_and_serves_the_others(tmp_path: Path) -> None:
    """The real Envoy with a cap of 2: of three connections one is closed unanswered, the other two are
    served. No tight timing: every wait polls with a generous deadline, whichever connection Envoy
    refuses is fine, and the admin connections the test itself makes do not count toward the cap."""
    import socket

    from devstack import free_port, http_get, wait_until

    port, admin = free_port(), free_port()
    path = tmp_path / "envoy.yaml"
    path.write_text(render_envoy_config(load_settings(LOCAL_ENV), listen_port=port, admin_port=admin,
                                        downstream_connections=2))
    envoy = subprocess.Popen([ENVOY, "-c", str(path), "--log-level", "warn", "--concurrency", "1",
                              "--disable-hot-restart"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    socks: list[socket.socket] = []
    try:
        wait_until(lambda: http_get(f"http://127.0.0.1:{admin}/ready", timeout=5)[0] == 200, 60, "Envoy to be ready")

        def stat(name: str) -> int:
            body = http_get(f"http://127.0.0.1:{admin}/stats?filter={name}$", timeout=10)[1].decode()
            return sum(int(line.split(":")[1]) for line in body.splitlines() if line.strip())

        for _ in range(3):
            socks.append(socket.create_connection(("127.0.0.1", port), 30))
        wait_until(lambda: stat("downstream_global_cx_overflow") == 1, 60, "one connection to be refused")
        wait_until(lambda: stat("http.inference.downstream_cx_active") == 2, 60, "two connections to be accepted")

        def answer(s: socket.socket) -> bytes:
            s.settimeout(60)
            received = b""
            try:
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
                while b"\r\n" not in received and (piece := s.recv(4096)):
                    received += piece
            except OSError:
                pass  # reset: the refused one
            return received

        answers = [answer(s) for s in socks]
        # No engine behind it: the two accepted connections get Envoy's shaped 503; the third nothing.
        assert sorted(a.startswith(b"HTTP/1.1 503") for a in answers) == [False, True, True], answers
        assert [a for a in answers if not a.startswith(b"HTTP/1.1 503")] == [b""]
        assert stat("downstream_global_cx_overflow") == 1
    finally:
        for s in socks:
            s.close()
        envoy.terminate()
        envoy.wait(timeout=30)


# --- checked against Envoy's API when generated -------------------------------------------------


def _misspell(doc: dict, path: list, wrong: str) -> dict:
    """`doc` with the field at `path` (keys and list indexes) renamed to `wrong`."""
    import copy

    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[wrong] = node.pop(path[-1])
    return doc


_HCM_PATH = ["static_resources", "listeners", 0, "filter_chains", 0, "filters", 0, "typed_config"]


@pytest.mark.parametrize(
    ("path", "wrong", "named"),
    [
        (["static_resources", "listeners", 0, "per_connection_buffer_limit_bytes"], "per_conection_buffer_limit_bytes",
         "Listener"),
        ([*_HCM_PATH, "stream_idle_timeout"], "stream_idle_timout", "HttpConnectionManager"),
        ([*_HCM_PATH, "http_filters", 0, "typed_config", "max_message_timeout"], "max_mesage_timeout",
         "ExternalProcessor"),
        ([*_HCM_PATH, "local_reply_config", "mappers", 0, "filter", "extension_filter", "typed_config", "expression"],
         "expresion", "ExpressionFilter"),
        (["overload_manager", "resource_monitors", 0, "typed_config", "max_heap_size_bytes"], "max_heap_bytes",
         "FixedHeapConfig"),
    ],
)
def test_a_misspelled_field_fails_when_the_config_is_generated(path: list, wrong: str, named: str) -> None:
    from extproc.envoyconf import DEFAULT_ENVOY_MEMORY_LIMIT_BYTES, check_envoy_config

    doc = build_envoy_config(load_settings(LOCAL_ENV), memory_limit_bytes=DEFAULT_ENVOY_MEMORY_LIMIT_BYTES)
    check_envoy_config(doc)  # as generated
    with pytest.raises(ValueError, match=f"Unknown field '{wrong}' in message {named}"):
        check_envoy_config(_misspell(doc, path, wrong))


def test_an_unknown_enum_value_or_type_fails_when_the_config_is_generated() -> None:
    from extproc.envoyconf import check_envoy_config

    doc = build_envoy_config(load_settings(LOCAL_ENV))
    ext_proc = _ext_proc(doc)
    ext_proc["processing_mode"]["request_body_mode"] = "BUFFERD_PARTIAL"
    with pytest.raises(ValueError, match="BUFFERD_PARTIAL"):
        check_envoy_config(doc)
    ext_proc["processing_mode"]["request_body_mode"] = "BUFFERED_PARTIAL"
    ext_proc["@type"] = ext_proc["@type"].replace("ExternalProcessor", "ExternalProcesor")
    with pytest.raises(ValueError, match="ExternalProcesor"):
        check_envoy_config(doc)


def test_a_park_cap_beyond_envoys_ext_proc_timeout_limit_is_refused_at_startup() -> None:
    doc = build_envoy_config(load_settings({**LOCAL_ENV, "ADMISSION_MAX_PARK_SECONDS": "3590"}))
    assert "3600s" in yaml.safe_dump(doc)  # max_message_timeout at Envoy's 1 h limit, not beyond
    with pytest.raises(ValueError, match="ADMISSION_MAX_PARK_SECONDS.*3591"):
        load_settings({**LOCAL_ENV, "ADMISSION_MAX_PARK_SECONDS": "3591"})


# --- what a deployment adds: options, not edits ---------------------------------------------------


def test_the_health_listener_forwards_only_ready_and_prometheus_stats_to_the_loopback_admin(tmp_path: Path) -> None:
    doc = build_envoy_config(load_settings(LOCAL_ENV), admin_port=9901, health_port=9902)
    inference, health = doc["static_resources"]["listeners"]
    assert health["name"] == "envoy_health" and health["address"]["socket_address"]["port_value"] == 9902
    assert health["ignore_global_conn_limit"] is True  # probes are answered at the connection cap
    hcm = health["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert routes == [{"match": {"path": "/ready"}, "route": {"cluster": "envoy_admin"}},
                      {"match": {"path": "/stats/prometheus"}, "route": {"cluster": "envoy_admin"}}]
    (admin,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "envoy_admin"]
    assert admin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "socket_address": {"address": "127.0.0.1", "port_value": 9901}}
    assert doc["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert "envoy_health" not in yaml.safe_dump(build_envoy_config(load_settings(LOCAL_ENV)))
    _validate(yaml.safe_dump(doc), tmp_path)


def test_without_ext_proc_envoy_forwards_straight_to_the_engine(tmp_path: Path) -> None:
    doc = build_envoy_config(load_settings({**LOCAL_ENV, "ADMISSION_OBSERVE_MODELS": ""}), ext_proc=False)
    assert [f["name"] for f in _hcm(doc)["http_filters"]] == ["envoy.filters.http.router"]
    assert [c["name"] for c in doc["static_resources"]["clusters"]] == ["engine_default"]
    _validate(yaml.safe_dump(doc), tmp_path)


def test_the_first_token_allowance_sizes_the_stream_idle_timeout() -> None:
    settings = load_settings({**LOCAL_ENV, "ADMISSION_MAX_PARK_SECONDS": "30.5"})
    assert _hcm(build_envoy_config(settings))["stream_idle_timeout"] == "631s"
    assert _hcm(build_envoy_config(settings, first_token_allowance=120))["stream_idle_timeout"] == "151s"
    explicit = build_envoy_config(settings, first_token_allowance=120, stream_idle_timeout=900)
    assert _hcm(explicit)["stream_idle_timeout"] == "900s"


def test_the_ledger_settings_do_not_change_the_envoy_config(tmp_path: Path) -> None:
    """The chart's envoy-config init container gets the service's env without the ledger's (the
    Redis URL is a credential the Envoy pods need not hold): that is only right while this holds."""
    local = load_settings(LOCAL_ENV)
    redis = load_settings({**LOCAL_ENV, "ADMISSION_LEDGER": "redis", "ADMISSION_REDIS_URL": "redis://:pw@redis:6379/0",
                           "ADMISSION_LEDGER_LEASE_SECONDS": "2.5", "ADMISSION_LEDGER_TIMEOUT_MS": "20",
                           "ADMISSION_LEDGER_KEY_PREFIX": "team-x", "ADMISSION_REPLICA_ID": "pod-a"})
    assert (redis.ledger, local.ledger) == ("redis", "local")
    assert render_envoy_config(redis) == render_envoy_config(local)


def test_the_cli_writes_the_config_with_the_options_a_deployment_passes(tmp_path: Path) -> None:
    from extproc.cli import main
    from extproc.envoyconf import memory_bytes

    out = tmp_path / "envoy.yaml"
    argv = ["envoy-config", "--output", str(out), "--listen", "0.0.0.0:8080", "--admin", "127.0.0.1:9901",
            "--health-listen", "0.0.0.0:9902", "--extproc", "admission.inference.svc.cluster.local:9002",
            "--failure-mode", "closed", "--first-token-allowance", "120", "--memory-limit", "1Gi",
            "--max-downstream-connections", "300"]
    assert main(argv, environ=LOCAL_ENV) == 0
    expected = render_envoy_config(
        load_settings(LOCAL_ENV), listen_port=8080, admin_port=9901, health_port=9902,
        extproc_host="admission.inference.svc.cluster.local", extproc_port=9002, failure_mode="closed",
        first_token_allowance=120, memory_limit_bytes=memory_bytes("1Gi"), downstream_connections=300)
    assert out.read_text() == expected
    (extproc,) = [c for c in yaml.safe_load(expected)["static_resources"]["clusters"] if c["name"] == "extproc"]
    assert extproc["type"] == "STRICT_DNS"
    _validate(out.read_text(), tmp_path)
    assert main(["envoy-config", "--output", str(out), "--memory-limit", "none"], environ=LOCAL_ENV) == 0
    assert "overload_manager" not in yaml.safe_load(out.read_text())


@pytest.mark.parametrize(("flags", "message"), [
    (["--memory-limit", "1.5Gi"], "memory quantity '1.5Gi'"),
    (["--memory-limit", "64Mi"], "leaves room for 0 connections"),
    (["--health-listen", "9902"], "--health-listen='9902': must be HOST:PORT"),
])
def test_the_cli_refuses_what_it_cannot_generate_with_exit_2(flags: list[str], message: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from extproc.cli import main

    assert main(["envoy-config", *flags], environ=LOCAL_ENV) == 2
    assert message in capsys.readouterr().err


def test_envoy_closes_idle_engine_connections_before_vllm_does_and_retries_a_request_a_close_raced() -> None:
    from extproc.envoyconf import ENGINE_IDLE_TIMEOUT_SECONDS

    doc = build_envoy_config(load_settings(LOCAL_ENV))
    engine_clusters = [c for c in doc["static_resources"]["clusters"] if c["name"] != "extproc"]
    assert engine_clusters
    # vLLM's API server closes an idle keep-alive connection after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
    assert ENGINE_IDLE_TIMEOUT_SECONDS < 5
    for cluster in engine_clusters:
        options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert options["common_http_protocol_options"]["idle_timeout"] == f"{ENGINE_IDLE_TIMEOUT_SECONDS}s"
        assert "http_protocol_options" in options["explicit_http_config"]  # still HTTP/1.1 to the engine
    (vhost,) = _hcm(doc)["route_config"]["virtual_hosts"]
    assert vhost["retry_policy"] == {"retry_on": "reset-before-request", "num_retries": 1}
