"""Settings are validated once; each bad value names its variable and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.cli import main
from extproc.config import ConfigError, load_settings


def test_defaults_match_the_reference_design() -> None:
    s = load_settings({"ADMISSION_OBSERVE_MODELS": "m"})
    (engine,) = s.engines
    assert (engine.limits.max_inflight, engine.limits.kv_threshold) == (4, 0.90)
    assert (engine.limits.max_queue_depth, engine.limits.max_park_seconds) == (8, 300.0)
    assert (s.max_body_bytes, s.poll_interval, s.stale_after_polls, s.retry_after_seconds) == (1048576, 2.0, 3, 5)
    assert engine.metrics_url == "http://127.0.0.1:8000/metrics"
    assert (s.grpc_host, s.grpc_port) == ("127.0.0.1", 9002)
    assert (s.admin_host, s.admin_port) == ("127.0.0.1", 9003)  # loopback: /metrics and /debug are unauthenticated
    assert s.models_refresh_seconds == 30.0


LISTENERS = {"EXTPROC_LISTEN": "grpc", "EXTPROC_ADMIN_LISTEN": "admin", "EXTPROC_PROBE_LISTEN": "probe"}


@pytest.mark.parametrize("name", sorted(LISTENERS))
def test_a_listen_address_without_a_host_is_loopback(name: str) -> None:
    s = load_settings({name: ":9100"})
    prefix = LISTENERS[name]
    assert (getattr(s, f"{prefix}_host"), getattr(s, f"{prefix}_port")) == ("127.0.0.1", 9100)


@pytest.mark.parametrize("name", sorted(LISTENERS))
@pytest.mark.parametrize("raw,host", [("0.0.0.0:9100", "0.0.0.0"), ("[::]:9100", "::"), ("10.1.2.3:9100", "10.1.2.3"),
                                      ("extproc.svc:9100", "extproc.svc"), ("[::1]:9100", "::1")])
def test_a_listen_address_binds_the_host_it_names(name: str, raw: str, host: str) -> None:
    s = load_settings({name: raw})
    assert getattr(s, f"{LISTENERS[name]}_host") == host


def test_every_generation_and_pooling_endpoint_vllm_serves_is_gated_by_default() -> None:
    gated = set(load_settings({"ADMISSION_OBSERVE_MODELS": "m"}).gated_paths)
    assert gated >= {
        "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/invocations", "/pooling",
        "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/generate",
        "/v1/audio/transcriptions", "/v1/audio/translations",
    }
    assert load_settings({"ADMISSION_GATED_PATHS": "/v1/chat/completions, /v1/x"}).gated_paths == (
        "/v1/chat/completions", "/v1/x")


@pytest.mark.parametrize("path", ["/v1/chat%2Fcompletions", "/v1/chat/completions/", "/v1//chat", "/v1/./x", "/v1/x;y"])
def test_a_gated_path_must_be_plain(path: str) -> None:
    with pytest.raises(ConfigError, match="ADMISSION_GATED_PATHS"):
        load_settings({"ADMISSION_GATED_PATHS": path})


def test_max_inflight_defaults_to_vllm_max_num_seqs() -> None:
    assert load_settings({"VLLM_MAX_NUM_SEQS": "6"}).engines[0].limits.max_inflight == 6
    env = {"VLLM_MAX_NUM_SEQS": "6", "ADMISSION_MAX_INFLIGHT": "3"}
    assert load_settings(env).engines[0].limits.max_inflight == 3


def test_no_observed_models_means_no_gating() -> None:
    assert load_settings({}).gating is False
    assert load_settings({"ADMISSION_OBSERVE_MODELS": "a, b"}).gating is True


@pytest.mark.parametrize(
    "name,value",
    [
        ("ADMISSION_KV_THRESHOLD", "1.5"),
        ("ADMISSION_KV_THRESHOLD", "0"),
        ("ADMISSION_MAX_PARK_SECONDS", "-1"),
        ("ADMISSION_MAX_INFLIGHT", "0"),
        ("VLLM_MAX_QUEUE_DEPTH", "many"),
        ("MAX_BODY_BYTES", "12"),
        ("ENGINE_POLL_INTERVAL_SECONDS", "nan"),
        ("ENGINE_STALE_AFTER_POLLS", "0"),
        ("ENGINE_URL", "localhost:8000"),
        ("EXTPROC_LISTEN", "9002"),
        ("ADMISSION_LOCAL_ACCOUNTING", "maybe"),
        ("ADMISSION_GATED_PATHS", "v1/chat"),
        ("ADMISSION_MODELS_REFRESH_SECONDS", "-1"),
        ("EXTPROC_ADMIN_LISTEN", "9003"),
        ("EXTPROC_LOG_LEVEL", "LOUD"),
        ("EXTPROC_LISTEN", "127.0.0.1:70000"),
        ("EXTPROC_PROBE_LISTEN", "0.0.0.0:-1"),
        ("ADMISSION_LEDGER", "etcd"),
    ],
)
def test_bad_values_name_the_variable_and_the_value(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({name: value})
    assert name in str(info.value) and repr(value) in str(info.value)


def test_bad_value_exits_with_status_2_and_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config"], {"ADMISSION_KV_THRESHOLD": "2"}) == 2
    assert "ADMISSION_KV_THRESHOLD='2'" in capsys.readouterr().err


def test_yaml_maps_models_to_engines_with_per_engine_overrides(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"
    path.write_text(
        "engines:\n"
        "  - name: big\n    url: http://vllm-big:8000\n    models: [qwen-32b]\n    max_inflight: 2\n"
        "  - name: small\n    url: http://10.0.0.7:8001\n    models: [llama-8b, llama-8b-instruct]\n"
    )
    s = load_settings({"EXTPROC_CONFIG": str(path), "ADMISSION_KV_THRESHOLD": "0.8"})
    assert s.model_to_engine["qwen-32b"].name == "big"
    assert s.model_to_engine["llama-8b-instruct"].upstream_port == 8001
    assert s.model_to_engine["qwen-32b"].limits.max_inflight == 2
    assert s.model_to_engine["llama-8b"].limits.max_inflight == 4
    assert {e.limits.kv_threshold for e in s.engines} == {0.8}


@pytest.mark.parametrize(
    "text,needle",
    [
        ("engines: []\n", "non-empty list"),
        ("engines:\n  - name: a\n    models: [m]\n", "engines[a].url"),
        ("engines:\n  - name: A!\n    url: http://x:1\n    models: [m]\n", "engines[0].name"),
        ("engines:\n  - name: a\n    url: http://x:1\n    models: [m]\n    kv_threshold: 3\n",
         "engines[a].kv_threshold=3"),
        ("engines:\n  - name: a\n    url: http://x:1\n    models: [m]\n    colour: red\n", "unknown keys"),
        ("engines:\n  - {name: a, url: 'http://x:1', models: [m]}\n  - {name: b, url: 'http://y:1', models: [m]}\n",
         "model 'm' is listed for engines 'a' and 'b'"),
        ("engines: [\n", "not valid YAML"),
    ],
)
def test_bad_yaml_is_rejected_with_the_offending_key(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "engines.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings({"EXTPROC_CONFIG": str(path)})
    assert needle in str(info.value)


def test_config_file_and_observe_models_together_are_ambiguous(tmp_path: Path) -> None:
    path = tmp_path / "engines.yaml"
    path.write_text("engines:\n  - {name: a, url: 'http://x:1', models: [m]}\n")
    with pytest.raises(ConfigError, match="both set"):
        load_settings({"EXTPROC_CONFIG": str(path), "ADMISSION_OBSERVE_MODELS": "m"})
