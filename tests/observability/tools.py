"""Find the Prometheus binaries (Debian package `prometheus`) and `redis-server` (package
`redis-server`), both installed by `make system-deps`.

Outside CI a missing binary skips the tests that need it, with the reason; in CI (CI=true) it
fails them, so a broken CI image cannot pass by skipping.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require_binary(name: str, package: str = "prometheus") -> str:
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} not found on PATH (Debian: apt-get install {package}; make system-deps installs it)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {message}")
    pytest.skip(message)


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return require_binary("prometheus")


@pytest.fixture(scope="session")
def redis_server_binary() -> str:
    return require_binary("redis-server", "redis-server")
