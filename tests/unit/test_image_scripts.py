"""`make image` / scripts/image.sh pick docker, podman or buildah (IMAGE_BUILDER, else the first
present, docker only with its daemon up) and pass the base image and pull policy; the smoke script
skips with one line without a builder, and with one runs check-config and check against the
simulator inside the image. The builders here are stubs on PATH (the real ones are other
programs, not this project's code): one records its command line, one runs the "container"
command on this machine, which is what a builder with host networking does with it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PATH = "/usr/bin:/bin"

RECORDING = """#!/bin/sh
[ "$1" = info ] && exit "${DOCKER_INFO_RC:-0}"
echo "$(basename "$0") $*" >> "$STUB_LOG"
"""
# `run --rm --network=host -e K=V ... IMAGE cmd...` runs cmd here with K=V; `image inspect` finds it.
RUNNING = """#!/bin/sh
[ "$1" = info ] && exit 0
[ "$1" = image ] && exit 0
[ "$1" = run ] || exit 9
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --rm|--network=host) shift ;;
    -e) export "$2"; shift 2 ;;
    *) shift; break ;;
  esac
done
exec "$@"
"""


def stubs(tmp_path: Path, script: str, *names: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def run(script: str, bin_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    if any(shutil.which(b, path=SYSTEM_PATH) for b in ("docker", "podman", "buildah")):
        pytest.skip(f"a container builder is installed in {SYSTEM_PATH}")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("IMAGE", "PYTHON_IMAGE"))}
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                          timeout=120, env={**base, "PATH": f"{bin_dir}:{SYSTEM_PATH}", **env})


def test_without_a_builder_the_smoke_test_skips_with_one_line(tmp_path: Path) -> None:
    result = run("image-smoke.sh", stubs(tmp_path, RECORDING))
    assert (result.returncode, result.stdout) == (0, "no container builder: skipped\n")
    assert run("image.sh", stubs(tmp_path, RECORDING), "build").returncode == 3


@pytest.mark.parametrize(("present", "env", "picked"), [
    (("docker", "podman", "buildah"), {}, "docker"),
    (("docker", "podman", "buildah"), {"DOCKER_INFO_RC": "1"}, "podman"),  # a client without its daemon
    (("buildah",), {}, "buildah"),
    (("docker", "podman", "buildah"), {"IMAGE_BUILDER": "buildah"}, "buildah"),
])
def test_the_builder_is_the_one_named_else_the_first_present(
        tmp_path: Path, present: tuple[str, ...], env: dict[str, str], picked: str) -> None:
    result = run("image.sh", stubs(tmp_path, RECORDING, *present), "builder", STUB_LOG=str(tmp_path / "log"), **env)
    assert (result.returncode, result.stdout) == (0, f"{picked}\n")


def test_a_builder_named_but_absent_is_an_error(tmp_path: Path) -> None:
    result = run("image.sh", stubs(tmp_path, RECORDING, "docker"), "build", IMAGE_BUILDER="podman")
    assert result.returncode == 2 and "IMAGE_BUILDER=podman: not found" in result.stderr


def test_a_build_without_a_registry_names_the_local_base_and_never_pulls(tmp_path: Path) -> None:
    log = tmp_path / "log"
    result = run("image.sh", stubs(tmp_path, RECORDING, "buildah"), "build", STUB_LOG=str(log), IMAGE="t:1",
                 PYTHON_IMAGE="localhost/python:3.11-slim", IMAGE_PULL="never")
    assert result.returncode == 0, result.stderr
    assert log.read_text() == ("buildah bud --pull=never -t t:1 -f Dockerfile "
                               "--build-arg PYTHON_IMAGE=localhost/python:3.11-slim .\n")


def test_the_smoke_test_runs_check_config_and_check_against_the_simulator_in_the_image(tmp_path: Path) -> None:
    bin_dir = stubs(tmp_path, RUNNING, "docker")
    (bin_dir / "extproc").symlink_to(Path(sys.executable).parent / "extproc")
    result = run("image-smoke.sh", bin_dir, PYTHON=sys.executable, IMAGE="t:1")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("smoke: t:1 with docker against the simulator at http://127.0.0.1:")
    assert lines[-1] == "smoke: ok"
    assert "engine default: http://127.0.0.1:" in result.stdout and "[OK]" in result.stdout  # `extproc check`
