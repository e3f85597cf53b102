"""Engines are required and checked: nothing installs pointing at a placeholder, and the values
say that each url must reach ONE vLLM process."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from .conftest import CHART, Chart, helm

ENGINE_REQUIRED = "engines is required: list the vLLM engines this gateway fronts"


@pytest.mark.parametrize("values", [{}, {"shape": "shared"}, {"engines": []}, {"engines": None}],
                         ids=["defaults", "shared", "empty", "null"])
def test_installing_without_engines_fails_saying_what_to_set(chart: Chart, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmRenderError) as excinfo:
        chart.render(values, as_given=True)
    message = str(excinfo.value)
    assert ENGINE_REQUIRED in message
    assert "--set 'engines[0].url=" in message and "ONE vLLM process" in message
    assert "not a ClusterIP over several replicas" in message


def test_the_chart_ships_no_engine_and_its_values_say_url_must_reach_one_process() -> None:
    text = (CHART / "values.yaml").read_text()
    assert yaml.safe_load(text)["engines"] == []
    assert "`url` must reach ONE vLLM process" in text and "ClusterIP Service over several vLLM replicas" in text
    readme = (CHART / "README.md").read_text()
    assert "ONE vLLM process" in readme


@pytest.mark.parametrize(
    ("engines", "message"),
    [
        ([{"name": "a", "url": "http://a:1", "models": ["m"]}, {"name": "a", "url": "http://b:1", "models": ["n"]}],
         'engines: name "a" is used twice'),
        ([{"name": "a", "url": "http://a:1", "models": ["m"]}, {"name": "b", "url": "http://b:1", "models": ["m"]}],
         'model "m" is listed for engines "a" and "b"'),
        ([{"name": "a", "url": "http://vllm:8000", "models": ["m"]},
          {"name": "b", "url": "http://VLLM:8000/", "models": ["n"]}],
         'engines: "a" and "b" have the same url'),
        ([{"name": "vllm", "url": "http://vllm:8000", "models": ["my-model"]}],
         'engines[0].models: "my-model" is the example placeholder'),
    ],
)
def test_engines_the_service_would_misuse_are_refused_at_render(chart: Chart, engines: list[dict[str, Any]],
                                                                message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render({"engines": engines})


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"name": "q", "url": "http://q:8000"}, "at '/engines/0': missing property 'models'"),
        ({"name": "q", "models": ["q"]}, "at '/engines/0': missing property 'url'"),
        ({"url": "http://q:8000", "models": ["q"]}, "at '/engines/0': missing property 'name'"),
        ({"name": "q", "url": "q:8000", "models": ["q"]}, "at '/engines/0/url'"),
    ],
)
def test_the_schema_names_an_incomplete_engine(chart: Chart, engine: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        chart.render({"engines": [engine]})


def test_an_engines_dialect_reaches_the_engines_file_and_the_schema_refuses_others(chart: Chart, tmp_path) -> None:  # noqa: ANN001
    from extproc.config import load_settings
    rendered = chart.render({"engines": [{"name": "s", "url": "http://s:30000", "models": ["s"], "dialect": "sglang"},
                                         {"name": "v", "url": "http://v:8000", "models": ["v"]}]})
    path = tmp_path / "engines.yaml"
    path.write_text(rendered.engines_yaml)
    assert [e.dialect for e in load_settings({"EXTPROC_CONFIG": str(path)}).engines] == ["sglang", "auto"]
    with pytest.raises(helm.HelmValuesError, match=re.escape("/engines/0/dialect")):
        chart.render({"engines": [{"name": "q", "url": "http://q:8000", "models": ["q"], "dialect": "tgi"}]})
