"""The chart's default image is the one the repository builds and publishes (Dockerfile,
.github/workflows/image.yml), at the version the chart was released with, run as the user the
image is made for."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from .conftest import CHART, Chart

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_image_is_the_published_one_at_the_charts_app_version(chart: Chart) -> None:
    rendered = chart.render({})
    image = rendered.container("admission")["image"]
    chart_yaml = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart_yaml["appVersion"] == version  # the workflow refuses a tag where these differ
    assert image == f"ghcr.io/llm-admission/llm-admission:{version}"
    workflow = (ROOT / ".github" / "workflows" / "image.yml").read_text()
    assert "IMAGE: ghcr.io/${{ github.repository_owner }}/llm-admission" in workflow
    assert image.rsplit(":", 1)[0].rsplit("/", 1)[1] == "llm-admission"


def test_the_image_runs_as_the_user_the_chart_expects_with_extproc_and_python_on_path(chart: Chart) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    context = chart.render({}).container("admission")["securityContext"]
    (user,) = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE)
    assert (int(user[0]), int(user[1])) == (context["runAsUser"], context["runAsGroup"]) == (10001, 10001)
    assert context["readOnlyRootFilesystem"] is True and "PYTHONDONTWRITEBYTECODE=1" in dockerfile
    # The chart runs `extproc serve ...` and a `python -c` preStop hook: both on the image's PATH.
    assert "ENV PATH=/opt/llm-admission/bin:$PATH" in dockerfile
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}$", dockerfile, re.MULTILINE)
    assert re.search(r"^ARG PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim-bookworm$", dockerfile, re.MULTILINE)
