"""mTLS between Envoy and the service: the EXTPROC_TLS_* settings are checked at startup, and the
generated Envoy config gives the extproc cluster a TLS transport socket with a client
certificate (from the service's own settings or from `extproc envoy-config`'s flags) that the
real Envoy accepts. Certificates are real, made at test time (tests/certs.py). The handshake
itself, Envoy to the service and a client without a certificate: tests/integration/test_transport.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.cli import main
from extproc.config import ConfigError, TlsFiles, load_settings
from extproc.envoyconf import ExtprocTls, build_envoy_config, render_envoy_config

from ..certs import Pair, make_ca, make_cert, openssl_or_skip
from .test_envoyconf import _validate

GATED = {"ADMISSION_OBSERVE_MODELS": "m"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pair]:
    openssl_or_skip()
    folder = tmp_path_factory.mktemp("pki")
    ca = make_ca(folder, "ca")
    return {"ca": ca, "service": make_cert(folder, "service", ca, sans=("IP:127.0.0.1", "DNS:extproc.example")),
            "envoy": make_cert(folder, "envoy", ca, usages=("clientAuth",))}


def _env(pki: dict[str, Pair], **override: str) -> dict[str, str]:
    env = {**GATED, "EXTPROC_TLS_CERT": str(pki["service"].cert), "EXTPROC_TLS_KEY": str(pki["service"].key),
           "EXTPROC_TLS_CLIENT_CA": str(pki["ca"].cert)}
    env.update(override)
    return {k: v for k, v in env.items() if v}


def _extproc_cluster(doc: dict) -> dict:
    (cluster,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "extproc"]
    return cluster


# --- the service's settings -------------------------------------------------------------------


def test_no_tls_settings_means_a_plaintext_port() -> None:
    assert load_settings(GATED).tls is None


def test_the_three_tls_files_turn_mtls_on(pki: dict[str, Pair]) -> None:
    s = load_settings(_env(pki))
    assert s.tls == TlsFiles(str(pki["service"].cert), str(pki["service"].key), str(pki["ca"].cert))
    assert s.summary()["grpc_tls"]["client_ca"] == str(pki["ca"].cert)


@pytest.mark.parametrize("unset", ["EXTPROC_TLS_CERT", "EXTPROC_TLS_KEY", "EXTPROC_TLS_CLIENT_CA"])
def test_tls_needs_all_three_files_and_names_the_one_missing(pki: dict[str, Pair], unset: str) -> None:
    with pytest.raises(ConfigError, match=f"^{unset} unset"):
        load_settings(_env(pki, **{unset: ""}))


@pytest.mark.parametrize("name", ["EXTPROC_TLS_CERT", "EXTPROC_TLS_KEY", "EXTPROC_TLS_CLIENT_CA"])
def test_a_missing_tls_file_is_named_at_startup(pki: dict[str, Pair], name: str, tmp_path: Path) -> None:
    path = str(tmp_path / "absent.pem")
    with pytest.raises(ConfigError) as info:
        load_settings(_env(pki, **{name: path}))
    assert f"{name}={path!r}: cannot read" in str(info.value)


def test_a_key_that_is_not_the_certificates_is_refused(pki: dict[str, Pair]) -> None:
    with pytest.raises(ConfigError, match="EXTPROC_TLS_KEY"):
        load_settings(_env(pki, EXTPROC_TLS_KEY=str(pki["envoy"].key)))


def test_a_client_ca_that_is_not_pem_is_refused(pki: dict[str, Pair], tmp_path: Path) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="EXTPROC_TLS_CLIENT_CA"):
        load_settings(_env(pki, EXTPROC_TLS_CLIENT_CA=str(junk)))


def test_a_bad_tls_setting_exits_with_status_2(pki: dict[str, Pair], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config"], _env(pki, EXTPROC_TLS_CERT="/nonexistent/tls.crt")) == 2
    assert "EXTPROC_TLS_CERT='/nonexistent/tls.crt': cannot read" in capsys.readouterr().err


# --- Envoy's side -----------------------------------------------------------------------------


def test_a_plaintext_service_gets_a_plaintext_extproc_cluster() -> None:
    assert "transport_socket" not in _extproc_cluster(build_envoy_config(load_settings(GATED)))


def test_envoy_presents_the_services_certificate_and_verifies_it_by_default(pki: dict[str, Pair],
                                                                             tmp_path: Path) -> None:
    text = render_envoy_config(load_settings(_env(pki)), memory_limit_bytes=None)
    socket = _extproc_cluster(yaml.safe_load(text))["transport_socket"]
    common = socket["typed_config"]["common_tls_context"]
    assert common["tls_certificates"] == [{"certificate_chain": {"filename": str(pki["service"].cert)},
                                           "private_key": {"filename": str(pki["service"].key)}}]
    assert common["validation_context"]["trusted_ca"] == {"filename": str(pki["ca"].cert)}
    # The service must prove it is the host Envoy dialled, not merely any holder of a CA-signed certificate.
    assert common["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}]
    assert common["alpn_protocols"] == ["h2"]
    _validate(text, tmp_path)  # the real Envoy loads the certificates


def test_envoy_config_takes_its_own_client_certificate_and_a_service_name(pki: dict[str, Pair],
                                                                          tmp_path: Path) -> None:
    tls = ExtprocTls(str(pki["envoy"].cert), str(pki["envoy"].key), str(pki["ca"].cert))
    doc = build_envoy_config(load_settings(GATED), extproc_host="extproc.example", extproc_port=9002,
                             extproc_tls=tls)
    context = _extproc_cluster(doc)["transport_socket"]["typed_config"]
    assert context["sni"] == "extproc.example"
    assert context["common_tls_context"]["tls_certificates"][0]["certificate_chain"] == {
        "filename": str(pki["envoy"].cert)}
    assert context["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "extproc.example"}}]
    _validate(yaml.safe_dump(doc), tmp_path)


def test_the_cli_flags_set_envoys_side(pki: dict[str, Pair], tmp_path: Path) -> None:
    out = tmp_path / "envoy.yaml"
    flags = ["--extproc-tls-cert", str(pki["envoy"].cert), "--extproc-tls-key", str(pki["envoy"].key),
             "--extproc-tls-ca", str(pki["ca"].cert), "--extproc-tls-server-name", "extproc.example"]
    assert main(["envoy-config", "--output", str(out), "--memory-limit", "none", *flags], environ=GATED) == 0
    context = _extproc_cluster(yaml.safe_load(out.read_text()))["transport_socket"]["typed_config"]
    assert context["sni"] == "extproc.example"
    assert context["common_tls_context"]["tls_certificates"][0]["private_key"] == {"filename": str(pki["envoy"].key)}
    _validate(out.read_text(), tmp_path)


def test_the_cli_refuses_part_of_the_tls_flags(pki: dict[str, Pair], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-config", "--extproc-tls-cert", str(pki["envoy"].cert)], environ=GATED) == 2
    assert "--extproc-tls-key, --extproc-tls-ca" in capsys.readouterr().err
