"""Real X.509 certificates for the mTLS tests, made at test time with the `openssl` CLI (the
`cryptography` package is not among the test dependencies): a CA, certificates it signs (with
the subject alternative names and extended key usages asked for), all PEM files in one folder."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pair:
    """A PEM certificate and its private key."""

    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def openssl_or_skip() -> None:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI makes the test certificates")


def make_ca(folder: Path, name: str) -> Pair:
    """A self-signed CA `name`, valid for a day."""
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(pair.key), "-out", str(pair.cert), "-days", "1", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return pair


def make_cert(folder: Path, name: str, ca: Pair, *, sans: tuple[str, ...] = (),
              usages: tuple[str, ...] = ("serverAuth", "clientAuth")) -> Pair:
    """A certificate `name` signed by `ca`, with subject alternative names `sans` (e.g.
    "DNS:localhost", "IP:127.0.0.1") and extended key usages `usages`."""
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    request = folder / f"{name}.csr"
    extensions = folder / f"{name}.ext"
    lines = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
             f"extendedKeyUsage={','.join(usages)}"]
    if sans:
        lines.append(f"subjectAltName={','.join(sans)}")
    extensions.write_text("\n".join(lines) + "\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(pair.key), "-out", str(request), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(request), "-CA", str(ca.cert), "-CAkey", str(ca.key), "-CAcreateserial",
             "-out", str(pair.cert), "-days", "1", "-extfile", str(extensions))
    return pair
