"""extproc.tls.secretName: mTLS between every Envoy and the shared admission service. The rendered
objects validate against Kubernetes' schema; the Secret is mounted at one path in the service,
the envoy-config init container and Envoy; the service gets EXTPROC_TLS_* (which the init
container's `extproc envoy-config` loads and checks, with real certificates made at test time);
the config it writes gives the extproc cluster a TLS transport socket that verifies the service
by its Service DNS name, and the real Envoy validates it with the certificates in place. The
sidecar shape refuses the value (its service listens on the pod's own loopback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extproc.config import load_settings

from .conftest import TLS_SECRET, TLS_SERVICE_NAME, Chart, Rendered, helm, mounted_file
from .test_chart import validate_manifests

SECRET = TLS_SECRET
SERVICE_NAME = TLS_SERVICE_NAME
TLS_VALUES = {"shape": "shared", "extproc": {"tls": {"secretName": SECRET}}}


@pytest.fixture(scope="module")
def secret_files(tls_secret_files: dict[str, str]) -> dict[str, str]:
    return tls_secret_files


@pytest.fixture(scope="module")
def mtls(chart: Chart, secret_files: dict[str, str]) -> Rendered:
    # Chart.render runs the envoy-config init container with the Secret's files on its volume and
    # validates what it writes with the real Envoy (which loads the certificates).
    return chart.render(TLS_VALUES, volume_files={"extproc-tls": secret_files})


def _pod(rendered: Rendered, container: str) -> dict[str, Any]:
    return rendered.deployment_of(container)["spec"]["template"]["spec"]


def _extproc_cluster(rendered: Rendered) -> dict[str, Any]:
    (cluster,) = [c for c in rendered.envoy["static_resources"]["clusters"] if c["name"] == "extproc"]
    return cluster


def test_with_mtls_every_object_validates_against_the_kubernetes_schema(mtls: Rendered) -> None:
    assert len(validate_manifests(mtls.objects)) >= 5


def test_the_service_serves_the_secrets_certificate_and_requires_client_certificates(
        mtls: Rendered, secret_files: dict[str, str], tmp_path: Path) -> None:
    env = mtls.env()
    pod, container = _pod(mtls, "admission"), mtls.container("admission")
    files = {}
    for name, key in (("EXTPROC_TLS_CERT", "tls.crt"), ("EXTPROC_TLS_KEY", "tls.key"),
                      ("EXTPROC_TLS_CLIENT_CA", "ca.crt")):
        volume, inside = mounted_file(pod, container, env[name])
        assert volume["secret"]["secretName"] == SECRET and inside == key, (name, volume, inside)
        files[name] = tmp_path / key
        files[name].write_text(secret_files[key])
    # The service's own startup check accepts what the Secret holds.
    tls = load_settings({**{k: v for k, v in env.items() if k != "EXTPROC_CONFIG"},
                         **{k: str(v) for k, v in files.items()}}).tls
    assert tls is not None and tls.client_ca == str(files["EXTPROC_TLS_CLIENT_CA"])


def test_every_envoy_presents_the_certificate_and_verifies_the_service_by_its_dns_name(mtls: Rendered) -> None:
    context = _extproc_cluster(mtls)["transport_socket"]["typed_config"]
    common = context["common_tls_context"]
    (pair,) = common["tls_certificates"]
    ca = common["validation_context"]["trusted_ca"]["filename"]
    assert context["sni"] == SERVICE_NAME
    assert common["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": SERVICE_NAME}}]
    # The files the config names are on the Secret's volume in the Envoy container, which reads them.
    pod, envoy = _pod(mtls, "envoy"), mtls.container("envoy")
    for path, key in ((pair["certificate_chain"]["filename"], "tls.crt"), (pair["private_key"]["filename"], "tls.key"),
                      (ca, "ca.crt")):
        volume, inside = mounted_file(pod, envoy, path)
        assert volume["secret"]["secretName"] == SECRET and inside == key, (path, volume, inside)


def test_without_the_value_the_shared_shape_stays_plaintext(chart: Chart) -> None:
    rendered = chart.render({"shape": "shared"})
    assert not {"EXTPROC_TLS_CERT", "EXTPROC_TLS_KEY", "EXTPROC_TLS_CLIENT_CA"} & set(rendered.env())
    assert "transport_socket" not in _extproc_cluster(rendered)
    volumes = [v for d in rendered.deployments for v in d["spec"]["template"]["spec"]["volumes"]]
    assert not [v for v in volumes if "secret" in v]


def test_the_sidecar_shape_refuses_mtls_on_its_loopback_port(chart: Chart) -> None:
    with pytest.raises(helm.HelmRenderError, match="extproc.tls.secretName: mTLS is for the shared shape"):
        chart.render({"extproc": {"tls": {"secretName": SECRET}}})
