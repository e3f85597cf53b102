"""The chart's `admission.estimate` values become the service's prompt-estimate settings (issue 11).

The defaults render the service's own defaults, field for field; a tokenizer is passed only when
set; the schema refuses what the service would refuse at startup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import Chart, helm
from .test_chart_ledger import admission_env, service_settings

ESTIMATE_ENV = ("ADMISSION_ESTIMATE", "ADMISSION_TOKENIZER", "ADMISSION_TOKENIZE_ABOVE_BYTES",
                "ADMISSION_TOKENIZE_TIMEOUT_MS", "ADMISSION_LEARN_BYTES_PER_TOKEN", "ADMISSION_BYTES_PER_TOKEN_MIN",
                "ADMISSION_BYTES_PER_TOKEN_MAX", "ADMISSION_TEMPLATE_TOKENS_FIXED",
                "ADMISSION_TEMPLATE_TOKENS_PER_MESSAGE", "ADMISSION_TEMPLATE_TOKENS_TOOLS")


def test_the_defaults_are_the_services_own(chart: Chart, tmp_path: Path) -> None:
    from extproc.config import load_settings

    r = chart.render({})
    env = admission_env(r)
    assert set(ESTIMATE_ENV) - set(env) == {"ADMISSION_TOKENIZER"}  # unset unless named
    settings = service_settings(r, tmp_path)
    own = load_settings({})
    assert settings.estimate == own.estimate
    assert settings.bytes_per_token == own.bytes_per_token == 2.5


def test_every_estimate_value_reaches_the_service(chart: Chart, tmp_path: Path) -> None:
    values = {"admission": {"estimate": {
        "mode": "bytes", "tokenizer": "llama3", "tokenizeAboveBytes": 0, "tokenizeTimeoutMs": 250,
        "learnBytesPerToken": False, "bytesPerTokenMin": 1.5, "bytesPerTokenMax": 3.5,
        "templateTokens": {"fixed": 40, "perMessage": 6, "tools": 120}}, "bytesPerToken": 4}}
    r = chart.render(values)
    assert admission_env(r)["ADMISSION_TOKENIZER"]["value"] == "llama3"
    e = service_settings(r, tmp_path).estimate
    assert (e.mode, e.tokenizer, e.tokenize_above_bytes, e.tokenize_timeout_seconds, e.learn) == (
        "bytes", "llama3", 0, 0.25, False)
    assert (e.bytes_per_token_min, e.bytes_per_token_max) == (1.5, 3.5)
    assert (e.template_fixed, e.template_per_message, e.template_tools) == (40, 6, 120)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"estimate": {"mode": "guess"}}, "at '/admission/estimate/mode'"),
        ({"estimate": {"tokenizer": "gpt2"}}, "at '/admission/estimate/tokenizer'"),
        ({"estimate": {"tokenizeTimeoutMs": 0}}, "at '/admission/estimate/tokenizeTimeoutMs'"),
        ({"estimate": {"bytesPerTokenMax": 0}}, "at '/admission/estimate/bytesPerTokenMax'"),
        ({"estimate": {"templateTokens": {"perMessage": -1}}}, "at '/admission/estimate/templateTokens/perMessage'"),
        ({"estimate": {"tokeniser": "qwen3"}}, "additional properties 'tokeniser' not allowed"),
    ],
)
def test_the_schema_refuses_bad_estimate_values(chart: Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as excinfo:
        chart.render({"admission": values})
    assert message in str(excinfo.value)
