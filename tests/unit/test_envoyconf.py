"""The generated Envoy config: valid for the real binary, timeouts consistent with the park cap."""

from __future__ import annotations

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


def test_committed_local_config_is_what_the_generator_produces() -> None:
    expected = render_envoy_config(load_settings(LOCAL_ENV))
    committed = (ROOT / "envoy" / "envoy.yaml").read_text()
    assert committed == expected, "envoy/envoy.yaml is stale: run `make envoy-config`"


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


def test_several_engines_get_a_cluster_each_and_routes_on_the_routing_header(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"
    path.write_text(
        "engines:\n"
        "  - {name: big, url: 'http://vllm-big.llm.svc:8000', models: [qwen]}\n"
        "  - {name: small, url: 'http://127.0.0.1:8001', models: [llama]}\n"
    )
    doc = build_envoy_config(load_settings({"EXTPROC_CONFIG": str(path)}))
    names = [c["name"] for c in doc["static_resources"]["clusters"]]
    assert names == ["extproc", "engine_big", "engine_small"]
    routes = _hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["match"].get("headers", [{}])[0].get("string_match") for r in routes] == [
        {"exact": "big"}, {"exact": "small"}, None]
    _validate(yaml.safe_dump(doc), tmp_path)


def test_client_set_admission_headers_are_removed_before_routing() -> None:
    (extension,) = _hcm(build_envoy_config(load_settings(LOCAL_ENV)))["early_header_mutation_extensions"]
    assert extension["name"] == "envoy.http.early_header_mutation.header_mutation"
    assert extension["typed_config"]["mutations"] == [{"remove_on_match": {"key_matcher": {"prefix": "x-admission-"}}}]
